"""Running the ``fedlora`` CLI as a user would: a fresh Python process, output captured."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"


def fedlora_run(out: Path, *overrides: str, args: tuple[str, ...] = (), config: Path = SMOKE,
                timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``fedlora run CONFIG --out OUT --set K=V ... ARGS`` (returncode not checked)."""
    sets = [arg for override in overrides for arg in ("--set", override)]
    return subprocess.run(
        [sys.executable, "-m", "fedlora.app.cli", "run", str(config), "--out", str(out), *sets, *args],
        check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )
