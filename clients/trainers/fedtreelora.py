"""FedTreeLoRA's client: mix the cluster expert and the frozen external expert per block.

h = W0 x + lam_l B_c A_c x + (1 - lam_l) B_e A_e x, lam_l = sigmoid(theta_l) (fedlora/methods/fedtreelora.py,
FedTreeLoRA, step 5). The cluster expert is peft's ``default`` adapter (trainable, uploaded);
the external expert is a second peft adapter ``external`` (frozen), active at the same time in
the blocks that have one. The mixing is done by each LoRA layer's own scaling: a forward
pre-hook sets ``scaling[default] = s lam_l`` and ``scaling[external] = s (1 - lam_l)`` from
theta as tensors, so the gradient reaches theta. theta is local: it stays in the client state
and never travels. Blocks whose cut is c = 1 get no external expert and keep lam = 1 (FedIT).
theta has its own AdamW parameter group at ``strategy.mixing_lr`` without weight decay (at the
LoRA learning rate for a few steps a round it barely moves); ``mixing_lr = 0`` freezes it at
logit(lam0). After training, the client reports lam of every mixed block
(``fedtreelora-lam-<block>``) for the round's record.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fedlora import protocol
from fedlora.clients.trainers.base import LocalTrainer
from fedlora.lora import A_SUFFIX, Payload, payload_module, peft_module, to_peft_state
from fedlora.methods.fedtreelora import EXTERNAL_PREFIX
from fedlora.models import adapter_payload, layer_index, load_payload

if TYPE_CHECKING:
    import torch
    from peft import PeftModel

THETA_KEY = "fedtreelora::theta"  # local state only: (L,) mixing logits, one per block
EXTERNAL_ADAPTER = "external"


def initial_theta(blocks: int, lam0: float) -> np.ndarray:
    """theta_l = logit(lam0) for every block, so lam_l = sigmoid(theta_l) starts at lam0 (strategy.lam0)."""
    return np.full(blocks, math.log(lam0 / (1.0 - lam0)), dtype=np.float32)  # (L,)


def add_external_expert(model: PeftModel, external: Payload, lora_alpha: float, dropout: float) -> list[str]:
    """Add the frozen ``external`` adapter on the modules that ``external`` names and load it;
    both adapters are then active on those modules (each layer's ``set_adapter``: the other
    modules keep ``default`` alone). Returns the modules."""
    from peft import LoraConfig, set_peft_model_state_dict
    from peft.tuners.lora import LoraLayer

    modules = sorted({k.rsplit("::", 1)[0] for k in external})
    rank = int(external[modules[0] + A_SUFFIX].shape[0])
    config = LoraConfig(r=rank, lora_alpha=lora_alpha, lora_dropout=dropout, target_modules=modules)  # type: ignore[arg-type]
    model.add_adapter(EXTERNAL_ADAPTER, config)
    set_peft_model_state_dict(model, to_peft_state(external), adapter_name=EXTERNAL_ADAPTER)
    for layer in model.modules():
        if isinstance(layer, LoraLayer) and EXTERNAL_ADAPTER in layer.lora_A:
            layer.set_adapter(["default", EXTERNAL_ADAPTER])  # both experts in the forward (both trainable)
            for parameter in (layer.lora_A[EXTERNAL_ADAPTER].weight, layer.lora_B[EXTERNAL_ADAPTER].weight):
                parameter.requires_grad_(False)  # the external expert is frozen
    return modules


def attach_mixer(model: PeftModel, theta: torch.nn.Parameter, mixed_modules: list[str]) -> None:
    """Register theta on the model (so the optimiser trains it) and a pre-hook on every mixed
    module that sets its two scalings from lam = sigmoid(theta_l)."""
    import torch
    from peft.tuners.lora import LoraLayer

    model.mixing_logits = theta  # registered parameter: model.parameters() yields it
    wanted = {peft_module(m) for m in mixed_modules}
    for name, layer in model.named_modules():
        if not (isinstance(layer, LoraLayer) and name in wanted):
            continue
        block = layer_index(payload_module(name))
        scale = {adapter: float(layer.scaling[adapter]) for adapter in ("default", EXTERNAL_ADAPTER)}

        def mix(module, args, block=block, scale=scale):
            lam = torch.sigmoid(theta[block])
            module.scaling["default"] = scale["default"] * lam
            module.scaling[EXTERNAL_ADAPTER] = scale[EXTERNAL_ADAPTER] * (1 - lam)

        cast(Any, layer).register_forward_pre_hook(mix)


class FedTreeLoRATrainer(LocalTrainer):
    """Cluster expert (trainable, uploaded) + frozen external expert, mixed by a local lam."""

    reuse_model = False  # not shown safe to reuse (it changes more than parameter values): built fresh


    def prepare(self, download: Payload) -> PeftModel:
        import torch

        model = self.build()
        local = self.local_state()
        blocks = 1 + max(layer_index(m) for m in self._modules(model))
        theta_init = local.pop(THETA_KEY, initial_theta(blocks, self.options.lam0))
        if local:
            load_payload(model, local)
        own = {k: v for k, v in download.items() if not k.startswith(EXTERNAL_PREFIX)}
        external = {k[len(EXTERNAL_PREFIX) :]: v for k, v in download.items() if k not in own}
        if own:
            load_payload(model, own)
        self.theta = torch.nn.Parameter(torch.tensor(theta_init, dtype=torch.float32))
        self.mixed_blocks: list[int] = []
        if external:
            cfg = self.config.model
            mixed = add_external_expert(model, external, cfg.lora_alpha, cfg.lora_dropout)
            attach_mixer(model, self.theta, mixed)
            self.mixed_blocks = sorted({layer_index(m) for m in mixed})
        return model

    def parameter_groups(self, model: PeftModel, loader: Any) -> list[dict[str, Any]]:
        """The LoRA factors and the head at this round's ``train.lr`` (:attr:`lr`); theta (when this round mixes a block) in
        its own group at ``strategy.mixing_lr`` without weight decay; ``mixing_lr = 0``: frozen."""
        lora = [p for p in self.trainable_parameters(model, loader) if p is not self.theta]
        groups: list[dict[str, Any]] = [{"params": lora}]
        if self.mixed_blocks and self.options.mixing_lr > 0:
            groups.append({"params": [self.theta], "lr": self.options.mixing_lr, "weight_decay": 0.0})
        else:
            self.theta.requires_grad_(False)  # lam stays at its value (lam0 when mixing_lr = 0)
        return groups

    @staticmethod
    def _modules(model: PeftModel) -> list[str]:
        return [k.removesuffix(A_SUFFIX) for k in adapter_payload(model) if k.endswith(A_SUFFIX)]

    def upload(self, model: PeftModel) -> Payload:
        """Nothing in the warm-up rounds before the last (the tree needs only the last B);
        afterwards the cluster expert A, B (and the head when it is global)."""
        if self.job.server_round < self.options.warmup_rounds:
            return {}
        return super().upload(model)

    def keep(self, model: PeftModel) -> Payload:
        """The cluster expert, head and the local mixing logits theta."""
        return {**adapter_payload(model), THETA_KEY: self.theta.detach().cpu().numpy().copy()}

    def train_metrics(self) -> dict[str, float]:
        """lam = sigmoid(theta_l) after training, for every block this round mixed."""
        lam = self.theta.detach().sigmoid().cpu().numpy()
        return {f"{protocol.FEDTREELORA_LAM_PREFIX}{block}": float(lam[block]) for block in self.mixed_blocks}
