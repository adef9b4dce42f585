"""Quiet by default: a run prints fedlora's own lines only; the run's log file keeps the rest.

A *fedlora line* is one of the formats in ``cli_helpers.FEDLORA_LINES``: the data summary
(fedlora.data), one progress line per round (fedlora.app.driver.progress_line), the final scores
and where the files are (fedlora.app.runner.final_lines). Anything else on stdout (a library
warning, a load report, plugin chatter, Flower's banners, a Ray tip) fails the test, and stderr
must stay empty. The Ray engine's CLI run is checked the same way in tests/test_run.py (one Ray
run serves both tests); this module runs the CLI on the in-process engine and the Python API.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cli_helpers import NOISE_SEEN_IN_A_RUN, assert_only_fedlora_lines

from fedlora.app.quiet import QuietFilter, is_noise

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"

def record(name: str, level: int, message: str, pathname: str = "/elsewhere/lib.py") -> logging.LogRecord:
    return logging.LogRecord(name, level, pathname, 1, message, None, None)


# --------------------------------------------------------------------------- the filter
def test_the_quiet_filter_drops_listed_noise_only_and_keeps_fedlora_lines() -> None:
    quiet = QuietFilter()
    ours = str(ROOT / "strategies" / "base.py")
    # fedlora's logger at INFO, fedlora's code through Flower's logger at WARNING: shown
    assert quiet.filter(record("fedlora", logging.INFO, "round   1/2  global 0.500"))
    assert quiet.filter(record("flwr", logging.WARNING, "query: refusing client 3", pathname=ours))
    # ... its INFO details through Flower's logger, and Flower's own lines at any level: log file only
    assert not quiet.filter(record("flwr", logging.INFO, "configure_train: round 1", pathname=ours))
    assert not quiet.filter(record("flwr", logging.WARNING, "DEPRECATED FEATURE: run_simulation"))
    # listed library noise: dropped; the same logger's other warnings, and unknown ones: shown
    assert not quiet.filter(record("py.warnings", logging.WARNING, f"x.py:1: FutureWarning: {NOISE_SEEN_IN_A_RUN}"))
    assert quiet.filter(record("py.warnings", logging.WARNING, "x.py:1: UserWarning: something new"))
    assert not quiet.filter(record("transformers.modeling_utils", logging.WARNING, "BertModel LOAD REPORT from: x"))
    assert quiet.filter(record("transformers.modeling_utils", logging.WARNING, "a new warning"))
    # libraries' INFO chatter (e.g. alembic's plugin setup): not on the quiet console
    assert not quiet.filter(record("alembic.runtime.plugins", logging.INFO, "setup plugin alembic.autogenerate.schemas"))
    # fedlora's own code is never noise, whatever logger it uses
    assert not is_noise(record("flwr", logging.WARNING, "x", pathname=ours))


# --------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_cli_in_process_prints_only_fedlora_lines_and_its_log_keeps_the_rest(tmp_path: Path) -> None:
    # Execute
    proc = subprocess.run(
        [sys.executable, "-m", "fedlora.app.cli", "run", str(SMOKE), "--engine", "inprocess", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, check=False,
    )
    # Assert: only fedlora's lines, nothing on stderr; Flower's hidden lines are in the run's log
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert_only_fedlora_lines(proc.stdout, rounds=2)
    assert proc.stderr == ""
    log = (tmp_path / "run.log").read_text()
    assert "configure_train: round 2" in log and "configure_train" not in proc.stdout and "round   2/2" in log


SCRIPT = """
import fedlora
fedlora.run({smoke!r}, out_dir={quiet!r}, engine="inprocess")
print("==== verbose ====", flush=True)
fedlora.run({smoke!r}, overrides=["train.rounds=1"], out_dir={loud!r}, engine="inprocess", verbose=True)
"""


@pytest.mark.slow
def test_python_api_shows_progress_without_configuration_and_verbose_shows_the_rest(tmp_path: Path) -> None:
    # Execute: a plain script, no logging configured
    script = textwrap.dedent(SCRIPT).format(smoke=str(SMOKE), quiet=str(tmp_path / "q"), loud=str(tmp_path / "v"))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          check=False)
    # Assert: quiet: a line per round and the final lines, nothing else; verbose: the strategy's
    # and Flower's INFO lines too; the quiet run's log keeps Flower's lines
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    quiet, verbose = proc.stdout.split("==== verbose ====\n")
    assert_only_fedlora_lines(quiet, rounds=2)
    assert "configure_train: round 1" in verbose and "round   1/1" in verbose
    assert "configure_train: round 2" in (tmp_path / "q" / "run.log").read_text() and "configure_train" not in quiet
    assert proc.stderr == ""


WORKER_SCRIPT = """
import logging
from fedlora.app.quiet import output
with output(console=False):  # as a worker of `fedlora compare --workers` runs, before its run's log opens
    logging.getLogger("transformers.modeling_utils").warning("BertForSequenceClassification LOAD REPORT from: x")
    logging.getLogger("fedlora").info("compare: a line for the run's log only")
    logging.getLogger("transformers").warning("a warning nobody listed as noise")
"""


def test_a_worker_without_console_drops_listed_noise_and_still_shows_other_warnings() -> None:
    # Execute: a fresh interpreter, as a spawned worker is (no root handlers)
    proc = subprocess.run([sys.executable, "-c", WORKER_SCRIPT], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, check=False)
    # Assert: the load report (listed noise) and fedlora's INFO line are not printed; the unlisted warning is
    assert proc.returncode == 0, proc.stderr[-2000:]
    shown = proc.stdout + proc.stderr
    assert "LOAD REPORT" not in shown and "compare:" not in shown
    assert "a warning nobody listed as noise" in shown
