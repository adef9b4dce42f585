"""Golden behaviour: every registered strategy, and one non-default option of each 2026 method, on
the golden cut of configs/quick.toml (:data:`cli_helpers.QUICK_CUT`: the same pretrained MiniLM and
label-skewed WordNet task, fewer examples, rounds and steps; in process, fixed seeds) gives the
same results and adapters as when ``tests/golden/quick.json`` was written.

It pins behaviour across refactors: metrics of every round (accuracies, loss, exact bytes, client
counts, the strategy's ``extra`` facts) to 1e-6, and every saved adapter (global and per client)
through its LoRA products s B A and head tensors, each summarised by its Frobenius norm and 8
fixed random bilinear projections u^T M v (any change above 1e-6 shows in them; sign flips of
SVD factors, which leave the model unchanged, do not). The cut learns, so the pinned runs differ
from each other and beat the majority class (checked below from the file itself).

A deliberate behaviour change rewrites the file: ``FEDLORA_GOLDEN_WRITE=1 python -m pytest
tests/test_golden.py`` (all entries; ``-k NAME`` rewrites only those, keeping the others), and says
why in the commit. The file records the cut it was written for; a test on another cut fails with
"rewrite it".

Float results depend on the CPU kernels (AVX2 and AVX-512 machines differ from the first step):
tests/conftest.py selects torch's AVX2 kernels and OpenBLAS's Haswell kernels in every test process,
and the file holds their numbers; a process with other kernels skips, saying so. Even so, MKL (torch's
CPU BLAS) runs other code on Intel and on AMD processors at the same instruction set: the same fedit
run differs by 2e-5 in its adapter after the cut's rounds (measured on a Xeon against the AMD file;
no `MKL_CBWR` mode, AUTO, COMPATIBLE, SSE4_2, AVX or AVX2, reproduced the AMD numbers). So each CPU
vendor has its own file (:data:`GOLDEN_FILES`, written from the same code), and a vendor without one
skips, saying so.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import QUICK, QUICK_CUT, QUICK_CUT_OPTIONS

from fedlora.config import load_config

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
GOLDEN_FILES = {"AuthenticAMD": ROOT / "tests/golden/quick.json", "GenuineIntel": ROOT / "tests/golden/quick-intel.json"}


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (``vendor_id``), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


GOLDEN = GOLDEN_FILES.get(cpu_vendor(), ROOT / f"tests/golden/quick-{cpu_vendor()}.json")
METRICS = (
    "global_accuracy", "personalized_accuracy", "personalized_accuracy_unweighted", "personalized_accuracy_worst",
    "validation_accuracy", "received_accuracy", "train_loss", "bytes_up", "bytes_down", "bytes_eval_down",
    "clients", "failures", "rejected",
)
# One option of each 2026 method that is not its default (today): an entry of its own.
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "fedpissa[correction=bounded]": ("fedpissa", ["strategy.correction=bounded"]),
    "fedhera[aggregation=unbiased]": ("fedhera", ["strategy.aggregation=unbiased"]),
    "feddr_lora[topology=two_lora]": ("feddr_lora", ["strategy.topology=two_lora"]),
    "fedtreelora[fixed_c=2]": ("fedtreelora", ["strategy.fixed_c=2"]),
}
PROJECTIONS = 8
TOLERANCE = 1e-6


def strategy_names() -> list[str]:
    from fedlora.strategies.registry import strategy_names as names

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


def entries() -> dict[str, tuple[str, list[str]]]:
    """Entry name -> (strategy, its overrides): every strategy at its defaults, then the variants."""
    return {name: (name, []) for name in strategy_names()} | VARIANTS


def cut_overrides(strategy: str, extra: list[str]) -> list[str]:
    return [*QUICK_CUT, f"strategy.name={strategy}", *QUICK_CUT_OPTIONS.get(strategy, []), *extra]


def run_fingerprint(strategy: str, extra: list[str], out: Path) -> dict:
    from fedlora.app.runner import run_inprocess

    # fp32 forward passes: the pinned numbers are fp32 ones ('auto' would pick bf16 where a CPU has it)
    config = load_config(QUICK, [*cut_overrides(strategy, extra), "train.precision=fp32"])
    run_inprocess(config, out)
    results = json.loads((out / "results.json").read_text())
    rounds = [{k: r.get(k) for k in METRICS} | {"extra": r.get("extra", {})} for r in results["rounds"]]
    root = out / "adapters"
    adapters = {str(p.parent.relative_to(root)): adapter_fingerprint(p.parent) for p in sorted(root.rglob("adapter_config.json"))}
    return {"rounds": rounds, "adapters": adapters}


def pinned_kernels() -> None:
    """The file was written with torch's AVX2 kernels and OpenBLAS's Haswell kernels (numpy's
    matrix products), which tests/conftest.py selects before either loads; a process with others
    cannot reproduce it (a CPU without AVX2, or the variables set otherwise)."""
    import torch
    from threadpoolctl import threadpool_info

    kernels = {"torch": torch.backends.cpu.get_cpu_capability()} | {
        f"openblas ({info['filepath'].split('/site-packages/')[-1].split('/')[0]})": info.get("architecture")
        for info in threadpool_info() if info.get("internal_api") == "openblas"}
    if kernels["torch"] != "AVX2" or any(arch != "Haswell" for name, arch in kernels.items() if name != "torch"):
        pytest.skip(f"the golden runs were computed with AVX2 / Haswell kernels; this process has {kernels}")
    if cpu_vendor() not in GOLDEN_FILES and os.environ.get("FEDLORA_GOLDEN_WRITE") != "1":
        pytest.skip(f"no golden file for {cpu_vendor()} processors (MKL's results differ by vendor): "
                    f"FEDLORA_GOLDEN_WRITE=1 writes {GOLDEN.name}")


def cut_description() -> dict:
    """What the file was written for: the cut (and each strategy's own cut options)."""
    return {"config": "configs/quick.toml", "overrides": list(QUICK_CUT),
            "strategy_options": {k: list(v) for k, v in sorted(QUICK_CUT_OPTIONS.items())}}


def read_golden(path: Path = GOLDEN) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {"cut": cut_description(), "entries": {}}


def write_entry(name: str, fingerprint: dict) -> None:
    """Merge one entry into the file (atomic: another test never reads half a file); a file
    written for another cut starts afresh."""
    golden = read_golden()
    if golden.get("cut") != cut_description():
        golden = {"cut": cut_description(), "entries": {}}
    golden["entries"][name] = fingerprint
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    tmp = GOLDEN.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, GOLDEN)


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


