"""LoRA math, once: factors and payloads, factor-space products and SVD, shared inits, stacking,
and the one codec between payload keys and peft's state dict keys (``peft_keys``).

Every method (``fedlora/methods``), strategy and client trainer takes its LoRA algebra from here;
nothing in this package knows about a particular method.
"""

from fedlora.lora.factors import (
    A_SUFFIX,
    ADAPTER_DTYPE,
    B_SUFFIX,
    HEAD_PREFIX,
    MEAN,
    Combine,
    Factors,
    Payload,
    Weights,
    average_factors,
    fit_rank,
    from_array_record,
    head_only,
    join_payload,
    lora_scale,
    normalise,
    pad_rank,
    padded_average,
    payload_bytes,
    product_inner,
    product_norm,
    scaled,
    split_payload,
    to_array_record,
    truncate_payload,
    truncate_rank,
    weighted_average,
    without_head,
)
from fedlora.lora.init import kaiming_bound, kaiming_rows, nested_A, nested_A_payload
from fedlora.lora.peft_keys import (
    PEFT_PREFIX,
    from_peft_state,
    payload_key,
    payload_module,
    peft_key,
    peft_module,
    to_peft_state,
)
from fedlora.lora.stacking import STACK_PREFIX, concat_stacks, read_stacks, stack, stack_payload
from fedlora.lora.svd import (
    LowRankSVD,
    batched_factor_svd,
    dense_svd,
    factor_svd,
    leading_factors,
    split_spectrum,
    stack_factors,
    trim,
)

__all__ = [
    "ADAPTER_DTYPE", "A_SUFFIX", "B_SUFFIX", "HEAD_PREFIX", "MEAN", "PEFT_PREFIX", "STACK_PREFIX", "Combine", "Factors", "LowRankSVD", "Payload", "Weights",
    "average_factors", "batched_factor_svd", "concat_stacks", "dense_svd", "factor_svd", "fit_rank",
    "from_array_record", "from_peft_state", "head_only", "join_payload", "kaiming_bound", "kaiming_rows", "leading_factors",
    "lora_scale", "nested_A", "nested_A_payload", "normalise", "pad_rank", "padded_average",
    "payload_bytes", "payload_key", "payload_module", "peft_key", "peft_module", "product_inner", "product_norm", "read_stacks", "scaled", "split_payload",
    "split_spectrum", "stack", "stack_factors", "stack_payload", "to_array_record", "to_peft_state", "trim",
    "truncate_payload", "truncate_rank", "weighted_average", "without_head",
]
