"""Nothing is ever lost: an output folder that holds earlier output is refused, continued with
``--resume``, or moved aside with ``--overwrite`` (never deleted), for ``run`` (CLI and Python API)
and ``compare`` / ``tune`` (:mod:`fedlora.app.folders`); the bad-input table
(tests/test_bad_input.py) has the one-line refusals of every command."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from fedlora.app.folders import Claim, check_writable, claim, move_aside
from fedlora.config import ConfigError, load_config

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
ONE_ROUND = ["train.rounds=1", "train.max_steps=1"]


def tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def fake_run(folder: Path) -> Path:
    (folder / "adapters").mkdir(parents=True)
    (folder / "results.json").write_text('{"rounds": []}')
    (folder / "adapters" / "a.safetensors").write_bytes(b"\x00\x01")
    return folder


# ------------------------------------------------------------------------------ the rules
def test_a_new_or_empty_folder_is_taken_as_it_is(tmp_path: Path) -> None:
    # Prepare
    (tmp_path / "empty").mkdir()
    # Execute
    claims = [claim(tmp_path / "new" / "run", what="run"), claim(tmp_path / "empty", what="run", overwrite=True)]
    # Assert: nothing to move, nothing created by the check
    assert [c.earlier for c in claims] == [False, False]
    assert [c.take() for c in claims] == [None, None]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_an_earlier_run_is_refused_unless_resumed(tmp_path: Path) -> None:
    # Prepare
    run = fake_run(tmp_path / "run")
    before = tree(run)
    # Execute / Assert
    with pytest.raises(ConfigError, match="holds an earlier run; continue it with --resume DIR, move it aside"):
        claim(run, what="run", resume_hint="--resume DIR")
    assert claim(run, what="run", resume=True).take() is None
    with pytest.raises(ConfigError, match="contradict"):
        claim(run, what="run", resume=True, overwrite=True)
    assert tree(run) == before


def test_overwrite_moves_the_earlier_folder_aside_byte_for_byte_and_never_twice_to_one_name(tmp_path: Path) -> None:
    # Prepare: two earlier runs in turn at one path (the second move lands within the same second)
    run = fake_run(tmp_path / "run")
    before = tree(run)
    # Execute
    first = claim(run, what="run", overwrite=True)
    moved = first.take()
    fake_run(run)
    again = claim(run, what="run", overwrite=True).take()
    # Assert: both kept, under distinct names beside the folder; the folder itself is free
    assert moved is not None and again is not None and moved != again
    assert moved.parent == again.parent == tmp_path and moved.name.startswith("run.old-")
    assert tree(moved) == before and tree(again) == before
    assert not run.exists() and first.take() is None  # taken once


def test_overwrite_never_moves_a_folder_fedlora_did_not_write(tmp_path: Path) -> None:
    # Prepare: someone's own folder given as --out
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("x")
    # Execute / Assert
    for options in ({}, {"overwrite": True}, {"resume": True}):
        with pytest.raises(ConfigError, match="not a fedlora output"):
            claim(home, what="run", **options)
    assert (home / "thesis.tex").read_text() == "x"


@pytest.mark.parametrize("make", [lambda d: (d / "f").write_text("x") and d / "f", lambda d: (d / "f").write_text("x")
                                  and d / "f" / "deeper" / "run"], ids=["a-file", "under-a-file"])
def test_a_path_that_cannot_be_a_folder_is_refused_and_nothing_is_created(tmp_path: Path, make) -> None:
    # Prepare
    path = make(tmp_path)
    # Execute / Assert
    with pytest.raises(ConfigError, match="is a file|which is a file"):
        check_writable(path, "--out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_the_probe_leaves_alone_what_a_parallel_run_writes_beside_it(tmp_path: Path, monkeypatch) -> None:
    """Two seeds of a comparison probe tensorboard/<method>/seed0 and .../seed1 at once: the one
    that created tensorboard/<method> must not fail when removing it finds the other's folder."""
    # Prepare
    from fedlora.app import folders

    real = tempfile.TemporaryFile

    def probe_while_a_neighbour_writes(*args, **kwargs):
        (tmp_path / "tensorboard" / "flexlora" / "seed0").mkdir()  # the parallel run's folder
        return real(*args, **kwargs)

    monkeypatch.setattr(folders.tempfile, "TemporaryFile", probe_while_a_neighbour_writes)
    # Execute
    check_writable(tmp_path / "tensorboard" / "flexlora" / "seed1", "output.tensorboard_dir")
    # Assert: the probe removed its own folder and kept the neighbour's
    assert sorted(p.name for p in (tmp_path / "tensorboard" / "flexlora").iterdir()) == ["seed0"]


def test_move_aside_of_a_missing_folder_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot move .* aside"):
        move_aside(tmp_path / "gone", "run", "--overwrite")
    assert isinstance(claim(tmp_path / "x", what="run"), Claim)


