"""One harness for every benchmark in ``benchmarks/``: repeated, interleaved arms, robust summaries.

One run of each side is not a measurement on a shared machine: a neighbour's job, a frequency
change or a cold page cache moves a single figure by 20-40 %. So a benchmark here is a set of
*arms* (callables that run one side once and return named figures, e.g. ``{"seconds": 3.1}``),
and the harness

1. runs every arm ``warmup`` times (default 1; discarded: first calls pay one-off costs such as
   LAPACK set-up, page-cache fills or lazy imports),
2. then runs the arms **interleaved**, A B A B ... ``repeat`` times (default 5), so slow drift of
   the machine hits every arm alike, and pair ``i`` (the i-th run of each arm) was taken at
   nearly the same time,
3. reports min / median / max of every figure per arm, the ratio of the two arms' medians, and
   the *spread*: max / min of the per-pair ratios (1.0 = every pair agreed; 1.3 = the machine
   moved the ratio by 30 % between pairs, so the median is the figure to quote),
4. writes a JSON record (:func:`write_record`) beside the printed line: the environment
   (:func:`environment`: CPU model, count and bf16 flags, GPU, versions, git commit, command line,
   load average, time), the 1-minute load at the start of every run, the arguments, every raw
   measurement (warm-up included) and the summary, so a README figure can cite its file.

**Arms that differ only in what is measured.** An arm may return a :class:`Run`: its figures and
the *settings* it actually ran at (precision, threads, model, data, steps ..., read where the run
happened, not copied from what was asked). The harness then refuses (:class:`Unmatched`) an arm
whose settings change from one run to the next, and arms whose settings differ in anything but the
keys the benchmark says it varies (``varies``: e.g. ``precision`` for an fp32 / bf16 benchmark);
the check runs after the first run of every arm, so a mismatched benchmark stops within minutes.
The record keeps every arm's settings, and :func:`comparable` (``python benchmarks/harness.py
compare OLD.json NEW.json``) refuses to compare two records whose shared settings differ, or a
record that names none (written before the harness recorded settings). A benchmark with its own
loop (``scale.py``) uses :func:`require_matched` on its runs' settings directly.

A benchmark script uses :func:`add_arguments` (``--repeat``, ``--warmup``, ``--out``, ``--note``),
:func:`run_interleaved`, :func:`compare`, :func:`report` and :func:`write_record`; its last printed
line stays ``key=value ...`` with the medians and ``spread=``. Only the standard library and numpy
are needed (torch is imported only to name a GPU, if it is installed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"  # committed records the docs cite
QUICK_RESULTS = ROOT / "runs" / "benchmarks"  # smoke-test records (runs/ is git-ignored)
DEFAULT_REPEAT = 5
DEFAULT_WARMUP = 1
VERSIONED = ("numpy", "scipy", "torch", "flwr", "transformers", "peft", "ray")

Figures = dict[str, float]
Settings = dict[str, Any]


@dataclass(frozen=True)
class Run:
    """One run of an arm: its figures, and the settings it ran at (JSON values: what the run used,
    e.g. ``{"precision": "bf16", "threads": 2, "model": "minilm", "steps": 8}``)."""

    figures: Mapping[str, float]
    settings: Mapping[str, Any]


Arm = Callable[[], "Mapping[str, float] | Run"]
Log = Callable[[str], None]


class Unmatched(ValueError):
    """Arms, or records, that differ in a setting they must share (or do not say what they ran at)."""


def differences(first: Mapping[str, Any], second: Mapping[str, Any], varies: Collection[str] = ()) -> list[str]:
    """``key: first vs second`` for every key outside ``varies`` whose values differ (a key only one
    of them names counts as a difference)."""
    keys = sorted((set(first) | set(second)) - set(varies))
    missing = object()
    return [f"{key}: {first.get(key, '(not recorded)')!r} vs {second.get(key, '(not recorded)')!r}"
            for key in keys if first.get(key, missing) != second.get(key, missing)]


def require_matched(settings: Mapping[str, Mapping[str, Any]], varies: Collection[str] = (),
                    what: str = "arms") -> None:
    """Raise :class:`Unmatched` unless every entry of ``settings`` (arm -> its settings) names the
    same values outside ``varies`` (the first entry is the reference)."""
    names = list(settings)
    for name in names[1:]:
        diff = differences(settings[names[0]], settings[name], varies)
        if diff:
            raise Unmatched(f"{what} {names[0]!r} and {name!r} differ in more than what is measured "
                            f"({', '.join(sorted(varies)) or 'nothing may differ'}): {'; '.join(diff)}")


def _print(line: str) -> None:
    print(line, flush=True)


@dataclass
class Measurements:
    """Every figure every arm returned: ``samples[arm][i]`` is the arm's i-th timed run (pair i),
    ``warmup[arm]`` its discarded warm-up runs, ``order`` the run sequence as (arm, index), the
    warm-up runs indexed -warmup .. -1 and the timed ones 0 .. repeat - 1."""

    arms: list[str]
    samples: dict[str, list[Figures]] = field(default_factory=dict)
    warmup: dict[str, list[Figures]] = field(default_factory=dict)
    order: list[tuple[str, int]] = field(default_factory=list)
    settings: dict[str, Settings] = field(default_factory=dict)  # per arm, as its runs reported them
    varies: list[str] = field(default_factory=list)  # the settings the arms may differ in
    loads: list[float | None] = field(default_factory=list)  # 1-minute load average as each run began


def _call(arm: Arm, name: str) -> tuple[Figures, Settings | None]:
    """One run of an arm: its figures checked to be real numbers, and its settings (None when the
    arm returned bare figures)."""
    result = arm()
    values, settings = (result.figures, dict(result.settings)) if isinstance(result, Run) else (result, None)
    figures = {key: float(value) for key, value in values.items()}
    if not figures:
        raise ValueError(f"arm {name!r} returned no figures")
    return figures, settings


def _load() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def _note_settings(measured: Measurements, name: str, settings: Settings | None, index: int) -> None:
    """Keep an arm's settings from its first run; refuse a later run that ran at others."""
    if name not in measured.settings:
        if settings is not None:
            measured.settings[name] = settings
        return
    if settings is None:
        raise Unmatched(f"arm {name!r} stopped reporting its settings in run {index}")
    diff = differences(measured.settings[name], settings)
    if diff:
        raise Unmatched(f"arm {name!r} ran at other settings in run {index} than in its first: {'; '.join(diff)}")


