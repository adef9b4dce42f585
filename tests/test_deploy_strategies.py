"""Every registered strategy over one real federation (TLS + SuperNode authentication, gRPC on
127.0.0.1): a module of its own, so that pytest-xdist runs it beside the other deployment tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from deploy_helpers import REPO

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

# Every registered strategy over one real federation (TLS + SuperNode auth): the capability
# matrix's "deployment" column is this test's (fedlora.app.capabilities.deployment_tested: the built-in methods).
# One round each (its messages: the profile query, a training round there and back, the global
# evaluation); two for the methods whose second round sends something the first does not
# (FedTreeLoRA's tree phase after its warm-up, FLoRA's merged stacks, FedHera's allocation from
# the budgets its first round measured).
EVERY_STRATEGY_BASE = ["data.num_clients=2", "clients.ranks=[2, 4]", "train.rounds=1", "train.max_steps=2",
                       "federation.fraction_evaluate=0", "federation.min_clients=1"]
PER_STRATEGY = {"fedtreelora": ["train.rounds=2", "strategy.warmup_rounds=1"], "flora": ["train.rounds=2"],
                "fedhera": ["train.rounds=2"]}


@pytest.mark.slow
def test_every_strategy_runs_over_tls_grpc(no_leftovers: Path) -> None:
    from fedlora.app.capabilities import deployment_tested
    from fedlora.app.deploy.local import deploy_runs
    from fedlora.app.runner import resolve
    from fedlora.strategies.registry import strategy_names

    # Prepare: one experiment per registered strategy, all on the same two silos
    configs = {name: resolve(REPO / "configs/smoke.toml", [*EVERY_STRATEGY_BASE, f"strategy.name={name}",
                                                          *PER_STRATEGY.get(name, [])])
               for name in strategy_names()}
    # Execute: one SuperLink, two authenticated SuperNodes, three runs at a time
    results = deploy_runs(configs, num_nodes=2, out_dir=no_leftovers / "fed", timeout=1500, side_by_side=3)
    # Assert: every strategy completed its rounds over gRPC with TLS, no failure, a results contract
    assert set(results) == set(strategy_names())
    for name, result in results.items():
        assert result["deployment"]["tls"] and result["deployment"]["supernode_auth"], name
        assert result["deployment"]["flower_run"]["status"] == "finished:completed", name
        assert [r["round"] for r in result["rounds"]] == list(range(1, configs[name].train.rounds + 1)), name
        assert all(r["failures"] == 0 and r["clients"] >= 1 for r in result["rounds"]), name
        assert result["final"]["wire_bytes_total"] >= result["final"]["bytes_total"], name
        assert sum(r["bytes_up"] for r in result["rounds"]) > 0 or name == "local", name
    # Assert: the capability matrix's "deployment" column claims exactly the strategies checked here
    assert set(deployment_tested()) <= set(results)
