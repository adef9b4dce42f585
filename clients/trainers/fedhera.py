"""FedHera's client: resize to r_tot, load the push, warm the tail up, train only the prefix.

The method's home is ``fedlora/methods/fedhera.py`` (the official code's client, ``adaptive_peft.py``). The server sends, per module, the top-r_tot spectrum of the
global update (the payload's shapes give r_tot), and in the message config r_main per module and
lambda. The client builds a fresh adapter at those ranks every round, scales the tail (rows
r_main: of A, columns r_main: of B) by sqrt(lambda), and trains with *prefix gating*: after
every backward the gradients outside A[:r_main, :] and B[:, :r_main] are zeroed, so with weight
decay 0 the tail never moves but still acts in the forward pass as a frozen reference. It
uploads all of A and B (tail included) and the head.

A module with r_main = 0 is frozen on this client (official ``apply_lora_prefix_mask``: a zero
mask); one with r_tot = 0 is not adapted here: the server sends nothing for it (r_tot travels in
the config), the client holds a zero rank-1 placeholder (peft cannot build a rank-0 layer;
A = B = 0 changes nothing and gets no gradient) and does not upload it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, cast

from fedlora import protocol
from fedlora.clients.trainers.base import LocalTrainer
from fedlora.lora import A_SUFFIX, B_SUFFIX, Payload, head_only, join_payload, payload_module, split_payload
from fedlora.methods.fedhera import scale_tail
from fedlora.models import load_payload

if TYPE_CHECKING:
    import torch
    from peft import PeftModel


def prefix_parameters(model: PeftModel) -> dict[str, tuple[torch.nn.Parameter, torch.nn.Parameter]]:
    """Module name (as in payloads) -> (A weight (r, d_in), B weight (d_out, r)) of every LoRA layer."""
    from peft.tuners.lora import LoraLayer

    return {
        payload_module(name): cast(
            "tuple[torch.nn.Parameter, torch.nn.Parameter]",
            (layer.lora_A["default"].weight, layer.lora_B["default"].weight),
        )
        for name, layer in model.named_modules()
        if isinstance(layer, LoraLayer)
    }


def gate_prefix(parameters: Mapping[str, tuple[torch.nn.Parameter, torch.nn.Parameter]], r_main: Mapping[str, int]) -> None:
    """Zero the gradients outside A[:r_main, :] and B[:, :r_main] (prefix gating)."""
    for module, (A, B) in parameters.items():
        if A.grad is not None:
            A.grad[r_main[module]:] = 0.0  # tail rows of A
        if B.grad is not None:
            B.grad[:, r_main[module]:] = 0.0  # tail columns of B


class FedHeraTrainer(LocalTrainer):
    """FedHera's client (see the module docstring)."""

    reuse_model = False  # not shown safe to reuse (it changes more than parameter values): built fresh


    def model_rank(self) -> int | dict[str, int]:
        return {m: max(r, 1) for m, r in self.r_tot.items()}  # r_tot = 0: a rank-1 zero placeholder

    def prepare(self, download: Payload) -> PeftModel:
        """A fresh adapter at r_tot per module with the push loaded and its tail scaled."""
        import torch

        factors, extras = split_payload(download)
        received = {m: f.rank for m, f in factors.items()}
        config = self.job.message_config
        declared: dict[str, int] = json.loads(str(config.get(protocol.FEDHERA_R_TOT, "{}"))) or dict(received)
        if {m: r for m, r in declared.items() if r > 0} != received:
            raise ValueError(f"fedhera: download ranks {received} differ from the announced r_tot {declared}")
        self.r_tot = declared
        self.r_main: dict[str, int] = json.loads(str(config.get(protocol.FEDHERA_R_MAIN, "{}"))) or dict(self.r_tot)
        lam = float(config.get(protocol.FEDHERA_LAMBDA, 1.0))
        model = self.build()
        local_head = head_only(self.local_state())
        if local_head and self.config.model.head == "local":
            load_payload(model, local_head)
        load_payload(model, join_payload(scale_tail(factors, self.r_main, lam), extras))
        self.gated = prefix_parameters(model)
        with torch.no_grad():
            for m in self.unadapted:
                A, B = self.gated[m]
                A.zero_()
                B.zero_()
        return model

    @property
    def unadapted(self) -> list[str]:
        """Modules with r_tot = 0 on this client (nothing received, nothing trained or sent)."""
        return [m for m, r in self.r_tot.items() if r == 0]

    def after_backward(self, model: PeftModel) -> None:
        gate_prefix(self.gated, self.r_main)

    def upload(self, model: PeftModel) -> Payload:
        """A and B of every adapted module (frozen ones included) and the head."""
        dropped = {m + suffix for m in self.unadapted for suffix in (A_SUFFIX, B_SUFFIX)}
        return {k: v for k, v in super().upload(model).items() if k not in dropped}

    def keep(self, model: PeftModel) -> Payload:
        """Only the head stays (the LoRA ranks change every round; the push replaces them)."""
        return head_only(super().keep(model))

    def train_metrics(self) -> dict[str, float]:
        """The ranks this round trained at: sum of r_main and of r_tot over the modules."""
        return {protocol.FEDHERA_R_MAIN: float(sum(self.r_main.values())),
                protocol.FEDHERA_R_TOT: float(sum(self.r_tot.values()))}
