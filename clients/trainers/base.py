"""The client half of a strategy: build the local model, merge what came down with what stayed
local, train, and say what goes up.

The rule every method follows (docs/algorithms.md, "client receives / keeps"): the client's model is
its *local state* (the adapter it kept after its last round, if any) overlaid with the
*download* (what the server sent this round). So FedSA-LoRA's client keeps B and takes A,
FedPissa's keeps A and takes B, ``local`` takes nothing. A method subclass changes the parts that
differ: :meth:`model_rank`, :meth:`prepare`, :meth:`loss`, :meth:`after_backward`,
:meth:`upload`, :meth:`keep`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, cast

from fedlora import protocol
from fedlora.backbones import load_tokenizer, resolve_device
from fedlora.causal_lm import (
    INSTRUCTIONS,
    GenerationEval,
    causal_lm_loss,
    evaluate_generation,
    response_loss,
    teacher_forced,
)
from fedlora.data import ClientData, FederatedData
from fedlora.lora import Payload, from_array_record, to_array_record, without_head
from fedlora.methods import options_of
from fedlora.models import MODELS, adapter_payload, build_model, load_payload
from fedlora.profile import ClientProfile
from fedlora.schema import ExperimentConfig
from fedlora.training import (
    LABELLED_TEXTS,
    EvalStats,
    Precision,
    StepOptions,
    TrainStats,
    cross_entropy_loss,
    evaluate,
    make_loader,
    resolve_precision,
    train,
)

if TYPE_CHECKING:
    import torch
    from flwr.app import RecordDict
    from peft import PeftModel

    from fedlora.privacy import History

LOCAL_STATE_KEY = "fedlora.local"
PRIVACY_STATE_KEY = "fedlora.privacy"  # the client's DP accountant history (all its rounds)


@dataclass
class ClientJob:
    """Everything a client needs for one message."""

    config: ExperimentConfig
    profile: ClientProfile
    data: ClientData
    federated: FederatedData
    state: RecordDict  # context.state: survives rounds in simulation and deployment
    message_config: dict[str, Any]

    @property
    def server_round(self) -> int:
        return int(self.message_config.get(protocol.SERVER_ROUND, 0))


class LocalTrainer:
    """FedIT's and FlexLoRA's client (and the default): train A, B and the head at the rank the
    server decided; upload them all."""

    # Whether this trainer's model may come from (and go back to) the process's model pool: only when
    # nothing but parameter values and ``requires_grad`` change while it is used (no added adapters,
    # hooks or attributes). A subclass that changes more sets it to False.
    reuse_model: ClassVar[bool] = True


    def __init__(self, job: ClientJob) -> None:
        self.job = job
        self.config = job.config
        self.options = options_of(job.config)  # the method's typed options (defaults from its home)
        self.device: torch.device = resolve_device(job.config.train.device)
        self.precision: Precision = resolve_precision(job.config.train.precision, self.device)
        self.tokenizer = load_tokenizer(job.config.model.path)

    # ------------------------------------------------------------------ model
    def model_rank(self) -> int | dict[str, int]:
        """The rank of this client's adapter (one for all modules, or per module)."""
        return self.job.profile.rank

    @property
    def causal(self) -> bool:
        """Whether this run fine-tunes a causal LM on instructions (``model.kind = 'causal_lm'``)."""
        return self.config.model.kind == "causal_lm"

    def build(self) -> PeftModel:
        """The client's model as built (:func:`fedlora.models.build_model`), taken from the process's
        :data:`~fedlora.models.MODELS` pool where that is safe (:attr:`reuse_model`, a classifier on
        the CPU, no DP-SGD); :meth:`release` hands it back once the message is answered."""
        cfg = self.config
        args = (cfg.model, len(self.job.federated.label_names), self.model_rank())
        if self.reuse_model and cfg.model.kind == "classification" and self.device.type == "cpu" and not cfg.privacy.dp:
            return MODELS.take(*args, seed=cfg.train.seed, device=cfg.train.device)
        return build_model(*args, seed=cfg.train.seed, device=cfg.train.device)

    def release(self, model: PeftModel) -> None:
        """The message is answered: ``model`` goes back to the pool it came from (if any)."""
        MODELS.give_back(model)

    def prepare(self, download: Payload) -> PeftModel:
        """Local state overlaid with the download (one load: a key in both takes the download's value)."""
        model = self.build()
        payload = {**self.local_state(), **download}
        if payload:
            load_payload(model, payload)
        return model

    # ------------------------------------------------------------------ training
    def loss(self, model: PeftModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """Cross-entropy of the classifier, or a causal LM's per-sample response loss."""
        return causal_lm_loss(model, batch) if self.causal else cross_entropy_loss(model, batch)

    def after_backward(self, model: PeftModel) -> None:
        """Hook between backward and the optimiser step (e.g. gradient gating)."""

    @property
    def lr(self) -> float:
        """This round's learning rate (``train.lr`` after ``train.lr_decay_rounds``)."""
        return self.config.train.lr_at(self.job.server_round)

    def fit(self, model: PeftModel) -> TrainStats:
        if self.config.privacy.dp:
            return self.fit_private(model)
        cfg = self.config.train
        loader = self.loader(self.job.data.train, "train", shuffle=True)
        return train(
            model,
            loader,
            epochs=cfg.local_epochs,
            lr=self.lr,
            device=self.device,
            max_steps=cfg.max_steps,
            weight_decay=cfg.weight_decay,
            loss_fn=self.loss,
            after_backward=self.after_backward,
            parameters=self.parameter_groups(model, loader),
            precision=self.precision,
            options=self.step_options(),
        )

    def step_options(self) -> StepOptions:
        """How the step loop runs: ``[train]``'s knobs (accumulation, schedule, clipping, FedProx),
        its progress labelled with this client and round."""
        return StepOptions.of(self.config.train, f"client {self.job.profile.partition_id}, round {self.job.server_round}")

    def trainable_parameters(self, model: PeftModel, loader: Any) -> list[torch.nn.Parameter]:
        """What the optimiser updates (default: the model's trainable parameters); a method with
        parameters outside the model (e.g. FedDR-LoRA's noise branch) adds them here."""
        return [p for p in model.parameters() if p.requires_grad]

    def parameter_groups(self, model: PeftModel, loader: Any) -> list[dict[str, Any]]:
        """The optimiser's parameter groups (default: one group, :meth:`trainable_parameters` at
        ``train.lr`` and ``train.weight_decay``); a method whose extra parameters need their own
        learning rate (e.g. FedTreeLoRA's mixing logits) returns more groups, each dict overriding
        AdamW's ``lr`` / ``weight_decay`` for its parameters."""
        return [{"params": self.trainable_parameters(model, loader)}]

    def fit_private(self, model: PeftModel) -> TrainStats:
        """DP-SGD with Opacus (fedlora.privacy); the accountant's history stays in the client's
        state so epsilon composes over every round this client trained."""
        from flwr.app import ConfigRecord

        from fedlora.privacy import private_train

        customised = ("fit", "after_backward", "trainable_parameters", "parameter_groups")
        if any(getattr(type(self), name) is not getattr(LocalTrainer, name) for name in customised):
            raise ValueError(f"privacy.dp: {type(self).__name__} customises its training step; DP-SGD not supported")
        cfg, privacy = self.config.train, self.config.privacy
        history = self._privacy_history()
        # reproducible_noise is for research runs only: the server knows this seed (docs: README, privacy)
        seed = cfg.seed + 1000 * self.job.server_round + self.job.profile.partition_id if privacy.reproducible_noise else None
        result = private_train(
            model, self.loader(self.job.data.train, "train", shuffle=True), privacy=privacy,
            epochs=cfg.local_epochs, lr=self.lr, device=self.device, rounds=cfg.rounds, history=history,
            seed=seed, max_steps=cfg.max_steps, weight_decay=cfg.weight_decay, loss_fn=self.loss,
            options=self.step_options(),
        )
        self.job.state[PRIVACY_STATE_KEY] = ConfigRecord({
            "noise": [float(h[0]) for h in result.history], "rate": [float(h[1]) for h in result.history],
            "steps": [int(h[2]) for h in result.history],
        })
        self.privacy = {protocol.DP_EPSILON: result.epsilon, protocol.DP_NOISE_MULTIPLIER: result.noise_multiplier,
                        protocol.DP_SAMPLE_RATE: result.sample_rate}
        return result.stats

    def _privacy_history(self) -> History:
        """The client's accountant history over its earlier rounds (from its state)."""
        stored = self.job.state.config_records.get(PRIVACY_STATE_KEY)
        if stored is None:
            return []
        noise, rate, steps = (cast("list[float]", stored[key]) for key in ("noise", "rate", "steps"))
        return [(float(n), float(r), int(s)) for n, r, s in zip(noise, rate, steps)]

    def privacy_metrics(self) -> dict[str, float]:
        """``dp-epsilon`` (this client's epsilon over all its rounds) etc. after a private fit."""
        return dict(getattr(self, "privacy", {}))

    def train_metrics(self) -> dict[str, float]:
        """Method-specific metrics of the last :meth:`fit` (e.g. FedDR-LoRA's noise recall)."""
        return {}

    def upload(self, model: PeftModel) -> Payload:
        """What goes up: the whole adapter, without the head when the head is local."""
        payload = adapter_payload(model)
        return without_head(payload) if self.config.model.head == "local" else payload

    def keep(self, model: PeftModel) -> Payload:
        """What stays on the client for the next round (default: the whole adapter)."""
        return adapter_payload(model)

    # ------------------------------------------------------------------ evaluation
    def loader(self, dataset, split: str, shuffle: bool = False):
        cfg = self.config.train
        owner = "" if split == "global" else f"{self.job.profile.partition_id}|{self.job.profile.data_path}"  # one global test
        key = f"{self.config.data.model_dump_json()}|{self.config.model.path}|{owner}|{split}"
        seed = self.config.train.seed + 1000 * self.job.server_round + self.job.profile.partition_id
        size = cfg.batch_size if shuffle else cfg.eval_batch_size
        rows, key = (INSTRUCTIONS, f"{key}|{cfg.max_length}") if self.causal else (LABELLED_TEXTS, key)
        return make_loader(dataset, self.tokenizer, size, cfg.max_length, shuffle=shuffle, seed=seed, cache_key=key,
                           group_by_length=cfg.group_by_length, rows=rows)

    def received_metrics(self, model: PeftModel) -> dict[str, float]:
        """``received-accuracy`` / ``-examples``: the model as received (before local training) on
        the local test split (FedHera's official metric). A causal LM reports it teacher-forced,
        as the official code does (no generation): ``received-token-accuracy`` and
        ``received-loss`` per response token, weighted by ``received-tokens``."""
        if self.causal:
            scored = teacher_forced(model, self.loader(self.job.data.test, "test"), self.device, self.precision)
            if not scored.tokens:
                return {}
            return {protocol.RECEIVED_TOKEN_ACCURACY: scored.accuracy, protocol.RECEIVED_LOSS: scored.loss,
                    protocol.RECEIVED_TOKENS: float(scored.tokens)}
        test: EvalStats = evaluate(model, self.loader(self.job.data.test, "test"), self.device, self.precision)
        if not math.isfinite(test.accuracy):
            return {}
        return {protocol.RECEIVED_ACCURACY: test.accuracy, protocol.RECEIVED_EXAMPLES: float(test.examples)}

    def evaluate(self, model: PeftModel, with_global: bool) -> dict[str, float]:
        """Accuracy on the local test split and validation split (and the global test set); for
        a causal LM :meth:`evaluate_generation`."""
        if self.causal:
            return self.evaluate_generation(model, with_global)
        test: EvalStats = evaluate(model, self.loader(self.job.data.test, "test"), self.device, self.precision)
        metrics = {protocol.ACCURACY: test.accuracy, protocol.LOSS: test.loss, protocol.NUM_EXAMPLES: float(test.examples)}
        if len(self.job.data.val):
            val = evaluate(model, self.loader(self.job.data.val, "val"), self.device, self.precision)
            metrics |= {protocol.VAL_ACCURACY: val.accuracy, protocol.VAL_EXAMPLES: float(val.examples)}
        if with_global:
            glob = evaluate(model, self.loader(self.job.federated.global_test, "global"), self.device,
                            self.precision)
            metrics[protocol.GLOBAL_ACCURACY] = glob.accuracy
        return {k: (v if math.isfinite(v) else 0.0) for k, v in metrics.items()}

    def evaluate_generation(self, model: PeftModel, with_global: bool) -> dict[str, float]:
        """A causal LM on its local test split: ``rouge-l`` (greedy generations), ``loss`` /
        ``perplexity`` per response token (``tokens``); ``val-loss`` on the validation split; the
        same with a ``global-`` prefix on the global test set when asked."""
        def scores(dataset: Any, split: str) -> GenerationEval:
            cfg = self.config.train
            return evaluate_generation(model, dataset, self.loader(dataset, split), self.tokenizer, self.device,
                                       cfg.max_new_tokens, cfg.rouge_examples, cfg.eval_batch_size,
                                       precision=self.precision)

        test = scores(self.job.data.test, "test")
        metrics = {protocol.ROUGE_L: test.rouge_l, protocol.LOSS: test.loss, protocol.PERPLEXITY: test.perplexity,
                   protocol.TOKENS: float(test.tokens), protocol.NUM_EXAMPLES: float(test.examples),
                   protocol.ROUGE_EXAMPLES: float(test.rouge_examples)}
        if len(self.job.data.val):
            val_loss, val_tokens = response_loss(model, self.loader(self.job.data.val, "val"), self.device,
                                                 self.precision)
            metrics |= {protocol.VAL_LOSS: val_loss, protocol.VAL_TOKENS: float(val_tokens),
                        protocol.VAL_EXAMPLES: float(len(self.job.data.val))}
        if with_global:
            glob = scores(self.job.federated.global_test, "global")
            metrics |= {protocol.GLOBAL_ROUGE_L: glob.rouge_l, protocol.GLOBAL_LOSS: glob.loss,
                        protocol.GLOBAL_TOKENS: float(glob.tokens)}
        return {k: (v if math.isfinite(v) else 0.0) for k, v in metrics.items()}

    # ------------------------------------------------------------------ state
    def local_state(self) -> Payload:
        if LOCAL_STATE_KEY not in self.job.state:
            return {}
        return from_array_record(self.job.state.array_records[LOCAL_STATE_KEY])

    def save_state(self, payload: Payload) -> None:
        self.job.state[LOCAL_STATE_KEY] = to_array_record(payload)
