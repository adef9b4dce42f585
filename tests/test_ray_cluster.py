"""Flower's simulation engine on an existing Ray cluster (federation.ray_address / --ray-address).

A two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, loopback only, one CPU
per node) runs the smoke experiment: clients execute on both nodes, and the results equal those
of a local Ray run with the same seeds. The same cluster runs it with secure aggregation (SecAgg+,
docs/secure-aggregation.md), whose results are those of the in-process secure run.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from fedlora.app import ray_start

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/smoke.toml"
START_TIMEOUT = 300.0  # federation.ray_start_timeout's default
METRICS = ("global_accuracy", "personalized_accuracy", "received_accuracy", "train_loss", "bytes_up", "bytes_down",
           "clients", "failures")


@pytest.fixture(scope="module")
def two_node_cluster():
    import ray
    from ray.cluster_utils import Cluster

    # Its own Ray temp folder, and no "current cluster" pointer: a Ray started without an address
    # (Flower's simulation under `flwr run`, in another test at the same time) connects to the cluster
    # named in /tmp/ray/ray_current_cluster, which Cluster writes "for convenience in unit testing";
    # this test passes the address explicitly
    temp_dir = tempfile.mkdtemp(prefix="fl-raycl-")  # short: Ray's socket paths must stay < 108 chars
    # Cluster writes that pointer into Ray's default temp folder whatever temp_dir says, and fails
    # when no Ray has run on this machine yet (the folder does not exist: CI, this module first)
    Path(ray._common.utils.get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    # on a loaded machine the nodes get the time fedlora's own Ray start gets (fedlora.app.ray_start:
    # Ray's 30 s limits for a raylet and its agent raised, the wait for the raylet patient)
    with ray_start.ray_waits(START_TIMEOUT), ray_start.patient_node_start(time.monotonic() + START_TIMEOUT):
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False,
                                                                "temp_dir": temp_dir})
        ray._common.utils.reset_ray_address()
        cluster.add_node(num_cpus=1, temp_dir=temp_dir)
        cluster.wait_for_nodes(timeout=START_TIMEOUT)
    yield cluster
    cluster.shutdown()
    shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
def test_smoke_runs_on_both_nodes_of_a_ray_cluster_and_matches_a_local_run(two_node_cluster, tmp_path: Path) -> None:
    from fedlora.app.runner import run

    # Prepare: the cluster's node ids
    node_ids = {node.node_id for node in two_node_cluster.list_all_nodes()}
    assert len(node_ids) == 2
    # Execute: the same experiment on the cluster and on a local Ray
    on_cluster = run(SMOKE, overrides=[f'federation.ray_address="{two_node_cluster.address}"'], out_dir=tmp_path / "c")
    local = run(SMOKE, out_dir=tmp_path / "l")
    # Assert: every client message ran on one of the cluster's nodes, and both nodes ran some
    used = {info["ray-node"] for r in on_cluster["rounds"] for info in r["per_client_train"].values()}
    assert used == node_ids
    # Assert: the results are the local run's (same seeds), metric by metric, to 1e-6
    for a, b in zip(on_cluster["rounds"], local["rounds"], strict=True):
        for key in METRICS:
            assert (a[key] is None and b[key] is None) or a[key] == pytest.approx(b[key], abs=1e-6), key
    saved = json.loads((tmp_path / "c" / "results.json").read_text())
    assert saved["config"]["federation"]["ray_address"] == two_node_cluster.address


@pytest.mark.slow
def test_secure_aggregation_on_the_ray_cluster_matches_the_in_process_secure_run(two_node_cluster,
                                                                                 tmp_path: Path) -> None:
    """SecAgg+ on Flower's simulation engine: every stage of a round is a message the engine hands
    to a Ray actor on either node, with the client's context (the mod's keys and shares in
    ``context.state``) carried by the engine from one stage to the next. The module's cluster,
    started once for both tests of this module."""
    import numpy as np
    from safetensors.numpy import load_file

    from fedlora.app.runner import run

    # Execute: configs/smoke.toml with secure aggregation on the cluster, and in process
    secure = ["secure_aggregation.enabled=true"]
    on_ray = run(SMOKE, overrides=[*secure, f'federation.ray_address="{two_node_cluster.address}"'],
                 out_dir=tmp_path / "ray")
    in_process = run(SMOKE, overrides=secure, out_dir=tmp_path / "inprocess", engine="inprocess")

    # Assert: both rounds masked, summed and unmasked the three clients' updates on Ray actors
    node_ids = {node.node_id for node in two_node_cluster.list_all_nodes()}
    bounds = []
    for record in on_ray["rounds"]:
        report = record["extra"]["secure_aggregation"]
        assert (record["clients"], record["failures"]) == (3, 0), record
        assert (report["masked"], report["dead_recovered"], report.get("failed_stage")) == (3, 0, None), report
        assert 0 < report["error_bound"] < 1e-6, report
        assert {info["ray-node"] for info in record["per_client_train"].values()} <= node_ids
        bounds.append(report["error_bound"])
    # Assert: the in-process secure run's results (same seeds, same training): the same metrics, and
    # the same final global adapter within twice the rounds' error bounds (each run's secure mean
    # is within its bound of the plain mean; the masks' stochastic rounding differs from run to
    # run: 3.9e-8 to 4.7e-8 apart in 7 pairs of runs, against 1.4e-7) plus float32's rounding of the entries
    for a, b in zip(on_ray["rounds"], in_process["rounds"], strict=True):
        for key in METRICS:
            assert (a[key] is None and b[key] is None) or a[key] == pytest.approx(b[key], abs=1e-6), key
    ray_adapter = load_file(tmp_path / "ray" / "adapters" / "global" / "adapter_model.safetensors")
    own_adapter = load_file(tmp_path / "inprocess" / "adapters" / "global" / "adapter_model.safetensors")
    assert ray_adapter.keys() == own_adapter.keys()
    largest = max(float(np.max(np.abs(ray_adapter[k].astype(np.float64) - own_adapter[k]))) for k in ray_adapter)
    entry = max(float(np.max(np.abs(value))) for value in own_adapter.values())
    print(f"secure on Ray vs in process: global adapters {largest:.3g} apart, bounds {bounds}; round seconds "
          f"{[round(r['seconds'], 2) for r in on_ray['rounds']]} on Ray, "
          f"{[round(r['seconds'], 2) for r in in_process['rounds']]} in process")
    assert largest <= 2 * sum(bounds) + 2**-23 * entry, (largest, bounds)
