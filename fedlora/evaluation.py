"""The server's evaluation of a global adapter on the global test set (beside the clients'
training and evaluation in :mod:`fedlora.training` and :mod:`fedlora.causal_lm`).

:class:`GlobalEvaluator` holds the server-side models of a run: the common seeded initial adapter
and the adapted modules' shapes (:class:`fedlora.models.SeededAdapters`), and scores a strategy's
global adapter: accuracy for a classifier; ROUGE-L, loss and perplexity (and a few sample
generations) for a causal LM.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlora.lora import A_SUFFIX, Payload
from fedlora.models import SeededAdapters
from fedlora.results import RoundRecord
from fedlora.schema import ExperimentConfig

if TYPE_CHECKING:  # fedlora.data takes seconds to import; the caller has built the data already
    from peft import PeftModel

    from fedlora.data import FederatedData

GENERATIONS_FILE = "generations.jsonl"  # causal LMs: sample generations of the global model per evaluation round


class GlobalEvaluator(SeededAdapters):
    """Server-side models: the seeded initial adapter, module shapes (:class:`fedlora.models.
    SeededAdapters`), global-test accuracy (a causal LM: global-test ROUGE-L, loss and perplexity,
    and a few sample generations).

    What it evaluates with is resolved once per process, from the config sections it reads (``model``,
    ``train``, ``output.sample_generations``): the device and precision at construction, the tokenizer
    and the global test set's loader at the first evaluation (a method without a global model never
    evaluates, so never tokenises). ``init``: the method's LoRA init where it overrides ``model.init``
    (the strategy's ``model_init``, e.g. FedPissa's PiSSA)."""

    def __init__(self, config: ExperimentConfig, federated: FederatedData, init: str | None = None) -> None:
        from fedlora.backbones import resolve_device
        from fedlora.training import resolve_precision

        super().__init__(config.model, len(federated.label_names), seed=config.train.seed, init=init,
                         device=config.train.device)
        self.federated = federated
        self.train = config.train  # eval_batch_size, max_length; a causal LM's max_new_tokens, rouge_examples
        self.causal = config.model.kind == "causal_lm"
        self.sample_generations = config.output.sample_generations
        self.torch_device = resolve_device(config.train.device)
        self.precision = resolve_precision(config.train.precision, self.torch_device)

    def model_for(self, payload: Payload) -> PeftModel:
        """A peft model whose per-module ranks match ``payload``, with the payload loaded."""
        from fedlora.models import load_payload

        ranks = {k[: -len(A_SUFFIX)]: int(v.shape[0]) for k, v in payload.items() if k.endswith(A_SUFFIX)}
        model = self.build(ranks if ranks else self.model_cfg.lora_rank)
        load_payload(model, payload)
        return model

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The backbone's tokenizer, loaded once."""
        from fedlora.backbones import load_tokenizer

        return load_tokenizer(self.model_cfg.path)

    @functools.cached_property
    def loader(self) -> Any:
        """The global test set's loader, tokenised once: a classifier's rows, or a causal LM's instructions."""
        from fedlora.causal_lm import INSTRUCTIONS
        from fedlora.training import LABELLED_TEXTS, make_loader

        return make_loader(self.federated.global_test, self.tokenizer, self.train.eval_batch_size, self.train.max_length,
                           shuffle=False, rows=INSTRUCTIONS if self.causal else LABELLED_TEXTS)

    def accuracy(self, payload: Payload) -> float:
        from fedlora.training import evaluate

        return evaluate(self.model_for(payload), self.loader, self.torch_device, self.precision).accuracy

    def generation(self, payload: Payload) -> Any:
        """A causal LM's global model on the global test set (fedlora.causal_lm.GenerationEval)."""
        from fedlora.causal_lm import evaluate_generation

        cfg = self.train
        return evaluate_generation(self.model_for(payload), self.federated.global_test, self.loader, self.tokenizer,
                                   self.torch_device, cfg.max_new_tokens, cfg.rouge_examples, cfg.eval_batch_size,
                                   samples=self.sample_generations, precision=self.precision)

    def evaluate_into(self, payload: Payload, record: RoundRecord, out_dir: Path) -> None:
        """Global-test scores of ``payload`` into ``record``: accuracy, or for a causal LM ROUGE-L,
        loss and perplexity (and its sample generations appended to ``out_dir/generations.jsonl``)."""
        if not self.causal:
            record.global_accuracy = self.accuracy(payload)
            return
        scores = self.generation(payload)
        record.global_rouge_l, record.global_loss, record.global_perplexity = scores.rouge_l, scores.loss, scores.perplexity
        if scores.samples:
            with (out_dir / GENERATIONS_FILE).open("a", encoding="utf-8") as handle:
                for sample in scores.samples:
                    handle.write(json.dumps({"round": record.round, **sample}) + "\n")
