"""FedDPA's client: two peft LoRA adapters on the same modules, the global g ("default") and the
local l ("local"), both active (W0 + dW_g + dW_l) and trained jointly; only g (+head) goes up.

The local branch lives in the client state under keys prefixed ``local::`` (never in an upload).
Saved adapters: ``save_pretrained`` writes g (+head) at the folder's root and l in its ``local/``
subfolder; reload with ``PeftModel.from_pretrained(base, dir)``, then
``model.load_adapter(f"{dir}/local", adapter_name="local")`` and
``model.base_model.set_adapter(["default", "local"])``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

from clients.trainers.base import LocalTrainer
from fedlora.lora import A_SUFFIX, B_SUFFIX, Payload
from fedlora.models import PEFT_PREFIX, adapter_payload, load_payload, module_name

if TYPE_CHECKING:
    from peft import PeftModel

LOCAL_BRANCH = "local"  # peft adapter name of l
LOCAL_PREFIX = "local::"  # client-state key prefix of l


def branch_payload(model: PeftModel, adapter: str) -> Payload:
    """The LoRA factors of one named peft adapter as a payload (``<module>::A`` / ``::B``)."""
    from peft import get_peft_model_state_dict

    payload: Payload = {}
    for key, tensor in get_peft_model_state_dict(model, adapter_name=adapter).items():
        suffix = A_SUFFIX if ".lora_A." in key else B_SUFFIX
        payload[module_name(key) + suffix] = tensor.detach().float().cpu().numpy()
    return payload


def load_branch(model: PeftModel, adapter: str, payload: Payload) -> None:
    """Inverse of :func:`branch_payload` (shapes must match the adapter)."""
    import numpy as np
    import torch
    from peft import set_peft_model_state_dict

    state = {}
    for key, array in payload.items():
        factor = "lora_A" if key.endswith(A_SUFFIX) else "lora_B"
        state[f"{PEFT_PREFIX}{key[:-3]}.{factor}.weight"] = torch.from_numpy(np.asarray(array, np.float32).copy())
    set_peft_model_state_dict(model, state, adapter_name=adapter)


class FedDPATrainer(LocalTrainer):
    """g at the common global rank, l at this client's own rank; upload g (+head), keep both."""

    strategy_names: ClassVar[tuple[str, ...]] = ("feddpa",)

    def model_rank(self) -> int:
        """Rank of g (``strategy.global_rank``, 0 = ``model.lora_rank``)."""
        return int(self.options.get("global_rank", 0)) or self.config.model.lora_rank

    def prepare(self, download: Payload) -> PeftModel:
        from peft import LoraConfig

        model = self.build()  # g = peft's "default" adapter, + the head
        cfg = self.config.model
        local_config = LoraConfig(
            r=self.job.profile.rank,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=cfg.target_modules,
            init_lora_weights=True,  # B_l = 0: l starts as a no-op
        )
        model.add_adapter(LOCAL_BRANCH, local_config)
        model.base_model.set_adapter(["default", LOCAL_BRANCH])  # forward sums both; both trainable
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
