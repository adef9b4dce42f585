"""FedDPA's client: two peft LoRA adapters on the same modules, the global g ("default") and the
local l ("local"), both active (W0 + dW_g + dW_l) and trained jointly; only g (+head) goes up.

The local branch lives in the client state under keys prefixed ``local::`` (never in an upload).
Saved adapters: ``save_pretrained`` writes g (+head) at the folder's root and l in its ``local/``
subfolder; reload with ``PeftModel.from_pretrained(base, dir)``, then
``model.load_adapter(f"{dir}/local", adapter_name="local")`` and
``model.base_model.set_adapter(["default", "local"])``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from fedlora import protocol
from fedlora.clients.trainers.base import LocalTrainer
from fedlora.lora import Payload, from_peft_state, to_peft_state
from fedlora.models import adapter_payload, load_payload

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

LOCAL_BRANCH = "local"  # peft adapter name of l
LOCAL_PREFIX = "local::"  # client-state key prefix of l


def branch_payload(model: PeftModel, adapter: str) -> Payload:
    """The LoRA factors of one named peft adapter as a payload (``<module>::A`` / ``::B``)."""
    from peft import get_peft_model_state_dict

    return from_peft_state(get_peft_model_state_dict(model, adapter_name=adapter, save_embedding_layers=False))


def load_branch(model: PeftModel, adapter: str, payload: Payload) -> None:
    """Inverse of :func:`branch_payload` (shapes must match the adapter)."""
    from peft import set_peft_model_state_dict

    set_peft_model_state_dict(model, to_peft_state(payload), adapter_name=adapter)


def branch_scale_hooks(model: PeftModel, scales: dict[str, torch.Tensor]) -> list[Any]:
    """Forward hooks multiplying each named branch's output (its lora_B) by a per-example scale
    (batch,); remove them with ``handle.remove()``."""
    from peft.tuners.lora import LoraLayer

    handles = []
    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter, scale in scales.items():
            if adapter in layer.lora_B:

                def hook(_module: Any, _inputs: Any, output: torch.Tensor, scale: torch.Tensor = scale) -> torch.Tensor:
                    return output * scale.view(-1, *([1] * (output.dim() - 1))).to(output.dtype)

                handles.append(layer.lora_B[adapter].register_forward_hook(hook))
    return handles


def mean_embedding(model: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Attention-masked mean of the last hidden state (batch, hidden)."""
    hidden = model(**inputs, output_hidden_states=True).hidden_states[-1]  # (batch, seq, hidden)
    mask = inputs["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # (batch, seq, 1)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1.0)


def instance_weights(embeddings: torch.Tensor, reference: torch.Tensor, weight_max: float) -> torch.Tensor:
    """w(x) = weight_max * mean_j cos(e(x), e(x_j)), clipped to [0, weight_max]; shape (batch,)."""
    import torch.nn.functional as F

    cosine = F.cosine_similarity(embeddings[:, None, :], reference[None, :, :], dim=-1)  # (batch, n_ref)
    return (weight_max * cosine.mean(1)).clamp(0.0, weight_max)


def instance_weighted(model: PeftModel, reference: torch.Tensor, weight_max: float) -> Any:
    """An evaluation wrapper: W0 + 2 (1 - w(x)) dW_g + 2 w(x) dW_l, per input x (FedDPA's
    instance-wise weighting; w = 1/2 is the plain sum the branches were trained with)."""
    import torch

    class InstanceWeighted(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model
            self.weights: list[torch.Tensor] = []

        def forward(self, **inputs: torch.Tensor) -> Any:
            with torch.no_grad():
                w = instance_weights(mean_embedding(self.model, inputs), reference, weight_max)  # (batch,)
            self.weights.append(w.detach().cpu())
            handles = branch_scale_hooks(self.model, {"default": 2.0 * (1.0 - w), LOCAL_BRANCH: 2.0 * w})
            try:
                return self.model(**inputs)
            finally:
                for handle in handles:
                    handle.remove()

    return InstanceWeighted()


class FedDPATrainer(LocalTrainer):
    """g at the common global rank, l at this client's own rank; upload g (+head), keep both."""

    reuse_model = False  # not shown safe to reuse (it changes more than parameter values): built fresh


    def model_rank(self) -> int:
        """Rank of g (``strategy.global_rank``, 0 = ``model.lora_rank``)."""
        return int(self.options.rank_of_g(self.config.model.lora_rank))

    def prepare(self, download: Payload) -> PeftModel:
        from peft import LoraConfig

        model = self.build()  # g = peft's "default" adapter, + the head
        cfg = self.config.model
        local_config = LoraConfig(
            r=self.job.profile.rank,
            lora_alpha=cfg.lora_alpha,  # type: ignore[arg-type]  # peft annotates int, takes any float
            lora_dropout=cfg.lora_dropout,
            target_modules=cfg.target_modules,
            init_lora_weights=True,  # B_l = 0: l starts as a no-op
        )
        model.add_adapter(LOCAL_BRANCH, local_config)
        cast(Any, model.base_model).set_adapter(["default", LOCAL_BRANCH])  # forward sums both; both trainable
        state = self.local_state()
        global_part = {k: v for k, v in state.items() if not k.startswith(LOCAL_PREFIX)}
        local_part = {k.removeprefix(LOCAL_PREFIX): v for k, v in state.items() if k.startswith(LOCAL_PREFIX)}
        if global_part:
            load_payload(model, global_part)
        if local_part:
            load_branch(model, LOCAL_BRANCH, local_part)
        if download:
            load_payload(model, download)
        return model

    def keep(self, model: PeftModel) -> Payload:
        """g and the head (as the default adapter), and l under ``local::`` keys."""
        local = {LOCAL_PREFIX + k: v for k, v in branch_payload(model, LOCAL_BRANCH).items()}
        return adapter_payload(model) | local

    def evaluate(self, model: PeftModel, with_global: bool) -> dict[str, float]:
        """The plain sum, or (``strategy.instance_weighting``) the instance-weighted branches;
        then also ``dpa-mean-weight``, the mean w(x) over every evaluated input."""
        if not self.options.instance_weighting:
            return super().evaluate(model, with_global)
        import torch

        wrapper = instance_weighted(model, self.reference_embeddings(model), self.options.weight_max)
        metrics = super().evaluate(wrapper, with_global)
        metrics[protocol.FEDDPA_MEAN_WEIGHT] = float(torch.cat(wrapper.weights).mean()) if wrapper.weights else 0.0
        return metrics

    def reference_embeddings(self, model: PeftModel) -> torch.Tensor:
        """e(x_j) of ``strategy.reference_examples`` seeded local training inputs (n_ref, hidden)."""
        import numpy as np
        import torch

        from fedlora.training import make_loader, model_inputs

        train = self.job.data.train
        count = min(self.options.reference_examples, len(train))
        rng = np.random.default_rng(self.config.train.seed + self.job.profile.partition_id)
        subset = train.select(sorted(int(i) for i in rng.choice(len(train), size=count, replace=False)))
        loader = make_loader(subset, self.tokenizer, count, self.config.train.max_length, shuffle=False)
        model.to(self.device).eval()
        with torch.no_grad():
            return torch.cat([mean_embedding(model, model_inputs(batch, self.device)) for batch in loader])
