"""benchmarks/harness.py: interleaving, min / median / max, ratio of medians, spread, the JSON record.

Fake arms return known numbers (nothing is trained); one test runs the ported aggregation
benchmark at a tiny shape (numpy only, a second or two) and checks its last line against its own
record.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import statistics
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    """A benchmarks/ script as a module (by path: site-packages may hold an unrelated `benchmarks`)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    module_name = "harness" if name == "harness" else f"fedlora_benchmark_{name}"
    if module_name in sys.modules:
        return sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


harness = load("harness")


def scripted(name: str, values: list[float], calls: list[str]) -> harness.Arm:
    """An arm that returns the next of ``values`` as ``seconds`` (and twice it as ``double``)."""
    queue = iter(values)

    def arm() -> dict[str, float]:
        calls.append(name)
        value = next(queue)
        return {"seconds": value, "double": 2 * value}

    return arm


# warm-up values first (100 / 200: must be discarded), then the five timed runs
BASE = [100.0, 2.0, 4.0, 1.0, 3.0, 5.0]  # timed median 3
CAND = [200.0, 3.0, 4.0, 2.0, 6.0, 5.0]  # timed median 4; pairs 1.5 1.0 2.0 2.0 1.0


def measured_pair(log: list[str] | None = None) -> tuple[harness.Measurements, list[str]]:
    calls: list[str] = []
    arms = {"base": scripted("base", BASE, calls), "cand": scripted("cand", CAND, calls)}
    measured = harness.run_interleaved(arms, repeat=5, warmup=1, log=None if log is None else log.append)
    return measured, calls


def test_arms_run_interleaved_after_warmup() -> None:
    lines: list[str] = []
    measured, calls = measured_pair(lines)
    assert calls == ["base", "cand"] * 6
    assert measured.order == [("base", -1), ("cand", -1)] + [(arm, i) for i in range(5) for arm in ("base", "cand")]
    assert [s["seconds"] for s in measured.warmup["base"]] == [100.0]
    assert [s["seconds"] for s in measured.samples["base"]] == BASE[1:]
    assert [s["seconds"] for s in measured.samples["cand"]] == CAND[1:]
    assert len(lines) == 12 and lines[0].startswith("[1/12] base warm-up 1/1") and "cand run 5/5" in lines[-1]


def test_describe_gives_min_median_max_per_figure() -> None:
    measured, _ = measured_pair()
    stats = harness.describe(measured.samples["base"])
    assert stats["seconds"] == harness.Stats(min=1.0, median=3.0, max=5.0, n=5)
    assert stats["double"] == harness.Stats(min=2.0, median=6.0, max=10.0, n=5)
    even = harness.describe([{"x": 4.0}, {"x": 1.0}, {"x": 2.0}, {"x": 10.0}])
    assert even["x"] == harness.Stats(1.0, 3.0, 10.0, 4)  # even count: mean of the middle two


def test_ratio_of_medians_and_spread_of_pairs() -> None:
    measured, _ = measured_pair()
    c = harness.compare(measured, "cand", "base", "seconds")
    assert c.numerator_median == 4.0 and c.denominator_median == 3.0
    assert c.ratio == pytest.approx(4.0 / 3.0)  # ratio of medians, not the median ratio (1.5)
    assert c.pair_ratios == pytest.approx([1.5, 1.0, 2.0, 2.0, 1.0])
    assert c.spread == pytest.approx(2.0)
    flat = harness.compare(measured, "base", "base", "double")
    assert flat.ratio == 1.0 and flat.spread == 1.0


def test_report_lists_every_arm_and_the_comparison() -> None:
    measured, _ = measured_pair()
    text = harness.report(measured, harness.compare(measured, "cand", "base", "seconds"))
    assert "base  seconds       1.000      3.000      5.000" in text
    assert "cand  seconds       2.000      4.000      6.000" in text
    assert "ratio of medians 1.333" in text and "per pair 1.500 1.000 2.000 2.000 1.000" in text
    assert text.endswith("spread (max/min of the pairs) 2.000")


def test_bad_input_is_refused() -> None:
    with pytest.raises(ValueError, match="repeat"):
        harness.run_interleaved({"a": lambda: {"s": 1.0}}, repeat=0)
    with pytest.raises(ValueError, match="no figures"):
        harness.run_interleaved({"a": dict}, repeat=1, warmup=0, log=None)
    with pytest.raises(ValueError, match="different figures"):
        harness.describe([{"a": 1.0}, {"b": 1.0}])


