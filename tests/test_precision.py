"""``train.precision``: what 'auto' resolves to, that 'bf16' really runs the forward pass in bf16
(weights and loss stay fp32) and 'fp32' does not, and that records written before the option
existed still count as complete fp32 runs (results.json and checkpoints)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fedlora import training
from fedlora.app.jobs import is_complete
from fedlora.config import ConfigError, load_config
from fedlora.schema import comparable_config, with_record_defaults

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"


# --------------------------------------------------------------------------- resolution
@pytest.mark.parametrize(("capability", "flags", "expected"), [
    ("AVX2", {"avx2", "avx512_bf16"}, "fp32"),  # kernels held at AVX2: bf16 would be emulated
    ("AVX512", {"avx512f"}, "fp32"),  # AVX-512 without its bf16 extension
    ("AVX512", {"avx512f", "avx512_bf16"}, "bf16"),
    ("AVX512", {"amx_bf16"}, "bf16"),
])
def test_auto_is_bf16_only_where_the_cpu_computes_it_natively(monkeypatch, capability, flags, expected) -> None:
    # Prepare
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(training, "cpu_flags", lambda: set(flags))
    # Execute / Assert
    assert training.resolve_precision("auto", torch.device("cpu")) == expected
    assert training.resolve_precision("fp32", torch.device("cpu")) == "fp32"  # explicit values are kept
    assert training.resolve_precision("bf16", torch.device("cpu")) == "bf16"


def test_a_bad_precision_is_one_line_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"train\.precision"):
        training.resolve_precision("fp16", torch.device("cpu"))
    with pytest.raises(ConfigError, match="precision"):
        load_config(SMOKE, ["train.precision=fp16"])


# --------------------------------------------------------------------------- the arithmetic
class Probe(torch.nn.Module):
    """A linear classifier that remembers the dtype of its forward's matrix product."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(8, 3)
        self.seen: list[torch.dtype] = []

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> object:
        logits = self.linear(input_ids.float())
        self.seen.append(logits.dtype)
        return type("Output", (), {"logits": logits})()


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_precision_sets_the_forward_dtype_of_training_and_evaluation(precision, dtype) -> None:
    # Prepare: four batches of random features (as input_ids) and labels
    torch.manual_seed(0)
    model = Probe()
    batches = [{"input_ids": torch.randn(4, 8), "attention_mask": torch.ones(4, 8), "labels": torch.randint(0, 3, (4,))}
               for _ in range(4)]
    before = model.linear.weight.detach().clone()
    # Execute
    stats = training.train(model, batches, epochs=1, lr=1e-2, device=torch.device("cpu"),  # type: ignore[arg-type]
                           precision=precision)
    logits, _ = training.predict_logits(model, batches, torch.device("cpu"), precision)  # type: ignore[arg-type]
    # Assert: every forward ran at the precision; the weights trained, stayed fp32; logits come back fp32
    assert set(model.seen) == {dtype} and len(model.seen) == 8
    assert model.linear.weight.dtype == torch.float32 and not torch.equal(model.linear.weight, before)
    assert stats.steps == 4 and stats.loss == stats.loss  # finite
    assert logits.dtype == torch.float32


# --------------------------------------------------------------------------- records
def test_a_record_without_the_option_counts_as_a_complete_fp32_run(tmp_path: Path) -> None:
    # Prepare: a complete run's results.json as written before train.precision existed
    fp32 = load_config(SMOKE, ["train.precision=fp32", "train.rounds=2"])
    legacy = fp32.model_dump(mode="json")
    del legacy["train"]["precision"]
    (tmp_path / "results.json").write_text(json.dumps({"config": legacy, "rounds": [{"round": 1}, {"round": 2}]}))
    # Execute / Assert: complete for an fp32 config, not for a bf16 (or resolved-later 'auto') one
    assert is_complete(tmp_path, fp32)
    assert not is_complete(tmp_path, load_config(SMOKE, ["train.precision=bf16", "train.rounds=2"]))
    assert not is_complete(tmp_path, load_config(SMOKE, ["train.precision=auto", "train.rounds=2"]))


def test_record_defaults_fill_only_what_is_missing() -> None:
    # Execute
    filled = with_record_defaults({"train": {"lr": 0.1}, "model": {"path": "x"}})
    kept = with_record_defaults({"train": {"precision": "bf16"}, "secure_aggregation": {"enabled": True}})
    # Assert: a section added since (ADDED_SECTIONS) is filled in whole: every earlier run aggregated in the clear
    secure = {"enabled": False, "num_shares": 1.0, "reconstruction_threshold": 0.5, "clip_norm": 0.0,
              "clipping_range": 0.0, "quantization_range": 0, "modulus_range": 2**32, "max_error": 0.0,
              "allow_low_threshold": True}
    decay = {"lr_decay_rounds": [], "lr_decay_factor": 0.5}  # every earlier run: a constant rate
    # every earlier run: the plain step loop, and the method's aggregate as the new global model
    loop = {"grad_accumulation": 1, "lr_scheduler": "constant", "warmup_steps": 0, "warmup_ratio": 0.0,
            "max_grad_norm": 0.0, "gradient_checkpointing": False, "proximal_mu": 0.0}
    server = {"name": "none", "lr": None, "momentum": 0.9, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}
    assert filled == {"train": {"lr": 0.1, "precision": "fp32", "group_by_length": False, **decay, **loop},
                      "model": {"path": "x"}, "secure_aggregation": secure, "server_optimizer": server}
    assert kept == {"train": {"precision": "bf16", "group_by_length": False, **decay, **loop},
                    "secure_aggregation": {**secure, "enabled": True}, "server_optimizer": server}


def test_a_run_recorded_before_a_changed_default_of_a_disabled_section_is_the_same_run(tmp_path: Path) -> None:
    # Arrange: a run recorded when a disabled [secure_aggregation] still had reconstruction_threshold
    # 0.5 and no allow_low_threshold (both changed since; neither acts without secure aggregation)
    config = load_config(SMOKE, ["train.rounds=2"])
    recorded = config.model_dump(mode="json")
    recorded["secure_aggregation"]["reconstruction_threshold"] = 0.5
    del recorded["secure_aggregation"]["allow_low_threshold"]
    (tmp_path / "results.json").write_text(json.dumps({"config": recorded, "rounds": [{"round": 1}, {"round": 2}]}))
    # Execute / Assert: the same run (complete), and still another one where secure aggregation was on
    assert comparable_config(recorded) == comparable_config(config.model_dump(mode="json"))
    assert is_complete(tmp_path, config)
    recorded["secure_aggregation"]["enabled"] = True
    (tmp_path / "results.json").write_text(json.dumps({"config": recorded, "rounds": [{"round": 1}, {"round": 2}]}))
    assert not is_complete(tmp_path, config)
