"""FLoRA's client: merge the downloaded stacks into the frozen base, restart a fresh LoRA, train.

The merged update (the sum of every stack's B A so far, one dense d_out x d_in array per module,
the size of the layer itself) and the ids of the merged rounds are the client's local state, so a
fresh ClientApp process (deployment) rebuilds the same base: W0 + merged. A stack arriving again
(the server resends what a failed round did not confirm) is merged only once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fedlora.clients.trainers.base import LocalTrainer
from fedlora.lora import Payload, head_only, kaiming_bound, peft_module, read_stacks
from fedlora.models import adapter_payload, load_payload, protect_base_weights

if TYPE_CHECKING:
    from peft import PeftModel

MERGED_PREFIX = "merged::"  # local state: merged::<module> = sum of merged B A (d_out, d_in)
MERGED_ROUNDS_KEY = "merged-rounds"


class FLoRATrainer(LocalTrainer):
    """FLoRA's client (see the module docstring)."""

    reuse_model = False  # not shown safe to reuse (it changes more than parameter values): built fresh


    def prepare(self, download: Payload) -> PeftModel:
        model = self.build()
        local = self.local_state()
        merged = {k.removeprefix(MERGED_PREFIX): v for k, v in local.items() if k.startswith(MERGED_PREFIX)}
        rounds = {int(t) for t in local.get(MERGED_ROUNDS_KEY, np.zeros(0, dtype=np.int64))}
        for server_round, stack in read_stacks(download).items():
            if server_round in rounds:
                continue
            for module, f in stack.items():
                delta = f.B.astype(np.float64) @ f.A  # (d_out, d_in), unit scale
                merged[module] = (merged.get(module, 0.0) + delta).astype(np.float32)
            rounds.add(server_round)
        self.merged, self.merged_rounds = merged, sorted(rounds)
        self._merge_into_base(model, merged)
        self._fresh_lora(model)
        head = head_only(local) | head_only(download)
        if head:
            load_payload(model, head)
        return model

    def _merge_into_base(self, model: PeftModel, merged: dict[str, np.ndarray]) -> None:
        """W0 <- W0 + merged (a classifier's backbone is a per-model copy; a causal LM's shared base
        gets its original weights back before the next model is built)."""
        import torch

        protect_base_weights(model, merged)
        with torch.no_grad():
            for module, delta in merged.items():
                layer: Any = model.get_submodule(peft_module(module)).base_layer
                layer.weight += torch.from_numpy(delta).to(layer.weight.dtype)

    def _fresh_lora(self, model: PeftModel) -> None:
        """Re-initialise every LoRA module, seeded by (train.seed, round): B = 0, A random."""
        import torch
        from peft.tuners.lora import LoraLayer

        generator = torch.Generator().manual_seed(self.config.train.seed * 100_003 + self.job.server_round)
        with torch.no_grad():
            for layer in model.modules():
                if not isinstance(layer, LoraLayer):
                    continue
                for name in layer.lora_A:
                    A, B = cast("torch.Tensor", layer.lora_A[name].weight), cast("torch.Tensor", layer.lora_B[name].weight)
                    if self.config.model.init == "gaussian":
                        A.copy_(torch.randn(A.shape, generator=generator) / A.shape[0])
                    else:  # peft's default (kaiming): uniform with a = sqrt(5)
                        bound = kaiming_bound(A.shape[1])
                        A.copy_(torch.rand(A.shape, generator=generator) * 2 * bound - bound)
                    B.zero_()

    def keep(self, model: PeftModel) -> Payload:
        """The head, the merged update and the merged round ids (the LoRA restarts anyway)."""
        kept = head_only(adapter_payload(model))
        kept |= {MERGED_PREFIX + m: v for m, v in self.merged.items()}
        kept[MERGED_ROUNDS_KEY] = np.asarray(self.merged_rounds, dtype=np.int64)
        return kept