def _check_arms(measured: Measurements) -> None:
    """After every arm ran once: all report settings or none, and they differ only in ``varies``."""
    reported = [name for name in measured.arms if name in measured.settings]
    if reported and len(reported) != len(measured.arms):
        silent = sorted(set(measured.arms) - set(reported))
        raise Unmatched(f"arms {silent} report no settings while {reported} do: cannot tell they match")
    require_matched(measured.settings, measured.varies)


def run_interleaved(arms: Mapping[str, Arm], repeat: int = DEFAULT_REPEAT, warmup: int = DEFAULT_WARMUP,
                    log: Log | None = _print, varies: Collection[str] = ()) -> Measurements:
    """Run ``warmup`` rounds of every arm (discarded), then ``repeat`` rounds A B A B ...

    Arms run in the mapping's order within each round. ``log`` (default: print) gets one line per
    run, so a long benchmark shows progress; ``None`` silences it. Arms that return a :class:`Run`
    must keep their settings from run to run and differ from each other only in ``varies``
    (checked once every arm has run once; :class:`Unmatched` otherwise).
    """
    if repeat < 1 or warmup < 0:
        raise ValueError(f"need repeat >= 1 and warmup >= 0, got repeat={repeat}, warmup={warmup}")
    if not arms:
        raise ValueError("no arms to run")
    measured = Measurements(arms=list(arms), varies=sorted(varies))
    for name in arms:
        measured.samples[name], measured.warmup[name] = [], []
    total = (warmup + repeat) * len(arms)
    for round_index in range(-warmup, repeat):
        for name, arm in arms.items():
            measured.loads.append(_load())
            figures, settings = _call(arm, name)
            _note_settings(measured, name, settings, len(measured.order) + 1)
            kept = measured.warmup[name] if round_index < 0 else measured.samples[name]
            kept.append(figures)
            measured.order.append((name, round_index))
            if log is not None:
                label = f"warm-up {warmup + round_index + 1}/{warmup}" if round_index < 0 else f"run {round_index + 1}/{repeat}"
                shown = " ".join(f"{key}={value:.4g}" for key, value in figures.items())
                log(f"[{len(measured.order)}/{total}] {name} {label}: {shown}")
        if round_index == -warmup:
            _check_arms(measured)
    return measured


