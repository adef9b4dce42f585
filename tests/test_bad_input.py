"""Every bad input: one line on stderr, exit status 2, no traceback, and nothing half-written.

Table-driven: each case runs the real CLI in a fresh process (as a user would) with its output
folder under a fresh temporary directory, then checks the exit status, that stderr holds exactly
one non-empty line naming the problem, and that no output folder was left behind.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE = str(ROOT / "configs/smoke.toml")
INPROCESS = ("--engine", "inprocess")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


# (case id, argv builder given a scratch folder and the output folder, the message stderr must contain)
Case = tuple[str, Callable[[Path, Path], list[str]], str]
CASES: list[Case] = [
    ("out-is-a-file", lambda d, o: ["run", SMOKE, "--out", str(write(d / "file", "x"))], "is a file"),
    ("data-seed-negative", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", "data.seed=-1"], "data.seed"),
    ("train-seed-negative", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", "train.seed=-1"], "train.seed"),
    ("unknown-target-module", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", 'model.target_modules=["nope"]'],
     "model.target_modules"),
    ("alpha-zero", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", "model.lora_alpha=0"], "model.lora_alpha"),
    ("alpha-nan", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", "model.lora_alpha=nan"], "model.lora_alpha"),
    ("no-rank-supported", lambda d, o: ["run", SMOKE, *INPROCESS, "--out", str(o), "--set", "clients.ranks=[99, 99, 99]"],
     "no client accepted"),
    ("too-many-failed-rounds", lambda d, o: ["run", SMOKE, *INPROCESS, "--out", str(o), "--set", "clients.ranks=[4, 4, 4]",
                                             "--set", "faults.drop_rate=0.99", "--set", "federation.min_clients=2",
                                             "--set", "faults.max_failed_rounds=1"], "faults.max_failed_rounds"),
    ("ffa-refuses-mixed-ranks", lambda d, o: ["run", SMOKE, *INPROCESS, "--out", str(o), "--set", "strategy.name=ffa_lora",
                                              "--set", "strategy.mixed_ranks=refuse"], "mixed_ranks"),
    ("policy-refuses-mixed-ranks", lambda d, o: ["run", SMOKE, *INPROCESS, "--out", str(o), "--set", "strategy.name=fedpissa",
                                                 "--set", "clients.mixed_rank_policy=refuse"], "needs one LoRA rank"),
    ("tune-empty-grid-values", lambda d, o: ["tune", SMOKE, "--strategies", "fedit", "--out", str(o), "--grid", "train.lr=,"],
     "--grid"),
    ("certs-negative-days", lambda d, o: ["deploy", "certs", str(o), "--days", "-1"], "--days"),
    ("certs-zero-days", lambda d, o: ["deploy", "certs", str(o), "--days", "0"], "--days"),
    ("capabilities-missing-readme", lambda d, o: ["capabilities", "--write", "--readme", str(d / "missing.md")],
     "missing.md"),
    ("malformed-toml", lambda d, o: ["run", str(write(d / "bad.toml", "[model\npath = 1")), "--out", str(o)], "cannot parse"),
    ("missing-config", lambda d, o: ["run", str(d / "nope.toml"), "--out", str(o)], "config file not found"),
    ("unknown-key", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", "train.bogus=1"], "unknown config key"),
    ("set-without-equals", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", "train.lr"], "--set expects"),
    ("fraction-out-of-range", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", "data.test_fraction=1.5"],
     "data.test_fraction"),
    ("empty-csv", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", f"data.source={write(d / 'e.csv', '')}"], "empty"),
    ("csv-missing-column", lambda d, o: ["run", SMOKE, "--out", str(o), "--set",
                                        f"data.source={write(d / 'c.csv', 'words,topic' + chr(10) + 'a,b' + chr(10))}"],
     "column"),
    ("too-many-clients", lambda d, o: ["run", SMOKE, "--out", str(o), "--set", "data.max_examples=50",
                                       "--set", "data.global_test_size=10", "--set", "data.num_clients=60"],
     "data.num_clients"),
    ("missing-resume-folder", lambda d, o: ["run", SMOKE, "--resume", str(d / "never")], "no checkpoint"),
    ("compare-unknown-strategy", lambda d, o: ["compare", SMOKE, "--strategies", "fedit,nope", "--out", str(o)],
     "unknown strategy 'nope'"),
]


@pytest.mark.parametrize(("case", "argv", "message"), CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(tmp_path: Path, case: str,
                                                          argv: Callable[[Path, Path], list[str]], message: str) -> None:
    # Prepare
    out = tmp_path / "out"
    # Execute
    proc = subprocess.run([sys.executable, "-m", "fedlora.app.cli", *argv(tmp_path, out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    # Assert
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert not out.exists(), sorted(str(p.relative_to(out)) for p in out.rglob("*"))[:10]
