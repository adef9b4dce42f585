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
from fedlora.schema import ModelConfig, TrainConfig

if TYPE_CHECKING:  # fedlora.data takes seconds to import; the caller has built the data already
    import torch
    from peft import PeftModel

    from fedlora.data import FederatedData
    from fedlora.training import Precision

GENERATIONS_FILE = "generations.jsonl"  # causal LMs: sample generations of the global model per evaluation round


class GlobalEvaluator(SeededAdapters):
    """Server-side models: the seeded initial adapter, module shapes (:class:`fedlora.models.
    SeededAdapters`), global-test accuracy (a causal LM: global-test ROUGE-L, loss and perplexity,
    and ``samples`` sample generations, ``output.sample_generations``).

    It takes the run's ``model`` and ``train`` sections; what it evaluates with is resolved once, at
    first use: the device and precision, the backbone's tokenizer (one per process) and the global test
    set's loader (a method without a global model never evaluates, so never tokenises). ``init``: the
    method's LoRA init where it overrides ``model.init`` (the strategy's ``model_init``, e.g. FedPissa's
    PiSSA)."""

    def __init__(self, model: ModelConfig, train: TrainConfig, federated: FederatedData, samples: int = 0,
                 init: str | None = None) -> None:
        super().__init__(model, len(federated.label_names), seed=train.seed, init=init, device=train.device)
        self.federated = federated
        self.train = train  # eval_batch_size, max_length; a causal LM's max_new_tokens, rouge_examples
        self.causal = model.kind == "causal_lm"
        self.samples = samples

    @functools.cached_property
    def torch_device(self) -> torch.device:
        """``train.device`` resolved ('auto': CUDA when present)."""
        from fedlora.backbones import resolve_device

        return resolve_device(self.train.device)

    @functools.cached_property
    def precision(self) -> Precision:
        """``train.precision`` resolved for the device ('auto': bf16 where it is native)."""
        from fedlora.training import resolve_precision

        return resolve_precision(self.train.precision, self.torch_device)

    @functools.cached_property
    def tokenizer(self) -> Any:
        """The backbone's tokenizer (loaded once per process)."""
        from fedlora.backbones import load_tokenizer

        return load_tokenizer(self.model_cfg.path)

    @functools.cached_property
    def loader(self) -> Any:
        """The global test set's loader, tokenised once: a classifier's rows, or a causal LM's instructions."""
        from fedlora.causal_lm import INSTRUCTIONS
        from fedlora.training import LABELLED_TEXTS, make_loader

        return make_loader(self.federated.global_test, self.tokenizer, self.train.eval_batch_size, self.train.max_length,
                           shuffle=False, rows=INSTRUCTIONS if self.causal else LABELLED_TEXTS)

    def model_for(self, payload: Payload) -> PeftModel:
        """A peft model whose per-module ranks match ``payload``, with the payload loaded."""
        from fedlora.models import load_payload

        ranks = {k[: -len(A_SUFFIX)]: int(v.shape[0]) for k, v in payload.items() if k.endswith(A_SUFFIX)}
        model = self.build(ranks if ranks else self.model_cfg.lora_rank)
        load_payload(model, payload)
        return model

    def accuracy(self, payload: Payload) -> float:
        """A classifier's global-test accuracy of ``payload``."""
        from fedlora.training import evaluate

        return evaluate(self.model_for(payload), self.loader, self.torch_device, self.precision).accuracy

    def evaluate_into(self, payload: Payload, record: RoundRecord, out_dir: Path) -> None:
        """Global-test scores of ``payload`` into ``record``: accuracy, or for a causal LM ROUGE-L,
        loss and perplexity (and its sample generations appended to ``out_dir/generations.jsonl``)."""
        from fedlora.causal_lm import evaluate_generation
        from fedlora.training import evaluate

        model = self.model_for(payload)
        if not self.causal:
            record.global_accuracy = evaluate(model, self.loader, self.torch_device, self.precision).accuracy
            return
        train = self.train
        scores = evaluate_generation(model, self.federated.global_test, self.loader, self.tokenizer,
                                     self.torch_device, train.max_new_tokens, train.rouge_examples,
                                     train.eval_batch_size, samples=self.samples, precision=self.precision)
        record.global_rouge_l, record.global_loss, record.global_perplexity = scores.rouge_l, scores.loss, scores.perplexity
        if scores.samples:
            with (out_dir / GENERATIONS_FILE).open("a", encoding="utf-8") as handle:
                for sample in scores.samples:
                    handle.write(json.dumps({"round": record.round, **sample}) + "\n")
