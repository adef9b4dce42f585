"""Secure aggregation (SecAgg+, docs/secure-aggregation.md) over a real federation: a SuperLink with
TLS and SuperNode authentication, three SuperNodes, gRPC on 127.0.0.1 (Flower 1.39 processes).

In a deployment every message of a SuperNode runs in a ClientApp process of its own (forked by
fedlora's warm SuperExec), so the SecAgg+ mod's state (its keys, seeds and shares, kept in
``context.state``) reaches the next stage only through the SuperNode, which keeps each run's
context between messages: the four stages of a round are four processes per client here, one
process in the in-process tests (tests/test_secure_aggregation.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_helpers import REPO

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

# configs/smoke.toml (tiny BERT, 3 clients of ranks 2 / 4 / 8, FedIT) with secure aggregation:
# 2 rounds of 2 local steps, no client evaluation (the global evaluation still runs every round)
SECURE = ["secure_aggregation.enabled=true", "train.rounds=2", "train.max_steps=2", "federation.fraction_evaluate=0"]
# The SecAgg+ stages the server sends over the grid itself (Flower's Stage values; flwr is not imported
# here: this process only drives the deployment's processes)
SERVER_STAGES = ("setup", "share_keys", "unmask")


@pytest.mark.slow
def test_a_tls_deployment_of_three_supernodes_aggregates_securely(no_leftovers: Path) -> None:
    from fedlora.app.deploy.local import deploy_local

    # Execute: `fedlora deploy local configs/smoke.toml --set secure_aggregation.enabled=true ...`
    # (TLS and SuperNode authentication: the default)
    results = deploy_local(REPO / "configs/smoke.toml", num_nodes=3, out_dir=no_leftovers / "run", overrides=SECURE,
                           timeout=900)

    # Assert: a run over gRPC with TLS and authenticated SuperNodes that Flower reports completed
    deployment = results["deployment"]
    assert deployment["tls"] and deployment["supernode_auth"] and deployment["fleet_grpc_tls_logged"]
    assert deployment["nodes"] == 3 and deployment["flower_run"]["status"] == "finished:completed"
    # Assert: both rounds masked, summed and unmasked the three silos' updates; nobody dropped out
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    for record in results["rounds"]:
        report = record["extra"]["secure_aggregation"]
        assert (record["clients"], record["failures"]) == (3, 0), record
        assert (report["masked"], report["dead_recovered"], report.get("failed_stage")) == (3, 0, None), report
        assert report["after_setup"] == report["after_share_keys"] == report["after_unmask"] == 3, report
        assert 0 < report["error_bound"] < 1e-6, report
        # the masked int64 vectors went up, and the stages the server ran itself went both ways over
        # gRPC, counted in the round's wire bytes
        stages = report["wire_bytes"]
        assert set(stages) == set(SERVER_STAGES) and all(b["down"] > 0 and b["up"] > 0 for b in stages.values())
        assert record["bytes_up"] > 0 and record["bytes_up"] % (3 * 8) == 0  # 3 int64 vectors of one length
        assert record["wire_bytes_down"] > sum(b["down"] for b in stages.values()) + record["bytes_down"]
        assert record["wire_bytes_up"] > sum(b["up"] for b in stages.values()) + record["bytes_up"]
    # Flower's own count of the run's traffic (the SuperLink's) covers every byte fedlora counted
    assert deployment["flower_run"]["network-traffic"]["total-bytes"] >= results["final"]["wire_bytes_total"]
    assert results["final"]["global_accuracy"] > 0
    per_round = [round(sum(r["extra"]["secure_aggregation"]["seconds"].values()), 2) for r in results["rounds"]]
    print(f"secure deployment: round seconds {[round(r['seconds'], 1) for r in results['rounds']]}, "
          f"of which setup + share keys + unmask {per_round}; total {deployment['timings']['total_seconds']}s")