@dataclass(frozen=True)
class Stats:
    """min / median / max of one figure over an arm's timed runs."""

    min: float
    median: float
    max: float
    n: int


def describe(samples: Sequence[Mapping[str, float]]) -> dict[str, Stats]:
    """Per figure, min / median / max over the samples (every sample must name the same figures)."""
    if not samples:
        raise ValueError("no samples to describe")
    keys = list(samples[0])
    for sample in samples[1:]:
        if set(sample) != set(keys):
            raise ValueError(f"samples name different figures: {sorted(keys)} vs {sorted(sample)}")
    out = {}
    for key in keys:
        values = [float(sample[key]) for sample in samples]
        out[key] = Stats(min(values), statistics.median(values), max(values), len(values))
    return out


@dataclass(frozen=True)
class Comparison:
    """``numerator`` / ``denominator`` on one figure: the ratio of the medians, the ratio of each
    pair (same index, run side by side) and their spread, max / min of the pair ratios."""

    figure: str
    numerator: str
    denominator: str
    numerator_median: float
    denominator_median: float
    ratio: float
    pair_ratios: list[float]
    spread: float


def compare(measured: Measurements, numerator: str, denominator: str, figure: str) -> Comparison:
    """Ratio of medians of ``figure`` (numerator arm over denominator arm) and the pairs' spread;
    :class:`Unmatched` when the two arms reported settings that differ outside ``measured.varies``."""
    if numerator in measured.settings and denominator in measured.settings:
        require_matched({numerator: measured.settings[numerator], denominator: measured.settings[denominator]},
                        measured.varies)
    top = [sample[figure] for sample in measured.samples[numerator]]
    bottom = [sample[figure] for sample in measured.samples[denominator]]
    pairs = [t / b if b else float("nan") for t, b in zip(top, bottom, strict=True)]
    top_median, bottom_median = statistics.median(top), statistics.median(bottom)
    ratio = top_median / bottom_median if bottom_median else float("nan")
    low = min(pairs)
    spread = max(pairs) / low if low > 0 else float("nan")
    return Comparison(figure, numerator, denominator, top_median, bottom_median, ratio, pairs, spread)


def report(measured: Measurements, comparison: Comparison | None = None, digits: int = 3) -> str:
    """A plain-text table: per arm and figure, min / median / max; then the ratio and spread."""
    rows = [(arm, key, stats) for arm in measured.arms for key, stats in describe(measured.samples[arm]).items()]
    arm_width = max(len(arm) for arm, _, _ in rows)
    key_width = max(len(key) for _, key, _ in rows)
    n = len(measured.samples[measured.arms[0]])
    lines = [f"{'arm':<{arm_width}}  {'figure':<{key_width}}  {'min':>10} {'median':>10} {'max':>10}   (n={n} each)"]
    for arm, key, stats in rows:
        lines.append(f"{arm:<{arm_width}}  {key:<{key_width}}  {stats.min:>10.{digits}f} "
                     f"{stats.median:>10.{digits}f} {stats.max:>10.{digits}f}")
    if comparison is not None:
        c = comparison
        lines.append(f"{c.numerator} / {c.denominator} on {c.figure}: ratio of medians {c.ratio:.{digits}f}; "
                     f"per pair " + " ".join(f"{r:.{digits}f}" for r in c.pair_ratios)
                     + f"; spread (max/min of the pairs) {c.spread:.{digits}f}")
    if measured.settings:
        lines.append(settings_line(measured))
    return "\n".join(lines)


