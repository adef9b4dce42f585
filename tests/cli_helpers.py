"""Running the ``fedlora`` CLI as a user would: a fresh Python process, output captured."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

from strategy_helpers import short_run_override_map

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
QUICK = ROOT / "configs/quick.toml"
# The golden cut of configs/quick.toml (tests/test_golden.py, the notebook test): the same pretrained
# MiniLM, task, label skew (Dirichlet 0.5) and learning rate; fewer clients, examples, rounds, steps
# and tokens (the first 16 of each gloss, batches of 8), so that every strategy runs in seconds and
# still learns (tests/test_golden.py checks that every pinned run beats the majority class).
QUICK_CUT: tuple[str, ...] = (
    "data.num_clients=3", "data.max_examples=360", "data.global_test_size=40", "train.rounds=2",
    "train.max_steps=8", "train.batch_size=8", "train.max_length=16",
)
# A strategy's own options the cut needs (tests/strategy_helpers.py: fedtreelora's warm-up must end
# before the last round).
QUICK_CUT_OPTIONS: dict[str, list[str]] = short_run_override_map()


def fedlora_run(out: Path, *overrides: str, args: tuple[str, ...] = (), config: Path = SMOKE,
                timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``fedlora run CONFIG --out OUT --set K=V ... ARGS`` (returncode not checked)."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return subprocess.run(
        [sys.executable, "-m", "fedlora.app.cli", "run", str(config), "--out", str(out), *sets, *args],
        check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


# A fedlora line (tests/test_quiet.py): the data summary (fedlora.data), one progress line per round
# (fedlora.app.driver.progress_line), the final scores and where the files are (fedlora.app.runner.final_lines).
FEDLORA_LINES = (
    r"load_source: \S+, \d+ examples, \d+ classes",
    r"build_federated_data: \d+ clients \(\w+\), pool \d+, global test \d+, [\d.]+ s",
    (r"round +\d+/\d+  global( \(clients\))? (\d\.\d{3}|  -  )  personalised (\d\.\d{3} \(mean \d\.\d{3}, worst "
     r"\d\.\d{3}\)|  -  )  received .* clients \d+ failures \d+  [\d.]+s"),
    (r"final global( \(clients\))? accuracy \d\.\d{4}, personalised (\d\.\d{4} \(mean \d\.\d{4}, worst \d\.\d{4}\)|n/a), "
     r"[\d.]+ MB in \d+s"),
    r"results: \S+/ \(results\.json, accuracy_vs_round\.png, run\.log\)",
)
NOISE_SEEN_IN_A_RUN = "`is_gradient_checkpointing` is deprecated"  # peft's FutureWarning (fedlora.models silences it at the source)


def foreign_lines(stdout: str) -> list[str]:
    """The lines of ``stdout`` that are not fedlora lines (blank lines are not lines)."""
    return [line for line in stdout.splitlines()
            if line.strip() and not any(re.fullmatch(pattern, line) for pattern in FEDLORA_LINES)]


def assert_only_fedlora_lines(stdout: str, rounds: int) -> None:
    assert not foreign_lines(stdout), "not fedlora's:\n" + "\n".join(foreign_lines(stdout)[:20])
    assert len(re.findall(r"^round +\d+/\d+ ", stdout, flags=re.MULTILINE)) == rounds  # progress: a line per round
    assert re.search(r"^final global( \(clients\))? accuracy ", stdout, flags=re.MULTILINE)
    assert re.search(r"^results: ", stdout, flags=re.MULTILINE)
