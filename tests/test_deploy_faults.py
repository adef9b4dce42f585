"""Faults in a real deployment (TLS + SuperNode authentication on 127.0.0.1): a killed SuperNode
and a killed SuperLink (soak), a hostile SuperNode. A module of its own, so that pytest-xdist runs it
beside the other deployment tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_helpers import (
    REPO,
    clients_of,
    federation,
    kill_tree,
    restart_supernode,
    rounds_written,
    wait_for,
)

from fedlora.app.deploy.federation import LocalDeployment

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

# ---------------------------------------------------------------- faults in a real deployment
SOAK = ["data.num_clients=3", "clients.ranks=[4, 4, 4]", "train.rounds=12", "train.max_steps=1",
        "federation.evaluate_every=5", "federation.fraction_evaluate=0", "federation.min_clients=2",
        "federation.round_timeout=45", "strategy.name=fedit"]


@pytest.mark.slow
def test_soak_a_killed_supernode_and_a_killed_superlink(no_leftovers: Path) -> None:
    import json

    from fedlora.app.deploy.local import app_dir, node_configs, write_run_config
    from fedlora.app.runner import resolve

    # Prepare: 3 silos, 12 rounds (a restarted SuperNode waits up to a minute for its old heartbeat to
    # lapse: rounds go on with 2 silos meanwhile, so the run needs rounds to spare after it is back);
    # the run's results live in `out`, outside any federation's folder
    out = no_leftovers / "results"
    config = resolve(REPO / "configs/smoke.toml", SOAK)
    config.output.dir = str(out)
    first, keys = federation(no_leftovers / "fed1", config, 3)
    try:
        run_id = first.submit(app_dir(), write_run_config(config, no_leftovers / "run.toml"))
        # Execute 1: once round 2 is written, kill -9 SuperNode 2 (and its ClientApps), then restart it
        wait_for(lambda: len(rounds_written(out)) >= 2, 600, "round 2")
        kill_tree(first.supernodes[2])
        killed_during = len(rounds_written(out)) + 1
        restart_supernode(first, 2, node_configs(config, 3)[2], keys[2])  # retried until accepted again
        # Execute 2: once the restarted silo has trained in a round after the kill (and round 4 is
        # written), kill -9 the SuperLink with the SuperExec and ServerApp it runs
        def silo_back() -> bool:
            return len(rounds_written(out)) >= 4 and 3 in clients_of(out)[killed_during:]

        wait_for(silo_back, 900, "the silo back, round 4")
        assert len(rounds_written(out)) < 12, "the run ended before the restarted silo was back: no round left"

        assert first.superlink is not None
        kill_tree(first.superlink)
        before = json.loads((out / "results.json").read_text())["rounds"]
    finally:
        first.stop()
    checkpointed = json.loads((out / "checkpoint" / "server.json").read_text())["round"]
    # Execute 3: a new federation resumes the run from its checkpoint
    second, _ = federation(no_leftovers / "fed2", config, 3)
    try:
        resumed_id = second.submit(app_dir(), write_run_config(config, no_leftovers / "resume.toml", resume=True))
        run = second.wait_run(resumed_id, timeout=1200)
    finally:
        second.stop()
    # Assert: the run completed every round once; the round the SuperNode died in counted the
    # missing client; the rounds before the SuperLink died are kept as they were
    results = json.loads((out / "results.json").read_text())
    rounds = results["rounds"]
    assert run["status"] == "finished:completed" and run_id != resumed_id
    assert [r["round"] for r in rounds] == list(range(1, 13))
    assert 4 <= checkpointed < 12
    assert any(r["failures"] >= 1 for r in rounds[killed_during - 1 : killed_during + 1])  # the round it died in
    assert any(r["clients"] == 3 for r in rounds[killed_during:checkpointed])  # the restarted silo came back
    kept = [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in before[:checkpointed]]
    assert kept == [{k: v for k, v in r.items() if not k.endswith("seconds")} for r in rounds[:checkpointed]]
    assert all(r["clients"] >= 2 for r in rounds)


# ---------------------------------------------------------------- a hostile SuperNode
@pytest.mark.slow
def test_a_hostile_supernode_is_refused_and_the_run_completes_over_tls(no_leftovers: Path) -> None:
    import json
    import shutil

    from fedlora.app.deploy.local import node_configs, write_run_config
    from fedlora.app.runner import resolve

    # Prepare: a copy of the app whose ClientApp is the test-only tests/hostile_clientapp.py (fedlora's
    # own ClientApp except on a node with `hostile = true`); SuperNode 2 of 3 is hostile. Its replies:
    # text arrays (round 1), a 1e30 update (round 2), an accuracy of 7 and a spoofed partition.
    app = no_leftovers / "app"
    shutil.copytree(REPO / "configs", app / "configs")  # the app's configs; the code is the installed fedlora
    shutil.copy(REPO / "tests" / "hostile_clientapp.py", app / "hostile_clientapp.py")
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert 'clientapp = "fedlora.clients.app:app"' in pyproject
    assert 'fab-include = ["configs/**/*.toml"]' in pyproject
    pyproject = pyproject.replace('fab-include = ["configs/**/*.toml"]', 'fab-include = ["configs/**/*.toml", "*.py"]')
    (app / "pyproject.toml").write_text(pyproject.replace('clientapp = "fedlora.clients.app:app"',
                                                          'clientapp = "hostile_clientapp:app"'), encoding="utf-8")
    out = no_leftovers / "results"
    config = resolve(REPO / "configs/smoke.toml", ["train.rounds=2", "train.max_steps=2", "output.save_adapters=false"])
    config.output.dir = str(out)
    nodes = node_configs(config, 3)
    nodes[2]["hostile"] = True
    deployment = LocalDeployment(no_leftovers / "fed", 3)
    try:
        deployment.start_superlink()
        keys = list(deployment.require_certs().node_keys)
        deployment.register(keys)
        deployment.start_supernodes(nodes, keys)
        # Execute
        run = deployment.wait_run(deployment.submit(app, write_run_config(config, no_leftovers / "run.toml")),
                                  timeout=1200)
        over_tls = deployment.fleet_is_grpc_over_tls()
    finally:
        deployment.stop()
    # Assert: completed over TLS; every round aggregated the two honest silos, and refused the hostile
    # one's training and evaluation replies (counted, with its partition and node id)
    assert run["status"] == "finished:completed" and over_tls
    rounds = json.loads((out / "results.json").read_text())["rounds"]
    assert [r["round"] for r in rounds] == [1, 2]
    for record in rounds:
        assert record["clients"] == 2 and record["rejected"] == 2, record["rejections"]
        assert all("client 2 (node " in line for line in record["rejections"]), record["rejections"]
        assert set(record["per_client"]) == {"0", "1"}