def test_arguments_and_default_paths() -> None:
    parser = argparse.ArgumentParser()
    harness.add_arguments(parser)
    args = parser.parse_args([])
    harness.settle(args, "demo")
    assert (args.repeat, args.warmup) == (5, 1)
    assert args.out == harness.ROOT / "benchmarks" / "results" / "demo.json"
    quick = parser.parse_args(["--repeat", "3"])
    harness.settle(quick, "demo", quick=True, repeat=1, warmup=0)
    assert (quick.repeat, quick.warmup) == (3, 0)  # the user's --repeat wins over the quick default
    assert quick.out == harness.ROOT / "runs" / "benchmarks" / "demo-quick.json"
    with pytest.raises(SystemExit):
        harness.settle(parser.parse_args(["--repeat", "0"]), "demo")


def test_record_holds_environment_raw_runs_and_summary(tmp_path: Path) -> None:
    measured, _ = measured_pair()
    comparison = harness.compare(measured, "cand", "base", "seconds")
    args = argparse.Namespace(repeat=5, warmup=1, out=harness.ROOT / "runs" / "x.json", note="busy",
                              config=str(harness.ROOT / "configs" / "smoke.toml"))
    env = harness.environment(args.note)
    data = harness.record("demo", args, measured, comparison, "a=1 spread=2.000", {"k": 7}, env)
    path = harness.write_record(tmp_path / "deep" / "demo.json", data)
    back = json.loads(path.read_text())
    assert back["benchmark"] == "demo" and back["last_line"] == "a=1 spread=2.000"
    assert back["repeat"] == 5 and back["warmup"] == 1 and back["extra"] == {"k": 7}
    assert back["arguments"]["out"] == "runs/x.json"  # paths inside the repository are stored relative
    assert back["arguments"]["config"] == "configs/smoke.toml"  # also when given as strings
    assert back["samples"]["cand"] == [{"seconds": v, "double": 2 * v} for v in CAND[1:]]
    assert back["warmup_samples"]["base"] == [{"seconds": 100.0, "double": 200.0}]
    assert back["order"][:3] == [["base", -1], ["cand", -1], ["base", 0]]
    assert back["summary"]["cand"]["seconds"] == {"min": 2.0, "median": 4.0, "max": 6.0, "n": 5}
    assert back["comparison"]["spread"] == pytest.approx(2.0)
    assert back["comparison"]["ratio"] == pytest.approx(4 / 3)
    e = back["environment"]
    assert e["cpu_count"] == os.cpu_count() and e["note"] == "busy" and e["cpu_model"]
    assert e["versions"]["python"] and "numpy" in e["versions"] and "flwr" in e["versions"]
    assert "gpu" in e and "git_commit" in e and e["timestamp"] and len(e["load_average"]) == 3
    assert "pytest" in e["command"] or "python" in e["command"]


def settled(name: str, precision: str, threads: int = 2) -> harness.Arm:
    """An arm that reports ``seconds`` 1.0 and the settings it ran at."""
    def arm() -> harness.Run:
        return harness.Run({"seconds": 1.0}, {"precision": precision, "threads": threads, "model": "tiny-bert",
                                              "engine": name})
    return arm


def test_arms_that_differ_in_more_than_what_is_measured_are_refused_after_their_first_run() -> None:
    # Prepare: fp32 against bf16 where only the engine may differ
    calls: list[str] = []

    def counted(name: str, precision: str) -> harness.Arm:
        inner = settled(name, precision)

        def arm() -> harness.Run:
            calls.append(name)
            return inner()
        return arm

    arms = {"plain": counted("plain", "fp32"), "fedlora": counted("fedlora", "bf16")}
    # Execute / Assert: refused once both ran once (the warm-up), not after every run
    with pytest.raises(harness.Unmatched, match=r"differ in more than what is measured \(engine\): "
                       r"precision: 'fp32' vs 'bf16'"):
        harness.run_interleaved(arms, repeat=5, warmup=1, log=None, varies=("engine",))
    assert calls == ["plain", "fedlora"]
    # Assert: the same arms at one precision pass, and the record keeps what they ran at
    matched = harness.run_interleaved({"plain": settled("plain", "bf16"), "fedlora": settled("fedlora", "bf16")},
                                      repeat=2, warmup=0, log=None, varies=("engine",))
    assert matched.settings["fedlora"] == {"precision": "bf16", "threads": 2, "model": "tiny-bert", "engine": "fedlora"}
    data = harness.record("demo", {"note": ""}, matched, None, "x=1")
    assert data["settings"]["plain"]["precision"] == "bf16" and data["varies"] == ["engine"]
    assert len(data["load_per_run"]) == 4 and "cpu_bf16_flags" in data["environment"]
    assert "arms matched on: model=tiny-bert precision=bf16 threads=2; varied: engine (plain=plain, fedlora=fedlora)" \
        in harness.report(matched)


def test_an_arm_that_changes_its_settings_or_stays_silent_beside_one_that_reports_is_refused() -> None:
    threads = iter([2, 2, 1])

    def drifting() -> harness.Run:
        return harness.Run({"seconds": 1.0}, {"precision": "fp32", "threads": next(threads)})

    with pytest.raises(harness.Unmatched, match=r"arm 'a' ran at other settings in run 3 .*threads: 2 vs 1"):
        harness.run_interleaved({"a": drifting}, repeat=3, warmup=0, log=None)
    with pytest.raises(harness.Unmatched, match=r"arms \['b'\] report no settings"):
        harness.run_interleaved({"a": settled("a", "fp32"), "b": lambda: {"seconds": 1.0}}, repeat=1, warmup=0, log=None)


def test_records_at_other_settings_or_without_any_are_not_compared(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: three records of one benchmark: two at bf16, one at fp32
    def written(name: str, precision: str, seconds: float) -> Path:
        def arm() -> harness.Run:
            return harness.Run({"seconds": seconds}, {"precision": precision, "threads": 2})
        measured = harness.run_interleaved({"plain": arm}, repeat=1, warmup=0, log=None)
        return harness.write_record(tmp_path / f"{name}.json", harness.record("demo", {"note": ""}, measured, None, ""))

    old, new, fp32 = written("old", "bf16", 2.0), written("new", "bf16", 3.0), written("fp32", "fp32", 1.0)
    legacy = harness.write_record(tmp_path / "legacy.json", json.loads(old.read_text()) | {"settings": {}})
    # Execute / Assert: the matched pair side by side, second / first
    assert harness.main(["compare", str(old), str(new)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("plain") and "seconds" in line)
    assert row.split()[-1] == "1.500"
    # Execute / Assert: the others refused in one line, exit 2
    for other, reason in ((fp32, ("arm 'plain' ran at other settings in .*fp32.json than in .*old.json: "
                                  "precision: 'bf16' vs 'fp32'")),
                          (legacy, "legacy.json records no settings of its arms")):
        assert harness.main(["compare", str(old), str(other)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and re.search(reason, err[0]), err


def test_overhead_arms_report_the_same_precision_and_threads_where_auto_picks_bf16(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/overhead.py --quick (tiny BERT, the in-process engine, one fresh process per arm)
    with configs/smoke.toml's ``train.precision = "auto"`` on a machine whose CPU computes bf16
    natively (forced: the tests hold torch's kernels at AVX2, where auto is fp32). The plain arm
    once trained in fp32 there while fedlora's clients trained in bf16; now both must report bf16
    (read where they trained: the plain arm's forward pass, fedlora's replies) and the same threads,
    and train alike: the same client losses in every round and the same global accuracy."""
    import fedlora.training

    overhead = load("overhead")
    monkeypatch.setattr(fedlora.training, "native_bf16", lambda device: True)
    out = tmp_path / "overhead.json"
    # Execute
    assert overhead.main(["--quick", "--out", str(out)]) == 0
    # Assert: the record's settings, per arm, as each reported them
    lines = capsys.readouterr().out.strip().splitlines()
    back = json.loads(out.read_text())
    plain, fedlora = back["settings"]["plain"], back["settings"]["fedlora"]
    assert plain["precision"] == fedlora["precision"] == "bf16"
    assert plain["threads"] == fedlora["threads"] == os.cpu_count()
    assert harness.differences(plain, fedlora) == ["engine: 'plain loop' vs 'inprocess'"]
    assert lines[-1].endswith(f"precision=bf16 threads={os.cpu_count()}") and back["last_line"] == lines[-1]
    # Assert: trained alike, client by client
    losses = back["extra"]["client_losses"]
    assert len(losses["plain"]) == 2 and losses["plain"][1].keys() == {"0", "1"}
    for mine, theirs in zip(losses["plain"], losses["fedlora"], strict=True):
        assert mine == pytest.approx(theirs, rel=1e-4)
    assert back["samples"]["plain"][0]["global_accuracy"] == back["samples"]["fedlora"][0]["global_accuracy"]
    assert back["extra"]["trained_alike"].startswith("both arms trained alike")


def test_overhead_figures_from_round_times() -> None:
    overhead = load("overhead")
    side = {"round_seconds": [10.0, 4.0, 6.0, 5.0], "train_seconds": [9.0, 3.0, 5.5, 4.0],
            "wall": 40.0, "global_accuracy": 0.5}
    figures = overhead.figures(side)
    assert figures["steady_seconds"] == 15.0  # median(4, 6, 5) x 3
    assert figures["steady_train_seconds"] == 12.0  # median(3, 5.5, 4) x 3
    assert figures["steady_rest_seconds"] == pytest.approx(3.0)  # median(1, 0.5, 1) x 3
    assert figures["first_round_seconds"] == 10.0 and figures["rounds_seconds"] == 25.0
    assert figures["one_off_seconds"] == 15.0 and figures["global_accuracy"] == 0.5


def test_overhead_counts_the_servers_work_between_rounds(tmp_path: Path) -> None:
    # Prepare: a run.log whose round lines came 10.5 s and 10.7 s apart, rounds' own clocks 10.0 and 10.5 s
    overhead = load("overhead")
    stamps = ["2026-12-07 10:00:00,000", "2026-12-07 10:00:10,500", "2026-12-07 10:00:21,200", "2026-12-07 10:00:33,000"]
    log = tmp_path / "run.log"
    log.write_text("2026-12-07 09:59:50,000 INFO fedlora: load_source: wordnet\n" + "".join(
        f"{stamp} INFO fedlora: round   {i + 1}/4  global   -    loss 2.0  7.0s\n" for i, stamp in enumerate(stamps)))
    seconds = [9.0, 10.0, 10.5, 11.0]
    # Execute
    ends = overhead.round_ends(log)
    between = overhead.between_rounds(seconds, ends)
    # Assert: rounds 2 and 3 measured line to line (0.5 s, 0.2 s); rounds 1 and 4 get their median
    assert ends[1] - ends[0] == pytest.approx(10.5)
    assert between == pytest.approx([0.35, 0.5, 0.2, 0.35])
    assert overhead.full_rounds(seconds, ends) == pytest.approx([9.35, 10.5, 10.7, 11.35])
    assert overhead.between_rounds([5.0, 6.0], []) == [0.0, 0.0]  # no lines to read: nothing added


def test_aggregation_last_line_matches_its_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    aggregation = load("aggregation")
    out = tmp_path / "aggregation.json"
    shape = ["--modules", "4", "--dim", "256", "--rank", "4", "--clients", "4", "--dense-modules", "1"]
    assert aggregation.main([*shape, "--repeat", "3", "--warmup", "1", "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    values = dict(item.split("=") for item in last.split())
    assert set(values) == {"factor_seconds", "dense_seconds", "speedup", "spread"}
    back = json.loads(out.read_text())
    assert back["last_line"] == last and back["repeat"] == 3 and back["warmup"] == 1
    factor = [s["seconds"] for s in back["samples"]["factor"]]
    dense = [s["seconds"] for s in back["samples"]["dense"]]
    assert float(values["factor_seconds"]) == pytest.approx(statistics.median(factor), abs=5e-4)
    assert back["comparison"]["ratio"] == pytest.approx(statistics.median(dense) / statistics.median(factor))
    pairs = [d / f for d, f in zip(dense, factor, strict=True)]
    assert float(values["spread"]) == pytest.approx(max(pairs) / min(pairs), abs=5e-3)
    assert back["extra"]["pushed_update_rel_diff"] < 1e-3  # both paths push the same rank-4 update
    # the arms share the shape, dtype and BLAS threads; they differ in the method and the modules timed
    assert harness.differences(back["settings"]["factor"], back["settings"]["dense"]) == [
        "method: 'factor space' vs 'dense SVD'", "modules_timed: 4 vs 1"]
    assert back["settings"]["dense"]["dtype"] == "float32" and back["settings"]["dense"]["d_out"] == 256


@pytest.mark.e2e
def test_llm_throughput_observes_a_real_client_round(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One train message of configs/llm_smoke.toml's client 0 (tiny random Llama) through the
    ClientApp, --steps above one epoch: every training example is trained once, so the tokens
    counted must be the split's non-padding tokens, computed here from the split itself; the
    round's parts must fit inside its wall time, and the record must name the machine."""
    import math

    import torch

    from fedlora.causal_lm import encode_instruction
    from fedlora.config import load_config
    from fedlora.data import build_federated_data
    from fedlora.models import load_tokenizer

    llm = load("llm_throughput")
    out = tmp_path / "llm.json"
    smoke = BENCHMARKS.parent / "configs" / "llm_smoke.toml"
    argv = ["--model", "tiny-llama", "--config", str(smoke), "--device", "cpu", "--steps", "1000",
            "--batch-size", "8", "--max-length", "64", "--repeat", "1", "--warmup", "0", "--out", str(out)]
    assert llm.main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    back = json.loads(out.read_text())
    [sample] = back["samples"]["round"]
    # the split, tokenised independently of the loader (no padding: each example's own length)
    config = load_config(smoke, ["model.path='tiny-llama'", "train.max_length=64"])
    split = build_federated_data(config.data).client(0).train
    tokenizer = load_tokenizer("tiny-llama")
    lengths = [len(encode_instruction(tokenizer, p, r, 64)["input_ids"]) for p, r in zip(split["prompt"], split["response"])]
    assert sample["tokens"] == sum(lengths) and sample["steps"] == math.ceil(len(split) / 8)
    assert 0 < sample["steps_seconds"] <= sample["round_seconds"] and 0 < sample["overhead_fraction"] < 1
    assert sample["overhead_fraction"] == pytest.approx(1 - sample["steps_seconds"] / sample["round_seconds"])
    assert sample["tokens_per_second"] == pytest.approx(sample["tokens"] / sample["round_seconds"])
    assert sample["upload_other_seconds"] >= 0  # the observed parts do not overlap: they fit in the round
    assert sample["received_eval_seconds"] > 0  # llm_smoke's round 1 asks for the received model's evaluation
    # the step loop the ClientApp reported (train-seconds) is steps + batch fetching, to the wrapper's cost
    assert 0 <= sample["steps_seconds"] + sample["batches_seconds"] - sample["train_seconds_reported"] < 0.1
    machine = back["machine"]
    assert machine["cpu_model"] and machine["cpu_count"] == os.cpu_count() and machine["torch_threads"] == 1
    assert machine["torch_version"] == torch.__version__ and machine["device"] == "cpu" and machine["dtype"] == "fp32"
    assert back["settings"]["round"]["precision"] == "fp32" and back["settings"]["round"]["threads"] == 1
    assert "gpu_name" in machine and machine["gpu_name"] is None
    assert back["last_line"] == last and last.startswith(f"tokens_per_second={sample['tokens_per_second']:.1f} ")
    table = out.with_suffix(".md").read_text()
    assert f"| non-padding tokens trained per message | {sample['tokens']:.0f} |" in table


@pytest.mark.e2e
def test_precision_gives_both_ratios_from_its_record(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    precision = load("precision")
    out = tmp_path / "precision.json"
    # Execute: the smoke version (tiny-bert), fp32 and bf16 interleaved
    assert precision.main(["--quick", "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # Assert: the ratios are the medians' of the record's own samples; the machine's bf16 is named
    values = dict(item.split("=") for item in last.split())
    back = json.loads(out.read_text())
    medians = {arm: {key: statistics.median(s[key] for s in back["samples"][arm]) for key in back["samples"][arm][0]}
               for arm in ("fp32", "bf16")}
    for figure, key in (("train_step_seconds", "train_ratio"), ("eval_batch_seconds", "eval_ratio")):
        assert float(values[key]) == pytest.approx(medians["fp32"][figure] / medians["bf16"][figure], abs=5e-4)
    assert values["cpu_capability"] == torch.backends.cpu.get_cpu_capability() and back["last_line"] == last
    assert values["native_bf16"] in ("True", "False") and back["repeat"] == 2
    # the arms differ in the precision alone, and say so in the record
    assert back["varies"] == ["precision"]
    assert harness.differences(back["settings"]["fp32"], back["settings"]["bf16"]) == ["precision: 'fp32' vs 'bf16'"]
    assert back["settings"]["bf16"]["threads"] == 1 and back["settings"]["bf16"]["steps"] == 2


def test_llm_throughput_refuses_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    llm = load("llm_throughput")
    with pytest.raises(SystemExit) as stop:
        llm.main(["--model", "tiny-llama", "--device", "cpu", "--steps", "0"])
    assert stop.value.code == 2 and capsys.readouterr().err.strip().startswith("error: need --steps >= 1")


@pytest.mark.e2e
@pytest.mark.parametrize("model_path", ["tiny-bert", "tiny-llama"])
def test_step_buckets_the_same_examples_by_length_and_counts_a_train_step_above_its_forward_pass(model_path: str) -> None:
    # Prepare: a tiny classifier or causal LM and one client's real batches (benchmarks/precision.py's builds)
    step = load("step")
    from fedlora.backbones import load_tokenizer

    is_causal = step.causal(model_path)
    model, batches = load("precision").build(model_path, 48, 16, 32, is_causal)
    # Execute
    buckets = step.bucketed(batches, load_tokenizer(model_path), is_causal)
    train_flops, eval_flops = step.counted_flops(model, batches, is_causal)

    # Assert: the same examples (tokens and labels: a class, or a causal LM's per-token labels with
    # -100 on the prompt), batches of one size in length order, no more padding
    def examples(of: list) -> list:
        rows = []
        for b in of:
            for i in range(len(b["labels"])):
                real = b["attention_mask"][i].bool()
                label = tuple(b["labels"][i][real].tolist()) if is_causal else int(b["labels"][i])
                rows.append((tuple(b["input_ids"][i][real].tolist()), label))
        return sorted(rows)

    assert is_causal == (model_path == "tiny-llama")
    assert examples(buckets) == examples(batches) and [len(b["labels"]) for b in buckets] == [16, 16, 16]
    lengths = [int(b["attention_mask"][i].sum()) for b in buckets for i in range(len(b["labels"]))]
    assert lengths == sorted(lengths)
    assert sum(b["attention_mask"].numel() for b in buckets) <= sum(b["attention_mask"].numel() for b in batches)
    assert step.real_tokens(buckets) == step.real_tokens(batches)
    # Assert: a train step (forward + backward) counts more FLOPs than a forward pass, both counted
    assert eval_flops > 0 and train_flops > 1.5 * eval_flops


@pytest.mark.e2e
def test_secagg_compares_real_plain_and_secure_runs_from_its_record(tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/secagg.py --quick: one plain and one secure `fedlora run` of 3 clients (fresh
    processes, in process). The ratios on its last line must be the record's own; the bytes must be
    what secure aggregation sends: the same downloads, a masked int64 vector (twice the float32
    upload, plus the weight factor) up, and the stages' messages on top of the training messages."""
    secagg = load("secagg")
    out = tmp_path / "secagg.json"
    # Execute: the smoke version (3 clients, 3 rounds, one run per arm)
    assert secagg.main(["--quick", "--out", str(out)]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    # Assert: the last line is the record's, its ratios the medians' of the record's samples
    values = dict(item.split("=") for item in last.split())
    back = json.loads(out.read_text())
    assert back["last_line"] == last and values["clients"] == "3" and back["arguments"]["sizes"] == [3]
    assert back["order"] == [["plain-3", 0], ["secure-3", 0]] and back["environment"]["cpu_count"] == os.cpu_count()
    [plain], [secure] = back["samples"]["plain-3"], back["samples"]["secure-3"]
    assert float(values["seconds_ratio"]) == pytest.approx(secure["seconds"] / plain["seconds"], abs=5e-4)
    assert float(values["wire_up_ratio"]) == pytest.approx(secure["wire_bytes_up"] / plain["wire_bytes_up"], abs=5e-4)
    # Assert: FedIT uploads the arrays it downloads; a secure client uploads them masked as int64 (+ its weight factor)
    assert plain["bytes_up"] == plain["bytes_down"] == secure["bytes_down"] > 0
    assert secure["bytes_up"] == 2 * plain["bytes_up"] + 8 * 3
    stages_down = sum(secure[f"{stage}_wire_bytes_down"] for stage in secagg.STAGES)
    stages_up = sum(secure[f"{stage}_wire_bytes_up"] for stage in secagg.STAGES)
    assert stages_down > 0 and stages_up > 0
    assert secure["wire_bytes_down"] - stages_down > plain["wire_bytes_down"]  # the forwarded shares ride along
    assert secure["wire_bytes_up"] - stages_up > plain["wire_bytes_up"]  # int64 masked vectors, not float32 arrays
    # Assert: the stages outside the training exchange and the rest make up the (one steady) round
    stages = sum(secure[f"{stage}_seconds"] for stage in secagg.STAGES)
    assert 0 < stages < secure["seconds"]
    assert secure["train_stage_seconds"] == pytest.approx(secure["seconds"] - stages)
    assert plain["train_stage_seconds"] == plain["seconds"] and "setup_seconds" not in plain
    assert 0 < secure["error_bound"] < 1e-6  # 3 c |S| / (T D) with c = 8, T = 2^30, 3 clients
    # Assert: both arms trained at the settings their clients reported, alike but for secure aggregation
    settings = back["settings"]
    assert harness.differences(settings["plain-3"], settings["secure-3"]) == ["secure: False vs True"]
    assert settings["secure-3"]["precision"] in ("fp32", "bf16") and settings["secure-3"]["clients"] == 3


def test_secagg_refuses_a_round_that_did_not_aggregate_every_client() -> None:
    secagg = load("secagg")
    round_ = {"round": 1, "sampled": 5, "clients": 5, "failures": 0, "seconds": 1.0, "client_train_seconds": 0.5,
              "bytes_up": 8, "bytes_down": 4, "wire_bytes_up": 9, "wire_bytes_down": 5, "extra": {}}
    results = {"rounds": [round_, round_ | {"round": 2, "clients": 4, "failures": 1}], "final": {"global_accuracy": 0.1}}
    with pytest.raises(SystemExit, match="round 2 of a 5-client run sampled 5, aggregated 4, 1 failures"):
        secagg.figures(results, 10.0, 5, secure=False)
    with pytest.raises(SystemExit, match="round 1 was not securely aggregated"):
        secagg.figures(results | {"rounds": [round_]}, 10.0, 5, secure=True)
    assert secagg.figures(results | {"rounds": [round_]}, 10.0, 5, secure=False)["seconds"] == 1.0
    assert [r["round"] for r in secagg.steady_rounds([{"round": k} for k in range(1, 6)])] == [2, 3, 4]


def test_step_arms_differ_only_in_precision_and_batching_and_say_so_in_the_record(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """benchmarks/step.py --quick without the compiled arm (tiny-bert, 2 steps, one run per arm):
    every arm reports the model, threads, steps, batch and the same examples; fp32 and bf16 differ
    in the precision alone, fp32 and its bucketed arm in the batching alone."""
    step = load("step")
    out = tmp_path / "step.json"
    # Execute
    assert step.main(["--quick", "--no-compile", "--repeat", "1", "--warmup", "0", "--threads", "1",
                      "--out", str(out)]) == 0
    capsys.readouterr()
    # Assert
    back = json.loads(out.read_text())
    settings = back["settings"]
    assert set(settings) == {"fp32", "bf16", "fp32-bucketed"} and back["varies"] == ["batching", "compiled", "precision"]
    assert harness.differences(settings["fp32"], settings["bf16"]) == ["precision: 'fp32' vs 'bf16'"]
    assert harness.differences(settings["fp32"], settings["fp32-bucketed"]) == ["batching: 'padded' vs 'by length'"]
    fp32 = settings["fp32"]
    assert (fp32["model"], fp32["threads"], fp32["steps"], fp32["batch_size"]) == ("tiny-bert", 1, 2, 16)
    assert fp32["examples"] == settings["fp32-bucketed"]["examples"]  # the same examples, batched otherwise


def test_scale_refuses_runs_that_differ_in_more_than_their_number_of_clients(capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: runs of one engine and strategy at 10 and 100 clients, as scale's workers report them
    scale = load("scale")
    shared = {"precision": "fp32", "threads": 1, "model": "tiny-bert", "steps": 2, "engine": "inprocess",
              "strategy": "fedit"}

    def run(clients: int, index: int, **changed: object) -> dict:
        return {"engine": "inprocess", "strategy": "fedit", "clients": clients, "index": index,
                "settings": shared | {"clients": clients} | changed}

    # Execute / Assert: the number of clients may differ; and another strategy is its own group
    scale.check_matched([run(10, 0), run(100, 0), run(10, 1), run(100, 1)])
    other = run(10, 0) | {"strategy": "fedsa_lora"}
    other["settings"] = other["settings"] | {"strategy": "fedsa_lora", "threads": 2}
    scale.check_matched([run(10, 0), run(100, 0), other])
    # Execute / Assert: a run at another precision or thread count is refused in one line
    for changed, shown in (({"precision": "bf16"}, "precision: 'fp32' vs 'bf16'"), ({"threads": 2}, "threads: 1 vs 2")):
        with pytest.raises(SystemExit) as stop:
            scale.check_matched([run(10, 0), run(100, 0, **changed)])
        assert str(stop.value).startswith("scale: runs 'inprocess fedit N=10 run 0' and 'inprocess fedit N=100 run 0' "
                                          "differ in more than what is measured (clients): ")
        assert str(stop.value).endswith(shown) and "\n" not in str(stop.value)


def test_secagg_drops_exactly_one_client_a_round_in_its_dropout_arms() -> None:
    from fedlora.clients.faults import SimulatedClientFailure, maybe_fail
    from fedlora.schema import FaultsConfig

    secagg = load("secagg")
    # Execute: the seed of a 5-client federation over 5 rounds, and the faults its arm runs with
    seed = secagg.drop_seed(5, 5)
    faults = FaultsConfig(drop_rate=0.2, seed=seed)
    # Assert: the client's own failure draw fails exactly one client in each round
    for server_round in range(1, 6):
        failed = []
        for partition in range(5):
            try:
                maybe_fail(faults, server_round, partition)
            except SimulatedClientFailure:
                failed.append(partition)
        assert len(failed) == 1, (server_round, failed)
    # and a round of the dropout arm must say so: 4 aggregated, 1 failure, 1 dropped client's masks rebuilt
    report = {"masked": 4, "dead_recovered": 1, "culprits": {}, "seconds": dict.fromkeys(secagg.STAGES, 0.1),
              "wire_bytes": {stage: {"down": 1, "up": 1} for stage in secagg.STAGES}, "error_bound": 1e-8}
    round_ = {"round": 1, "sampled": 5, "clients": 4, "failures": 1, "seconds": 1.0, "client_train_seconds": 0.5,
              "bytes_up": 8, "bytes_down": 4, "wire_bytes_up": 9, "wire_bytes_down": 5,
              "extra": {"secure_aggregation": report}}
    results = {"rounds": [round_], "final": {"global_accuracy": 0.1}}
    assert secagg.figures(results, 10.0, 5, secure=True, dropped=1)["unmask_seconds"] == 0.1
    with pytest.raises(SystemExit, match="with 1 dropped"):
        secagg.figures({**results, "rounds": [{**round_, "extra": {"secure_aggregation": {**report, "dead_recovered": 0}}}]},
                       10.0, 5, secure=True, dropped=1)


def test_secagg_arms_of_other_sizes_and_dropout_share_every_setting_but_those() -> None:
    """secagg's arms at N = 5 and 10 clients, with and without a dropped client: the configs it
    runs (smoke.toml with its overrides, as results.json holds them) give settings that differ in
    the clients, secure aggregation and the dropped clients alone (the pool of examples grows with
    N; each client's share does not); a run whose clients trained at another precision, or on
    other data, is refused."""
    from fedlora.config import load_config

    # Prepare: the results of each arm's run as far as the settings go (its config, its clients' replies)
    secagg = load("secagg")
    args = secagg.parse(["--sizes", "5,10"])

    def results(size: int, secure: bool, dropped: int, precision: str = "fp32", **data: object) -> dict:
        config = load_config(args.config, secagg.overrides(size, secure, args, dropped)).model_dump(mode="json")
        config["data"] |= data
        reply = {"train-precision": precision, "torch-threads": 1}
        return {"config": config, "rounds": [{"per_client_train": {str(k): reply for k in range(size - dropped)}}]}

    # Execute
    arms = {f"{size}-{secure}-{dropped}": secagg.settings(results(size, secure, dropped), args, secure, dropped)
            for size in (5, 10) for secure in (False, True) for dropped in (0, 1)}
    # Assert: matched but for what the benchmark varies
    harness.require_matched(arms, secagg.VARIES)
    assert harness.differences(arms["5-False-0"], arms["10-True-1"]) == [
        "clients: 5 vs 10", "dropped: 0 vs 1", "secure: False vs True"]
    assert arms["10-True-1"]["per_client"] == args.per_client and arms["10-True-1"]["precision"] == "fp32"
    # Assert: another precision, or other data (a different partition), is refused
    for other in (results(10, True, 0, precision="bf16"), results(10, True, 0, partition="dirichlet")):
        with pytest.raises(harness.Unmatched):
            harness.require_matched(arms | {"odd": secagg.settings(other, args, True, 0)}, secagg.VARIES)


def test_overhead_refuses_a_ray_arm_that_trains_several_clients_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: a 2-core machine; the plain loop trains one client at a time
    overhead = load("overhead")
    monkeypatch.setattr(overhead.os, "cpu_count", lambda: 2)
    plain = {"precision": "bf16", "threads": 1, "engine": "plain loop", "clients_at_once": overhead.clients_at_once("plain loop", 1)}
    # Execute / Assert: Ray with 1 CPU per client on 2 cores runs two at once: refused
    ray = plain | {"engine": "ray", "clients_at_once": overhead.clients_at_once("ray", 1)}
    with pytest.raises(harness.Unmatched, match="clients_at_once: 1 vs 2"):
        harness.require_matched({"plain": plain, "fedlora": ray}, varies=("engine",))
    # every core per client (the default), or the in-process engine: one at a time, matched
    for engine, threads in (("ray", 2), ("inprocess", 1)):
        other = plain | {"engine": engine, "threads": threads, "clients_at_once": overhead.clients_at_once(engine, threads)}
        harness.require_matched({"plain": plain | {"threads": threads}, "fedlora": other}, varies=("engine",))