def settings_line(measured: Measurements) -> str:
    """``arms matched on: k=v ...; varied: k (arm=v, ...)``: what every arm shared, what differed."""
    first = measured.settings[measured.arms[0]]
    shared = " ".join(f"{key}={value}" for key, value in sorted(first.items()) if key not in measured.varies)
    varied = "; ".join(f"{key} (" + ", ".join(f"{arm}={measured.settings[arm].get(key)}" for arm in measured.arms) + ")"
                       for key in measured.varies if any(key in s for s in measured.settings.values()))
    return f"arms matched on: {shared}" + (f"; varied: {varied}" if varied else "")


def fedlora_run(config: str | Path, overrides: Sequence[str], out: Path, engine: str,
                name: str = "fedlora run") -> tuple[dict[str, Any], float]:
    """``fedlora run CONFIG --out OUT --engine ENGINE --set ...`` in a fresh process: its
    results.json and the process's wall seconds. Tokeniser threads off; Ray's workers at the
    caller's priority (Ray starts them 15 nice levels below itself: on a busy machine the clients
    would train at a lower priority than a plain arm). A failed run ends the benchmark (SystemExit
    naming ``name`` and the overrides, with the run's output tail)."""
    import time

    command = [sys.executable, "-m", "fedlora.app.cli", "run", str(config), "--out", str(out), "--engine", engine]
    for item in overrides:
        command += ["--set", item]
    env = os.environ | {"TOKENIZERS_PARALLELISM": "false",
                        "RAY_worker_niceness": os.environ.get("RAY_worker_niceness", "0")}
    started = time.perf_counter()
    proc = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"{name}: fedlora run failed ({proc.returncode}): {' '.join(overrides)}\n"
                         f"{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads((out / "results.json").read_text()), wall


def config_settings(config: Mapping[str, Any]) -> Settings:
    """What a fedlora config fixes that two compared runs must share (a config as a dict, as
    ``results.json`` holds it or ``model_dump(mode="json")`` gives it): model, rank, clients,
    rounds, steps, batch, tokens, learning rate, seed, and the data section as a short hash."""
    import hashlib

    model, data, train = config["model"], config["data"], config["train"]
    return {"model": model["path"], "rank": model["lora_rank"], "clients": data["num_clients"],
            "rounds": train["rounds"], "steps": train["max_steps"], "local_epochs": train["local_epochs"],
            "batch_size": train["batch_size"], "max_length": train["max_length"], "lr": train["lr"],
            "seed": train["seed"],
            "data": hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]}


def reported_settings(results: Mapping[str, Any], name: str = "fedlora run") -> Settings:
    """The settings a fedlora run ran at: the precision and torch threads its clients reported with
    every training reply (``per_client_train``: ``train-precision``, ``torch-threads``; all alike,
    else :class:`Unmatched`) and what its config fixed (:func:`config_settings`)."""
    reported = {(entry.get("train-precision"), entry.get("torch-threads"))
                for r in results["rounds"] for entry in (r.get("per_client_train") or {}).values()}
    if len(reported) != 1 or None in next(iter(reported)):
        raise Unmatched(f"{name}: its clients reported several settings, or none: {sorted(map(str, reported))}")
    precision, threads = next(iter(reported))
    return {"precision": precision, "threads": int(threads)} | config_settings(results["config"])