@pytest.mark.parametrize("entry", list(entries()))
def test_every_strategy_reproduces_its_golden_run(entry: str, tmp_path: Path) -> None:
    pinned_kernels()
    strategy, extra = entries()[entry]
    # Execute
    fingerprint = json.loads(json.dumps(run_fingerprint(strategy, extra, tmp_path)))
    # Assert (or write, on request)
    if os.environ.get("FEDLORA_GOLDEN_WRITE") == "1":
        write_entry(entry, fingerprint)
        pytest.skip(f"golden entry {entry} written")
    golden = read_golden()
    assert golden.get("cut") == cut_description(), "tests/golden/quick.json was written for another cut: rewrite it"
    assert entry in golden["entries"], f"no golden run for {entry}: write it (see the module docstring)"
    assert_close(fingerprint, golden["entries"][entry], entry)


def majority_rates() -> tuple[float, float]:
    """The cut's majority-class accuracy: on the global test set, and each client predicting its own
    training majority on its local test split (example-weighted), from the data alone."""
    from collections import Counter

    from fedlora.data import build_federated_data

    data = build_federated_data(load_config(QUICK, QUICK_CUT).data)
    labels = list(data.global_test["label"])
    global_rate = Counter(labels).most_common(1)[0][1] / len(labels)
    hits = total = 0
    for client in data.clients:
        majority = Counter(client.train["label"]).most_common(1)[0][0]
        test = list(client.test["label"])
        hits, total = hits + sum(label == majority for label in test), total + len(test)
    return global_rate, hits / total


@pytest.mark.parametrize("vendor", list(GOLDEN_FILES))
def test_the_golden_runs_learn_and_differ_from_each_other(vendor: str) -> None:
    # Prepare: the pinned file of each vendor (every entry present)
    golden = read_golden(GOLDEN_FILES[vendor])
    pinned = golden["entries"]
    assert set(pinned) == set(entries()), sorted(set(entries()) ^ set(pinned))
    global_majority, local_majority = majority_rates()
    finals = {name: entry["rounds"][-1] for name, entry in pinned.items()}
    # Assert: every strategy ends above the majority class (global or personalised, as it reports)
    for name, final in finals.items():
        if name == "local":
            continue  # no federation: it reports only its clients' own models
        assert (final["global_accuracy"] or 0.0) > global_majority + 0.05 or (
            (final["personalized_accuracy"] or 0.0) > local_majority + 0.05), (name, final, global_majority, local_majority)
    # ... and no two entries pin the same run (accuracies, loss and adapters)
    signatures = {}
    for name, entry in pinned.items():
        final = finals[name]
        signature = (final["global_accuracy"], final["personalized_accuracy"], round(final["train_loss"], 6),
                     json.dumps(entry["adapters"], sort_keys=True))
        assert signature not in signatures, f"{name} pins the same run as {signatures.get(signature)}"
        signatures[signature] = name