# ------------------------------------------------------------------------------ real runs
@pytest.fixture(scope="module")
def one_round_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run folder (one in-process round of the smoke config); tests copy it."""
    from fedlora.app.runner import run_inprocess

    folder = tmp_path_factory.mktemp("earlier") / "run"
    run_inprocess(load_config(SMOKE, ONE_ROUND), folder)
    return folder


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "fedlora.app.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)


def test_cli_run_refuses_an_earlier_run_and_overwrite_moves_it_aside(one_round_run: Path, tmp_path: Path) -> None:
    # Prepare: an earlier run at the output folder
    run = tmp_path / "run"
    shutil.copytree(one_round_run, run)
    before = tree(run)
    sets = [arg for o in ONE_ROUND for arg in ("--set", o)]
    # Execute 1: a plain rerun
    refused = cli("run", str(SMOKE), "--engine", "inprocess", "--out", str(run), *sets)
    # Assert 1: one line, exit 2, the earlier run untouched
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1 and "holds an earlier run" in lines[0], refused.stderr[-2000:]
    assert f"--resume {run}" in lines[0] and "--overwrite" in lines[0]
    assert tree(run) == before
    # Execute 2: --overwrite
    overwritten = cli("run", str(SMOKE), "--engine", "inprocess", "--out", str(run), "--overwrite", *sets)
    # Assert 2: the earlier run moved aside byte for byte (and said where), a new run in its place
    assert overwritten.returncode == 0, overwritten.stderr[-2000:]
    (moved,) = tmp_path.glob("run.old-*")
    assert tree(moved) == before
    assert f"moved aside to {moved}" in overwritten.stdout
    assert json.loads((run / "results.json").read_text())["rounds"][0]["round"] == 1
    assert (run / "results.json").read_bytes() != before["results.json"]  # a new run (its own timings)


def test_python_api_refuses_an_earlier_run_and_a_resume_elsewhere(one_round_run: Path, tmp_path: Path) -> None:
    import fedlora

    # Prepare
    run = tmp_path / "run"
    shutil.copytree(one_round_run, run)
    before = tree(run)
    # Execute / Assert
    with pytest.raises(ConfigError, match="holds an earlier run"):
        fedlora.run(str(SMOKE), overrides=ONE_ROUND, out_dir=run, engine="inprocess")
    with pytest.raises(ConfigError, match="drop --out"):
        fedlora.run(str(SMOKE), overrides=ONE_ROUND, out_dir=tmp_path / "other", resume=run, engine="inprocess")
    with pytest.raises(ConfigError, match="contradict"):
        fedlora.run(str(SMOKE), overrides=ONE_ROUND, resume=run, overwrite=True, engine="inprocess")
    assert tree(run) == before and sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_compare_refuses_an_earlier_comparison_and_resume_keeps_every_run(one_round_run: Path, tmp_path: Path) -> None:
    from fedlora.app.compare import compare

    # Prepare: a comparison interrupted after round 1 of 2 (seed 0, resumable) and a run whose
    # checkpoint is corrupt (seed 1, cannot be resumed)
    out = tmp_path / "cmp"
    shutil.copytree(one_round_run, out / "fedit" / "seed0")
    shutil.copytree(one_round_run, out / "fedit" / "seed1")
    corrupt = out / "fedit" / "seed1" / "checkpoint" / "server.json"
    corrupt.write_text(corrupt.read_text()[:100])
    earlier = {seed: tree(out / "fedit" / f"seed{seed}") for seed in (0, 1)}
    first_round = json.loads((out / "fedit" / "seed0" / "results.json").read_text())["rounds"][0]
    options = {"seeds": (0, 1), "out_dir": out, "overrides": ["train.rounds=2", "train.max_steps=1"],
               "engine": "inprocess", "plots": False}
    # Execute 1 / Assert 1: a plain rerun is refused, nothing changes
    with pytest.raises(ConfigError, match="holds an earlier comparison"):
        compare(str(SMOKE), ["fedit"], **options)
    assert {seed: tree(out / "fedit" / f"seed{seed}") for seed in (0, 1)} == earlier
    # Execute 2: --resume
    table = compare(str(SMOKE), ["fedit"], resume=True, **options)
    # Assert 2: seed 0 continued from its checkpoint (round 1 kept as it was); seed 1 moved aside
    # byte for byte and run again; the summary counts the two seeds, not the run moved aside
    seed0 = json.loads((out / "fedit" / "seed0" / "results.json").read_text())["rounds"]
    assert [r["round"] for r in seed0] == [1, 2] and seed0[0] == first_round
    (moved,) = (out / "fedit").glob("seed1.old-*")
    assert tree(moved) == earlier[1]
    assert [r["round"] for r in json.loads((out / "fedit" / "seed1" / "results.json").read_text())["rounds"]] == [1, 2]
    assert table["fedit"]["seeds"] == 2


@pytest.mark.slow
def test_deploy_local_refuses_earlier_output_and_resume_continues_on_a_new_federation(tmp_path: Path) -> None:
    from fedlora.app.deploy.local import deploy_local

    # Prepare: a one-round deployment (2 SuperNodes, TLS + auth)
    out = tmp_path / "fed"
    silos = ["data.num_clients=2", "clients.ranks=[4, 4]", "train.max_steps=1", "output.tensorboard=false"]
    first = deploy_local(str(SMOKE), out_dir=out, overrides=[*silos, "train.rounds=1"], timeout=900)
    before = tree(out)
    # Execute 1 / Assert 1: a plain second deployment into it is refused before any process starts
    with pytest.raises(ConfigError, match="holds an earlier deployment"):
        deploy_local(str(SMOKE), out_dir=out, overrides=[*silos, "train.rounds=2"], timeout=900)
    assert tree(out) == before
    # Execute 2: --resume with one more round
    resumed = deploy_local(str(SMOKE), out_dir=out, overrides=[*silos, "train.rounds=2"], timeout=900, resume=True)
    # Assert 2: round 1 kept as it was, round 2 added by a new federation; the first federation's
    # certificates, logs and records moved, byte for byte, into deployment.old-<time>/
    untimed = [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in first["rounds"]]
    assert [r["round"] for r in resumed["rounds"]] == [1, 2]
    assert [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in resumed["rounds"][:1]] == untimed
    assert resumed["deployment"]["run_id"] != first["deployment"]["run_id"]
    (old,) = out.glob("deployment.old-*")
    kept = {name: data for name, data in before.items() if name.split("/")[0] in ("certs", "logs", "deployment.json")
            or name.startswith("run_config")}
    assert kept and all(tree(old)[name] == data for name, data in kept.items())