def _cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (Linux), else what :mod:`platform` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _bf16_flags() -> list[str]:
    """The CPU's native-bf16 flags (``avx512_bf16``, ``amx_bf16``; Linux): what ``train.precision =
    "auto"`` reads, so a record says whether ``auto`` meant bf16 on its machine."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text(errors="replace").split())
    except OSError:
        return []
    return sorted({"avx512_bf16", "amx_bf16"} & flags)


def _gpu_name() -> str | None:
    """The first CUDA device's name, if torch is installed and sees one (None otherwise)."""
    if importlib.util.find_spec("torch") is None:
        return None
    try:
        import torch

        return str(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    except (ImportError, OSError, RuntimeError, AssertionError):  # a broken CUDA set-up must not stop a CPU run
        return None


def _versions() -> dict[str, str | None]:
    """Installed versions (from package metadata, nothing imported) of what the figures depend on."""
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def environment(note: str = "") -> dict[str, Any]:
    """What the figures were measured on and with: CPU (model, count, bf16 flags), GPU, versions,
    commit, command, load, time.

    ``load_average`` (1, 5, 15 min, as ``uptime`` prints them) tells a busy machine from an idle
    one; ``note`` is the user's own words (e.g. "another benchmark on both cores").
    """
    status = _git("status", "--porcelain", "--untracked-files=no")
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    return {
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": affinity,
        "gpu": _gpu_name(),
        "cpu_bf16_flags": _bf16_flags(),
        "platform": platform.platform(),
        "versions": _versions(),
        "git_commit": _git("rev-parse", "HEAD"),
        "git_dirty": bool(status) if status is not None else None,
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "timestamp": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "note": note,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark shares: ``--repeat``, ``--warmup``, ``--out``, ``--note``.

    ``--repeat`` / ``--warmup`` default to None so a script's ``--quick`` can pick smaller values
    unless the user gave them (:func:`settle`).
    """
    group = parser.add_argument_group("harness")
    group.add_argument("--repeat", type=int, default=None,
                       help=f"timed runs of each arm, interleaved A B A B ... (default {DEFAULT_REPEAT})")
    group.add_argument("--warmup", type=int, default=None,
                       help=f"discarded runs of each arm before timing (default {DEFAULT_WARMUP})")
    group.add_argument("--out", type=Path, default=None,
                       help="JSON record path (default benchmarks/results/<name>.json; "
                       "with --quick runs/benchmarks/<name>-quick.json)")
    group.add_argument("--note", default="", help="free text stored in the record (e.g. 'machine busy')")


def settle(args: argparse.Namespace, name: str, quick: bool = False, repeat: int = DEFAULT_REPEAT,
           warmup: int = DEFAULT_WARMUP) -> None:
    """Fill in ``args.repeat`` / ``args.warmup`` / ``args.out`` where the user left them unset."""
    args.repeat = repeat if args.repeat is None else args.repeat
    args.warmup = warmup if args.warmup is None else args.warmup
    if args.repeat < 1 or args.warmup < 0:
        raise SystemExit(f"error: need --repeat >= 1 and --warmup >= 0, got {args.repeat} and {args.warmup}")
    if args.out is None:
        args.out = QUICK_RESULTS / f"{name}-quick.json" if quick else RESULTS / f"{name}.json"


def _jsonable(value: Any) -> Any:
    """Paths as strings (relative to the repository when inside it, also when given as strings),
    dataclasses as dicts, containers walked."""
    if is_dataclass(value) and not isinstance(value, type):
        return _jsonable(asdict(value))
    if isinstance(value, Path):
        return str(value.relative_to(ROOT)) if value.is_absolute() and value.is_relative_to(ROOT) else str(value)
    if isinstance(value, str) and value.startswith(str(ROOT) + os.sep):
        return value[len(str(ROOT)) + 1:]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def record(name: str, args: argparse.Namespace | Mapping[str, Any], measured: Measurements,
           comparison: Comparison | None, last_line: str, extra: Mapping[str, Any] | None = None,
           env: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON-ready record of one benchmark run: environment, arguments, raw runs and summary.

    Pass ``env`` as taken before the runs (:func:`environment`), so its load average is the one
    at the start; ``load_average_end`` is read here, at the end.
    """
    arguments = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    data: dict[str, Any] = _jsonable({
        "benchmark": name,
        "last_line": last_line,
        "environment": dict(env) if env is not None else environment(str(arguments.get("note", ""))),
        "load_average_end": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "arguments": arguments,
        "repeat": len(measured.samples[measured.arms[0]]),
        "warmup": len(measured.warmup[measured.arms[0]]),
        "order": [list(step) for step in measured.order],
        "samples": measured.samples,
        "warmup_samples": measured.warmup,
        "summary": {arm: {key: asdict(stats) for key, stats in describe(measured.samples[arm]).items()}
                    for arm in measured.arms},
        "settings": measured.settings,  # per arm, as its runs reported them (empty: the arms reported none)
        "varies": measured.varies,
        "load_per_run": measured.loads,  # 1-minute load average as each run (in ``order``) began
        "comparison": asdict(comparison) if comparison is not None else None,
        "extra": dict(extra or {}),
    })
    return data


def write_record(path: Path, data: Mapping[str, Any]) -> Path:
    """Write ``data`` as indented JSON to ``path`` (folders created; written whole, then renamed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, allow_nan=True) + "\n")
    tmp.replace(path)
    return path


def finish(name: str, args: argparse.Namespace, measured: Measurements, comparison: Comparison | None,
           last_line: str, extra: Mapping[str, Any] | None = None, env: Mapping[str, Any] | None = None) -> int:
    """A benchmark's ending: its record written to ``args.out`` (:func:`record`), the path and then
    ``last_line`` printed (the line the results pages quote); the exit status 0."""
    path = write_record(args.out, record(name, args, measured, comparison, last_line, extra, env))
    print(f"record: {path}")
    print(last_line)
    return 0


def record_settings(data: Mapping[str, Any], name: str = "record") -> dict[str, Settings]:
    """A record's settings per arm; :class:`Unmatched` when it names none (a record written before
    the harness recorded them, or a benchmark whose arms report none)."""
    settings = data.get("settings") or {}
    if not settings:
        raise Unmatched(f"{name} records no settings of its arms (written before benchmarks recorded them): "
                        "its arms may differ in precision, threads or data, so it is not compared")
    return {str(arm): dict(values) for arm, values in settings.items()}


def comparable(first: Mapping[str, Any], second: Mapping[str, Any], names: tuple[str, str] = ("first", "second")) -> list[str]:
    """The arms two records share, after checking that they may be compared: the same benchmark,
    and every shared arm at the same settings (:class:`Unmatched` otherwise)."""
    if first.get("benchmark") != second.get("benchmark"):
        raise Unmatched(f"{names[0]} is a {first.get('benchmark')!r} record, {names[1]} a {second.get('benchmark')!r} one")
    a, b = record_settings(first, names[0]), record_settings(second, names[1])
    shared = [arm for arm in a if arm in b]
    if not shared:
        raise Unmatched(f"{names[0]} and {names[1]} have no arm in common ({sorted(a)} vs {sorted(b)})")
    for arm in shared:
        diff = differences(a[arm], b[arm])
        if diff:
            raise Unmatched(f"arm {arm!r} ran at other settings in {names[1]} than in {names[0]}: {'; '.join(diff)}")
    return shared


def compare_records(first: Mapping[str, Any], second: Mapping[str, Any],
                    names: tuple[str, str] = ("first", "second")) -> str:
    """Two records of one benchmark side by side (:func:`comparable` first): per shared arm and
    figure the two medians and second / first, then each record's own comparison, load and machine."""
    arms = comparable(first, second, names)
    lines = [f"{'arm':<12} {'figure':<24} {names[0][-28:]:>28} {names[1][-28:]:>28} {'second/first':>12}"]
    for arm in arms:
        for figure, stats in first["summary"][arm].items():
            other = second["summary"][arm].get(figure)
            if other is None:
                continue
            ratio = other["median"] / stats["median"] if stats["median"] else float("nan")
            lines.append(f"{arm:<12} {figure:<24} {stats['median']:>28.4g} {other['median']:>28.4g} {ratio:>12.3f}")
    for name, data in zip(names, (first, second), strict=True):
        c, env = data.get("comparison") or {}, data.get("environment", {})
        own = (f"{c['numerator']} / {c['denominator']} on {c['figure']}: {c['ratio']:.3f} (spread {c['spread']:.3f}); "
               if c else "")
        lines.append(f"{name}: {own}load {env.get('load_average')}; {env.get('cpu_model')}; commit "
                     f"{str(env.get('git_commit'))[:8]}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python benchmarks/harness.py compare OLD.json NEW.json``: two records side by side, refused
    in one line (exit 2) when their arms' settings differ or a record names none."""
    parser = argparse.ArgumentParser(prog="benchmarks/harness.py", description=main.__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    pair = commands.add_parser("compare", help="two records of one benchmark, side by side")
    pair.add_argument("first", type=Path)
    pair.add_argument("second", type=Path)
    args = parser.parse_args(argv)
    try:
        records = [json.loads(path.read_text()) for path in (args.first, args.second)]
        print(compare_records(records[0], records[1], (str(args.first), str(args.second))))
    except (OSError, ValueError, KeyError) as error:  # Unmatched is a ValueError; so is bad JSON
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
