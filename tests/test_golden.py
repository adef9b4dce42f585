"""Golden behaviour: every registered strategy on configs/smoke.toml (in process, fixed seeds)
gives the same results and adapters as when ``tests/golden/smoke.json`` was written.

It pins behaviour across refactors: metrics of every round (accuracies, loss, exact bytes, client
counts, the strategy's ``extra`` facts) to 1e-6, and every saved adapter (global and per client)
through its LoRA products s B A and head tensors, each summarised by its Frobenius norm and 8
fixed random bilinear projections u^T M v (any change above 1e-6 shows in them; sign flips of
SVD factors, which leave the model unchanged, do not). A deliberate behaviour change rewrites
the file: ``FEDLORA_GOLDEN_WRITE=1 python -m pytest tests/test_golden.py``, and says why in the
commit.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from fedlora.config import load_config

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests/golden/smoke.json"
METRICS = (
    "global_accuracy", "personalized_accuracy", "personalized_accuracy_unweighted", "personalized_accuracy_worst",
    "validation_accuracy", "received_accuracy", "train_loss", "bytes_up", "bytes_down", "bytes_eval_down",
    "clients", "failures", "rejected",
)
EXTRA = {"fedtreelora": ["strategy.warmup_rounds=1"]}  # smoke has 2 rounds; its default warm-up is 3
PROJECTIONS = 8
TOLERANCE = 1e-6


def strategy_names() -> list[str]:
    from strategies.registry import strategy_names as names

    return names()


def adapter_fingerprint(folder: Path) -> dict[str, list[float]]:
    """Per adapted module: norm and projections of s B A; per other tensor (head): of itself."""
    from safetensors.numpy import load_file

    config = json.loads((folder / "adapter_config.json").read_text())
    tensors = load_file(str(folder / "adapter_model.safetensors"))
    matrices: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        if ".lora_A." in key:
            module = key.split(".lora_A.")[0]
            A, B = value.astype(np.float64), tensors[key.replace(".lora_A.", ".lora_B.")].astype(np.float64)
            rank = A.shape[0]
            short = module.rsplit(".", 1)[-1]
            alpha = config.get("alpha_pattern", {}).get(short, config["lora_alpha"])
            matrices[module] = (alpha / rank) * B @ A
        elif ".lora_B." not in key:
            matrices[key] = value.astype(np.float64).reshape(value.shape[0], -1) if value.ndim > 1 else value[None, :].astype(np.float64)
    fingerprint = {}
    for name, M in sorted(matrices.items()):
        rng = np.random.default_rng([M.shape[0], M.shape[1]])
        u = rng.standard_normal((PROJECTIONS, M.shape[0]))
        v = rng.standard_normal((PROJECTIONS, M.shape[1]))
        fingerprint[name] = [float(np.linalg.norm(M)), *np.einsum("pi,ij,pj->p", u, M, v).tolist()]
    return fingerprint


def run_fingerprint(strategy: str, out: Path) -> dict:
    from fedlora.app.runner import run_inprocess

    config = load_config(ROOT / "configs/smoke.toml", [f"strategy.name={strategy}", *EXTRA.get(strategy, [])])
    run_inprocess(config, out)
    results = json.loads((out / "results.json").read_text())
    rounds = [{k: r.get(k) for k in METRICS} | {"extra": r.get("extra", {})} for r in results["rounds"]]
    root = out / "adapters"
    adapters = {str(p.parent.relative_to(root)): adapter_fingerprint(p.parent) for p in sorted(root.rglob("adapter_config.json"))}
    return {"rounds": rounds, "adapters": adapters}


def assert_close(actual, expected, where: str) -> None:
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), f"{where}: keys {sorted(actual)} != {sorted(expected)}"
        for key in expected:
            assert_close(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), f"{where}: length differs"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, f"{where}[{i}]")
    elif isinstance(expected, float) or isinstance(actual, float):
        if expected is None or actual is None:
            assert expected is None and actual is None, f"{where}: {actual} != {expected}"
        else:
            scale = max(1.0, abs(float(expected)))
            assert math.isclose(float(actual), float(expected), rel_tol=0.0, abs_tol=TOLERANCE * scale), (
                f"{where}: {actual} != {expected}")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.mark.parametrize("strategy", strategy_names())
def test_every_strategy_reproduces_its_golden_run(strategy: str, tmp_path: Path) -> None:
    # Execute
    fingerprint = run_fingerprint(strategy, tmp_path)
    # Assert (or write, on request)
    if os.environ.get("FEDLORA_GOLDEN_WRITE") == "1":
        golden = json.loads(GOLDEN.read_text()) if GOLDEN.is_file() else {}
        golden[strategy] = fingerprint
        GOLDEN.write_text(json.dumps(golden, indent=1, sort_keys=True))
        pytest.skip("golden file written")
    golden = json.loads(GOLDEN.read_text())
    assert strategy in golden, f"no golden run for {strategy}: write it (see the module docstring)"
    assert_close(json.loads(json.dumps(fingerprint)), golden[strategy], strategy)
