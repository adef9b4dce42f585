"""Every bad input: one line on stderr, exit status 2, no traceback, nothing half-written, and
earlier results untouched.

Table-driven: each case runs the real CLI in a fresh process (as a user would) with its output
folder under a fresh temporary directory, then checks the exit status, that stderr holds exactly
one non-empty line naming the problem, that no output folder was left behind, and that an earlier
run and an earlier comparison (folders every case gets, and some cases aim at) are byte for byte
as they were. The classes of issue 30 (operator and file side) each have cases: output folders
(an earlier run, contradictory flags, unusable paths), values that cannot work (checked when the
config is loaded), resource limits the model sets (rank, positions), data files (record size,
encoding) and checkpoints. Every case fails before training, so it costs an import (and at most
building the smoke data and tiny model).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs/smoke.toml")
INPROCESS = ("--engine", "inprocess")
MIB = 2**20


def write(path: Path, text: str | bytes) -> Path:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text)
    return path


def earlier_run(folder: Path) -> Path:
    """A folder as a finished run leaves it (results, checkpoint, adapters)."""
    (folder / "checkpoint" / "clients" / "0").mkdir(parents=True)
    (folder / "adapters" / "global").mkdir(parents=True)
    write(folder / "results.json", '{"rounds": [{"round": 1}], "final": {}}')
    write(folder / "checkpoint" / "server.json", '{"format": 3, "round": 1')  # cut short: corrupt
    write(folder / "checkpoint" / "clients" / "0" / "round_1.bin", b"\x0a\x00")
    write(folder / "adapters" / "global" / "adapter_model.safetensors", b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    return folder


def earlier_comparison(folder: Path) -> Path:
    """A folder as a finished comparison leaves it."""
    (folder / "fedit" / "seed0").mkdir(parents=True)
    write(folder / "fedit" / "seed0" / "results.json", '{"rounds": [{"round": 1}], "final": {}}')
    write(folder / "summary.md", "| strategy |\n")
    return folder


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def csv_with_long_record(d: Path) -> Path:
    lines = ["text,label", *(f"short text {i},{i % 2}" for i in range(20)), "x" * (MIB + 10) + ",1"]
    return write(d / "long.csv", "\n".join(lines) + "\n")


def csv_with_long_quoted_field(d: Path) -> Path:
    field = "\n".join(["y" * 1000] * 1100)  # > 1 MiB over short lines: only the field limit sees it
    return write(d / "quoted.csv", f'text,label\na,0\n"{field}",1\n')


def jsonl_with_long_record(d: Path) -> Path:
    return write(d / "long.jsonl", '{"text": "a", "label": 0}\n' + '{"text": "' + "z" * (MIB + 10) + '", "label": 1}\n')


def notes_folder(d: Path) -> Path:
    """A folder of someone's own files (never fedlora's to move)."""
    (d / "notes").mkdir()
    write(d / "notes" / "todo.txt", "x")
    return d / "notes"


def deep_toml(d: Path) -> Path:
    return write(d / "deep.toml", "x = " + "[" * 5000 + "]" * 5000 + "\n")


# (case id, argv builder given a scratch folder, the output folder, an earlier run and an earlier
# comparison, the message stderr must contain)
Argv = Callable[[Path, Path, Path, Path], list[str]]
CASES: list[tuple[str, Argv, str]] = [
    # ------------------------------------------------------------------ output folders
    ("out-is-a-file", lambda d, o, e, c: ["run", SMOKE, "--out", str(write(d / "file", "x"))], "is a file"),
    ("out-under-a-file", lambda d, o, e, c: ["run", SMOKE, "--out", str(write(d / "file", "x") / "sub")],
     "which is a file"),
    ("run-into-an-earlier-run", lambda d, o, e, c: ["run", SMOKE, "--out", str(e)], "holds an earlier run"),
    ("run-default-out-holds-an-earlier-run", lambda d, o, e, c: ["run", SMOKE, "--set", f'output.dir="{e}"'],
     "holds an earlier run"),
    ("resume-and-overwrite", lambda d, o, e, c: ["run", SMOKE, "--resume", str(e), "--overwrite"], "contradict"),
    ("resume-one-folder-out-another", lambda d, o, e, c: ["run", SMOKE, "--resume", str(e), "--out", str(o)],
     "drop --out"),
    ("overwrite-a-folder-fedlora-did-not-write", lambda d, o, e, c: ["run", SMOKE, "--overwrite", "--out",
                                                                     str(notes_folder(d))], "not a fedlora output"),
    ("tensorboard-dir-is-a-file", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set",
                                                      f'output.tensorboard_dir="{write(d / "tb", "x")}"'], "is a file"),
    ("compare-into-an-earlier-comparison", lambda d, o, e, c: ["compare", SMOKE, "--strategies", "fedit", "--out", str(c)],
     "holds an earlier comparison"),
    ("compare-resume-and-overwrite", lambda d, o, e, c: ["compare", SMOKE, "--strategies", "fedit", "--out", str(c),
                                                         "--resume", "--overwrite"], "contradict"),
    ("tune-into-an-earlier-tuning", lambda d, o, e, c: ["tune", SMOKE, "--strategies", "fedit", "--grid", "train.lr=1e-3",
                                                        "--out", str(c)], "holds an earlier tuning"),
    ("deploy-local-into-an-earlier-run", lambda d, o, e, c: ["deploy", "local", SMOKE, "--out", str(e)],
     "holds an earlier deployment"),
    # ------------------------------------------------------------------ checkpoints
    ("resume-corrupt-checkpoint", lambda d, o, e, c: ["run", SMOKE, *INPROCESS, "--resume", str(e)],
     "corrupt or not a fedlora checkpoint"),
    ("missing-resume-folder", lambda d, o, e, c: ["run", SMOKE, "--resume", str(d / "never")], "no checkpoint"),
    # ------------------------------------------------------------------ config files and values
    ("malformed-toml", lambda d, o, e, c: ["run", str(write(d / "bad.toml", "[model\npath = 1")), "--out", str(o)],
     "cannot parse"),
    ("toml-not-utf8", lambda d, o, e, c: ["run", str(write(d / "bin.toml", b"\xff\xfe[model]\n")), "--out", str(o)],
     "not UTF-8"),
    ("toml-nested-too-deeply", lambda d, o, e, c: ["run", str(deep_toml(d)), "--out", str(o)], "cannot parse"),
    ("missing-config", lambda d, o, e, c: ["run", str(d / "nope.toml"), "--out", str(o)], "config file not found"),
    ("unknown-key", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "train.bogus=1"], "unknown config key"),
    ("set-without-equals", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "train.lr"], "--set expects"),
    ("fraction-out-of-range", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "data.test_fraction=1.5"],
     "data.test_fraction"),
    ("data-seed-negative", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "data.seed=-1"], "data.seed"),
    ("train-seed-negative", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "train.seed=-1"], "train.seed"),
    ("train-seed-too-large", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "train.seed=4294967296"],
     "train.seed"),
    ("faults-seed-negative", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "faults.seed=-1"], "faults.seed"),
    ("gpu-fraction-beyond-the-machine", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "federation.num_gpus=64"],
     "federation.num_gpus = 64 asks each simulated client"),
    ("lr-inf", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "train.lr=inf"], "train.lr"),
    ("weight-decay-nan", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "train.weight_decay=nan"],
     "train.weight_decay"),
    ("dp-noise-inf", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "privacy.dp=true", "--set",
                                         "privacy.noise_multiplier=inf"], "privacy.noise_multiplier"),
    ("dp-target-epsilon-nan", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "privacy.dp=true", "--set",
                                                  "privacy.target_epsilon=nan"], "privacy.target_epsilon"),
    ("dp-clip-inf", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "privacy.dp=true", "--set",
                                        "privacy.noise_multiplier=1", "--set", "privacy.max_grad_norm=inf"],
     "privacy.max_grad_norm"),
    ("round-timeout-inf", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "federation.round_timeout=inf"],
     "federation.round_timeout"),
    ("dirichlet-alpha-inf", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "data.dirichlet_alpha=inf"],
     "data.dirichlet_alpha"),
    ("rank-tier-share-nan", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "clients.ranks=[]", "--set",
                                                'clients.rank_tiers={"2" = nan, "4" = 1.0}'], "clients.rank_tiers"),
    ("norm-bound-inf", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "faults.max_update_norm=inf"],
     "faults.max_update_norm"),
    ("strategy-option-nan", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "strategy.name=hetlora",
                                                "--set", "strategy.prune_lambda=nan"], "strategy.prune_lambda"),
    ("alpha-zero", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "model.lora_alpha=0"], "model.lora_alpha"),
    ("alpha-nan", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "model.lora_alpha=nan"], "model.lora_alpha"),
    ("compare-unknown-strategy", lambda d, o, e, c: ["compare", SMOKE, "--strategies", "fedit,nope", "--out", str(o)],
     "unknown strategy 'nope'"),
    ("tune-empty-grid-values", lambda d, o, e, c: ["tune", SMOKE, "--strategies", "fedit", "--out", str(o),
                                                   "--grid", "train.lr=,"], "--grid"),
    ("certs-negative-days", lambda d, o, e, c: ["deploy", "certs", str(o), "--days", "-1"], "--days"),
    ("certs-zero-days", lambda d, o, e, c: ["deploy", "certs", str(o), "--days", "0"], "--days"),
    ("capabilities-missing-readme", lambda d, o, e, c: ["capabilities", "--write", "--readme", str(d / "missing.md")],
     "missing.md"),
    # ------------------------------------------------------------------ saved adapters (tests/test_adapter_commands.py: more)
    ("eval-a-folder-that-is-no-adapter", lambda d, o, e, c: ["eval", str(e / "adapters" / "global"), "--data",
                                                             str(write(d / "t.csv", "text,label\na,b\n"))],
     "holds no adapter_config.json"),
    ("export-without-out", lambda d, o, e, c: ["export", str(e / "adapters" / "global")],
     "the following arguments are required: --out"),
    # ------------------------------------------------------------------ limits the model sets
    ("unknown-target-module", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set",
                                                  'model.target_modules=["nope"]'], "model.target_modules"),
    ("rank-too-large-to-allocate", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "clients.ranks=[]",
                                                       "--set", "model.lora_rank=100000000"], "model.lora_rank: rank"),
    ("client-rank-above-the-modules", lambda d, o, e, c: ["run", SMOKE, *INPROCESS, "--out", str(o), "--set",
                                                          "clients.ranks=[99, 99, 99]"], "allow at most rank 32"),
    ("max-length-above-positions", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "train.max_length=4096"],
     "positions"),
    # ------------------------------------------------------------------ data files
    ("empty-csv", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", f"data.source={write(d / 'e.csv', '')}"],
     "empty"),
    ("csv-missing-column", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set",
                                               f"data.source={write(d / 'c.csv', 'words,topic' + chr(10) + 'a,b' + chr(10))}"],
     "column"),
    ("csv-record-over-1-mib", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set",
                                                  f"data.source={csv_with_long_record(d)}"], "line 22 is longer than 1 MiB"),
    ("csv-quoted-field-over-1-mib", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set",
                                                        f"data.source={csv_with_long_quoted_field(d)}"], "field larger"),
    ("jsonl-record-over-1-mib", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set",
                                                    f"data.source={jsonl_with_long_record(d)}"], "line 2 is longer"),
    ("csv-not-utf8", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set",
                                         f"data.source={write(d / 'b.csv', b'text,label' + bytes([10, 255, 44, 49, 10]))}"],
     "not UTF-8"),
    ("too-many-clients", lambda d, o, e, c: ["run", SMOKE, "--out", str(o), "--set", "data.max_examples=50",
                                             "--set", "data.global_test_size=10", "--set", "data.num_clients=60"],
     "data.num_clients"),
    # ------------------------------------------------------------------ runs no client can take part in
    ("too-many-failed-rounds", lambda d, o, e, c: ["run", SMOKE, *INPROCESS, "--out", str(o), "--set",
                                                   "clients.ranks=[4, 4, 4]", "--set", "faults.drop_rate=0.99",
                                                   "--set", "federation.min_clients=2", "--set",
                                                   "faults.max_failed_rounds=1"], "faults.max_failed_rounds"),
    ("ffa-refuses-mixed-ranks", lambda d, o, e, c: ["run", SMOKE, *INPROCESS, "--out", str(o), "--set",
                                                    "strategy.name=ffa_lora", "--set", "strategy.mixed_ranks=refuse"],
     "mixed_ranks"),
    ("policy-refuses-mixed-ranks", lambda d, o, e, c: ["run", SMOKE, *INPROCESS, "--out", str(o), "--set",
                                                       "strategy.name=fedpissa", "--set",
                                                       "clients.mixed_rank_policy=refuse"], "needs one LoRA rank"),
]


def run_cli(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedlora.app.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, check=False)


def assert_one_line_exit_2(proc: subprocess.CompletedProcess[str], message: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


@pytest.mark.e2e
@pytest.mark.parametrize(("case", "argv", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path: Path, case: str, argv: Argv, message: str) -> None:
    # Prepare: an output folder that must not appear, an earlier run and an earlier comparison
    out = tmp_path / "out"
    run, comparison = earlier_run(tmp_path / "earlier"), earlier_comparison(tmp_path / "earlier-compare")
    before = tree(run), tree(comparison)
    # Execute
    proc = run_cli(argv(tmp_path, out, run, comparison))
    # Assert: one line, exit 2, no output folder, nothing earlier changed or moved
    assert_one_line_exit_2(proc, message)
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))[:10]
    assert (tree(run), tree(comparison)) == before
    assert not list(tmp_path.rglob("*.old-*"))  # nothing was moved aside either


@pytest.mark.e2e
def test_an_out_folder_the_system_refuses_is_one_line(tmp_path: Path) -> None:
    # Prepare: a folder this process cannot create (sysfs refuses new entries even to root)
    target = Path("/sys/fedlora-test-output")
    if not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs on this system")
    # Execute
    proc = run_cli(["run", SMOKE, "--out", str(target)])
    # Assert
    assert_one_line_exit_2(proc, "cannot be written")
    assert not target.exists()


@pytest.mark.e2e
def test_a_read_only_out_folder_is_one_line(tmp_path: Path) -> None:
    # Prepare: a read-only parent (root ignores permission bits: then there is nothing to test)
    parent = tmp_path / "read-only"
    parent.mkdir()
    parent.chmod(0o500)
    try:
        if os.access(parent, os.W_OK):
            pytest.skip("this user can write into read-only folders (root)")
        # Execute
        proc = run_cli(["run", SMOKE, "--out", str(parent / "run")])
        # Assert
        assert_one_line_exit_2(proc, "cannot be written")
        assert not (parent / "run").exists()
    finally:
        parent.chmod(0o700)


def test_an_unreadable_config_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare: reading the file fails as an unreadable one does (root reads any file, so the OS
    # error is raised where the config is read)
    from fedlora.config import ConfigError, load_config

    def refuse(self: Path, *args: object, **kwargs: object) -> str:
        raise PermissionError(13, "Permission denied", str(self))

    config = write(tmp_path / "secret.toml", "[model]\n")
    monkeypatch.setattr(Path, "read_text", refuse)
    # Execute / Assert
    with pytest.raises(ConfigError, match="cannot read config .*secret.toml: Permission denied") as error:
        load_config(config)
    assert "\n" not in str(error.value)


def test_an_os_error_during_a_command_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    # Prepare: the disk fills up while a run writes (any OS error the checks could not foresee)
    from fedlora.app import cli

    def full_disk(args: object) -> int:
        raise OSError(28, "No space left on device", "/data/run/results.json")

    monkeypatch.setattr(cli, "_cmd_run", full_disk)
    # Execute
    status = cli.main(["run", SMOKE])
    # Assert
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert status == 2
    assert lines == ["fedlora: error: No space left on device: /data/run/results.json"]


def test_a_saved_dataset_with_an_overlong_text_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # Prepare: a datasets.save_to_disk folder with one 2 MiB text
    import datasets

    from fedlora.config import DataConfig
    from fedlora.data import DataError, load_source

    folder = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["short", "w" * (2 * MIB)], "label": [0, 1]}).save_to_disk(str(folder))
    # Execute / Assert
    with pytest.raises(DataError, match="a text is longer than 1 MiB") as error:
        load_source(DataConfig(source=str(folder)))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_one_huge_record_is_refused_reading_at_most_one_mib_of_it(tmp_path: Path, suffix: str) -> None:
    # Prepare: a data file whose second record is 64 MiB (before: read whole, gigabytes of memory)
    import tracemalloc

    from fedlora.config import DataConfig
    from fedlora.data import DataError, load_source

    path = tmp_path / f"huge{suffix}"
    with path.open("w") as handle:
        if suffix == ".csv":
            handle.write("text,label\nsmall,0\n" + "x" * (64 * MIB) + ",1\n")
        else:
            handle.write('{"text": "small", "label": 0}\n{"text": "' + "x" * (64 * MIB) + '", "label": 1}\n')
    # Execute
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match="line [23] is longer than 1 MiB"):
            load_source(DataConfig(source=str(path)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Assert: memory of the order of one record's cap, not of the record
    assert peak < 8 * MIB, peak
