"""Cross-silo deployment: certificates, a real TLS + auth SuperLink with SuperNodes on 127.0.0.1.

The slow tests start real Flower 1.39 processes (``flower-superlink``, ``flower-supernode``,
``flwr``); after each one no process that belongs to the test's folder may be left.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fedlora.app.deploy.certs import write_certs, write_node_key
from fedlora.app.deploy.local import HOST, DeployError, LocalDeployment, deploy_local
from fedlora.config import ConfigError

REPO = Path(__file__).resolve().parents[1]
FEDLORA = str(Path(sys.executable).parent / "fedlora")
# Two silos with different ranks, a heterogeneous-rank method, 2 rounds of the smoke experiment.
TWO_SILOS = ["data.num_clients=2", "clients.ranks=[2, 8]", "strategy.name=hetlora", "train.rounds=2"]


# ---------------------------------------------------------------- helpers


def processes_of(folder: Path) -> list[psutil.Process]:
    """Processes whose FLWR_HOME or command line points into ``folder`` (every Flower process
    the deployment starts has one or the other, including per-message ClientApps)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            home = proc.environ().get("FLWR_HOME", "")
            if home.startswith(str(folder)) or str(folder) in " ".join(proc.cmdline()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def no_leftovers(tmp_path: Path):
    """Assert after the test that nothing it started is still running (and clean up if so)."""
    yield tmp_path
    left = processes_of(tmp_path)
    _, alive = psutil.wait_procs(left, timeout=5)  # a process exiting right now is not a leak
    names = [" ".join(p.cmdline()[:2]) for p in alive if p.is_running()]
    for proc in alive:
        proc.kill()
    assert names == [], f"processes left behind: {names}"


def tls_handshake(port: int, ca_file: Path) -> tuple[str, str, list[str]]:
    """TLS handshake on ``port`` verifying the certificate against ``ca_file``, offering HTTP/2
    (gRPC's transport): (TLS version, negotiated ALPN protocol, IP SANs of the peer)."""
    context = ssl.create_default_context(cafile=str(ca_file))
    context.set_alpn_protocols(["h2"])
    with socket.create_connection((HOST, port), timeout=10) as raw, context.wrap_socket(raw, server_hostname=HOST) as tls:
        cert = tls.getpeercert()
        ips = [value for kind, value in cert.get("subjectAltName", ()) if kind == "IP Address"]
        return tls.version() or "", tls.selected_alpn_protocol() or "", ips


# ---------------------------------------------------------------- certificates (fast)


@pytest.mark.parametrize(
    ("hosts", "dns", "ips"),
    [
        (["localhost", "127.0.0.1", "::1"], ["localhost"], ["127.0.0.1", "::1"]),
        (["superlink.example.org", "10.0.0.5"], ["superlink.example.org"], ["10.0.0.5", "127.0.0.1"]),
    ],
    ids=["default", "remote-host"],
)
def test_certs_are_a_valid_chain_with_ssh_node_keys(tmp_path: Path, hosts, dns, ips) -> None:
    # Prepare / Execute
    paths = write_certs(tmp_path / "certs", hosts=hosts, num_nodes=2)

    # Assert: the server certificate is signed by the CA and names every host (+ 127.0.0.1)
    ca = x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    server = x509.load_pem_x509_certificate(paths.server_cert.read_bytes())
    server.verify_directly_issued_by(ca)
    san = server.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == dns
    assert sorted(str(ip) for ip in san.get_values_for_type(x509.IPAddress)) == sorted(ips)
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    # SuperNode keys: EC P-384 in OpenSSH format, private keys readable by the owner only
    for key in paths.node_keys:
        private = serialization.load_ssh_private_key(key.read_bytes(), password=None)
        public = serialization.load_ssh_public_key(Path(f"{key}.pub").read_bytes())
        assert isinstance(private.curve, ec.SECP384R1) and isinstance(public, ec.EllipticCurvePublicKey)
        assert private.public_key().public_numbers() == public.public_numbers()
        assert key.stat().st_mode & 0o077 == 0
    assert paths.ca_key.stat().st_mode & 0o077 == 0 and paths.server_key.stat().st_mode & 0o077 == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["deploy", "local", "configs/smoke.toml", "--nodes", "5"], "--nodes 5 differs from data.num_clients=3"),
        (["deploy", "certs", "{tmp}", "--hosts", "bad host"], "neither an IP address nor a host name"),
        (["deploy", "local", "configs/smoke.toml", "--set", "data.num_clients=0"], "data.num_clients"),
    ],
    ids=["nodes-mismatch", "bad-host", "bad-config"],
)
def test_deploy_cli_user_errors_are_one_line_exit_2(tmp_path: Path, argv: list[str], message: str) -> None:
    # Execute
    argv = [arg.replace("{tmp}", str(tmp_path / "certs")) for arg in argv]
    done = subprocess.run([FEDLORA, *argv], cwd=REPO, check=False, capture_output=True, text=True, timeout=120)

    # Assert
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_earlier_certs_are_never_overwritten(tmp_path: Path) -> None:
    write_certs(tmp_path / "certs")
    with pytest.raises(ConfigError, match="already exists"):
        write_certs(tmp_path / "certs")


# ---------------------------------------------------------------- real deployments (slow)


@pytest.mark.slow
def test_tls_auth_deployment_two_silos_and_refused_supernodes(no_leftovers: Path) -> None:
    # Prepare: probes that run against the live SuperLink once the run has finished
    out = no_leftovers / "run"
    pyproject_before = (REPO / "pyproject.toml").read_bytes()
    probes: dict[str, object] = {}

    def on_ready(deployment: LocalDeployment) -> None:
        ca = deployment.certs.ca_cert
        probes["handshake"] = tls_handshake(deployment.ports.fleet, ca)
        other_ca = write_certs(no_leftovers / "other").ca_cert
        with pytest.raises(ssl.SSLCertVerificationError):
            tls_handshake(deployment.ports.fleet, other_ca)
        rogue = write_node_key(no_leftovers / "rogue" / "node_rogue")
        probes["unregistered"] = deployment.try_supernode("neg-unregistered-key", key=rogue, tls=True)
        probes["plaintext"] = deployment.try_supernode("neg-plaintext", key=None, tls=False)
        probes["keyless"] = deployment.try_supernode("neg-keyless", key=None, tls=True)
        with pytest.raises(DeployError) as refused:  # how the tool reports a refused silo
            deployment.start_supernodes([{"partition-id": 0, "num-partitions": 2}], [rogue])
        probes["reported"] = str(refused.value)

    # Execute
    results = deploy_local("configs/smoke.toml", num_nodes=2, out_dir=out, overrides=TWO_SILOS, timeout=900,
                           on_ready=on_ready)  # fmt: skip

    # Assert: the run wrote the same results contract as `fedlora run`, for both silos and ranks
    assert (out / "results.json").is_file() and (out / "accuracy_vs_round.png").is_file()
    assert results["strategy"] == "hetlora" and results["config"]["output"]["dir"] == str(out)
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    assert all(r["clients"] == 2 and r["failures"] == 0 and r["bytes_up"] > 0 for r in results["rounds"])
    assert results["final"]["global_accuracy"] is not None
    profiles = results["strategy_info"]["clients"]
    assert {pid: p["rank"] for pid, p in profiles.items()} == {"0": 2, "1": 8}  # from each node config
    for per_client in results["rounds"][-1]["per_client"].values():  # cold-start timings per message
        assert per_client["import-seconds"] > 0 and per_client["start-seconds"] >= per_client["setup-seconds"]
    assert results["deployment"]["flower_run"]["status"] == "finished:completed"
    # Fleet traffic is gRPC over TLS: the SuperLink's own log and a verified TLS handshake (HTTP/2)
    superlink_log = (out / "logs" / "superlink.log").read_text()
    assert f"Fleet API (gRPC-rere) on {HOST}:{results['deployment']['ports']['fleet']}" in superlink_log
    assert "Uvicorn running on https://" in superlink_log
    assert "Option --insecure was set" not in superlink_log
    assert "SuperNode authentication is disabled" not in superlink_log
    version, alpn, ips = probes["handshake"]
    assert version in ("TLSv1.2", "TLSv1.3") and alpn == "h2" and "127.0.0.1" in ips
    assert results["deployment"]["fleet_grpc_tls_logged"]
    # Negative cases: each refused, and each SuperNode gave up by itself (no hang, no kill needed)
    expected = {
        "unregistered": "Failed to activate SuperNode",
        "plaintext": "Giving up reconnection",
        "keyless": "SuperNode authentication is enabled",
    }
    for case, marker in expected.items():
        refusal = probes[case]
        assert refusal is not None, f"{case}: the SuperLink accepted it"
        assert refusal.returncode == 1, f"{case}: {refusal}"
        assert marker in refusal.reason, f"{case}: {refusal.reason}"
    assert "was refused" in probes["reported"] and "(log: " in probes["reported"]
    assert "\n" not in probes["reported"]
    # flwr run left the repository's pyproject.toml alone
    assert (REPO / "pyproject.toml").read_bytes() == pyproject_before


@pytest.mark.slow
def test_ctrl_c_stops_every_process(no_leftovers: Path) -> None:
    # Prepare: a CLI deployment, interrupted once both SuperNodes are up; the run is long (500
    # rounds), so the interrupt cannot arrive after it has finished (2 rounds finished first on a
    # loaded machine, and the CLI then rightly exited 0)
    out = no_leftovers / "run"
    sets = [arg for item in [*TWO_SILOS, "train.rounds=500"] for arg in ("--set", item)]
    cli = subprocess.Popen(
        [FEDLORA, "deploy", "local", "configs/smoke.toml", "--nodes", "2", "--out", str(out), *sets],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    node_log = out / "logs" / "supernode-1.log"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and cli.poll() is None:
        if node_log.is_file() and "SuperNode ID:" in node_log.read_text():
            break
        time.sleep(0.5)
    assert cli.poll() is None, cli.communicate()
    started = processes_of(no_leftovers)

    # Execute: Ctrl-C
    os.kill(cli.pid, signal.SIGINT)
    _, stderr = cli.communicate(timeout=120)

    # Assert: interrupted, reported, and the processes that were running are gone (fixture: all)
    assert cli.returncode == 130, stderr
    assert "interrupted" in stderr
    assert len(started) >= 3  # SuperLink + 2 SuperNodes (and their SuperExecs)
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


# Every registered strategy over one real federation (TLS + SuperNode auth): the capability
# matrix's "deployment" column is this test's list (fedlora.app.capabilities.DEPLOYMENT_TESTED).
EVERY_STRATEGY_BASE = ["data.num_clients=2", "clients.ranks=[2, 4]", "train.rounds=2", "train.max_steps=2",
                       "federation.fraction_evaluate=0", "federation.min_clients=1"]
PER_STRATEGY = {"fedtreelora": ["strategy.warmup_rounds=1"]}


@pytest.mark.slow
def test_every_strategy_runs_two_rounds_over_tls_grpc(no_leftovers: Path) -> None:
    from fedlora.app.capabilities import DEPLOYMENT_TESTED
    from fedlora.app.deploy.local import deploy_runs
    from fedlora.app.runner import resolve
    from strategies.registry import strategy_names

    # Prepare: one experiment per registered strategy, all on the same two silos
    configs = {name: resolve(REPO / "configs/smoke.toml", [*EVERY_STRATEGY_BASE, f"strategy.name={name}",
                                                          *PER_STRATEGY.get(name, [])])
               for name in strategy_names()}
    # Execute: one SuperLink, two authenticated SuperNodes, all runs submitted at once
    results = deploy_runs(configs, num_nodes=2, out_dir=no_leftovers / "fed", timeout=1500, side_by_side=True)
    # Assert: every strategy completed both rounds over gRPC with TLS, no failure, a results contract
    assert set(results) == set(strategy_names()) == set(DEPLOYMENT_TESTED)
    for name, result in results.items():
        assert result["deployment"]["tls"] and result["deployment"]["supernode_auth"], name
        assert result["deployment"]["flower_run"]["status"] == "finished:completed", name
        assert [r["round"] for r in result["rounds"]] == [1, 2], name
        assert all(r["failures"] == 0 and r["clients"] >= 1 for r in result["rounds"]), name
        assert result["final"]["wire_bytes_total"] >= result["final"]["bytes_total"], name
        assert sum(r["bytes_up"] for r in result["rounds"]) > 0 or name == "local", name


# ---------------------------------------------------------------- faults in a real deployment
SOAK = ["data.num_clients=4", "clients.ranks=[4, 4, 4, 4]", "train.rounds=10", "train.max_steps=1",
        "federation.evaluate_every=5", "federation.fraction_evaluate=0", "federation.min_clients=2",
        "federation.round_timeout=45", "strategy.name=fedit"]


def _rounds_written(out: Path) -> list[int]:
    import json

    try:
        return [r["round"] for r in json.loads((out / "results.json").read_text())["rounds"]]
    except (OSError, ValueError, KeyError):
        return []


def _clients(out: Path) -> list[int]:
    import json

    try:
        return [r["clients"] for r in json.loads((out / "results.json").read_text())["rounds"]] or [0]
    except (OSError, ValueError, KeyError):
        return [0]


def _wait(condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def _federation(folder: Path, config, nodes: int):
    """A started TLS + auth federation (SuperLink, registered keys, SuperNodes); the deployment and keys."""
    from fedlora.app.deploy.local import node_configs

    deployment = LocalDeployment(folder, nodes)
    deployment.start_superlink()
    keys = list(deployment.require_certs().node_keys)
    deployment.register(keys)
    deployment.start_supernodes(node_configs(config, nodes), keys)
    return deployment, keys


@pytest.mark.slow
def test_soak_a_killed_supernode_and_a_killed_superlink(no_leftovers: Path) -> None:
    import json

    from fedlora.app.deploy.local import app_dir, node_configs, write_run_config
    from fedlora.app.runner import resolve

    # Prepare: 4 silos, 10 rounds; the run's results live in `out`, outside any federation's folder
    out = no_leftovers / "results"
    config = resolve(REPO / "configs/smoke.toml", SOAK)
    config.output.dir = str(out)
    first, keys = _federation(no_leftovers / "fed1", config, 4)
    try:
        run_id = first.submit(app_dir(), write_run_config(config, no_leftovers / "run.toml"))
        # Execute 1: once round 2 is written, kill -9 SuperNode 3 (and its ClientApps), then restart it
        _wait(lambda: len(_rounds_written(out)) >= 2, 600, "round 2")
        first.supernodes[3].kill_tree()
        killed_during = len(_rounds_written(out)) + 1
        first.restart_supernode(3, node_configs(config, 4)[3], keys[3])  # retried until accepted again
        # Execute 2: once the restarted silo has trained in a round (and round 5 is written),
        # kill -9 the SuperLink with the SuperExec and ServerApp it runs
        _wait(lambda: len(_rounds_written(out)) >= 5 and _clients(out)[-1] == 4, 900, "the silo back, round 5")
        assert first.superlink is not None
        first.superlink.kill_tree()
        before = json.loads((out / "results.json").read_text())["rounds"]
    finally:
        first.stop()
    checkpointed = json.loads((out / "checkpoint" / "server.json").read_text())["round"]
    # Execute 3: a new federation resumes the run from its checkpoint
    second, _ = _federation(no_leftovers / "fed2", config, 4)
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
    assert [r["round"] for r in rounds] == list(range(1, 11))
    assert 5 <= checkpointed < 10
    assert any(r["failures"] >= 1 for r in rounds[killed_during - 1 : killed_during + 1])  # the round it died in
    assert any(r["clients"] == 4 for r in rounds[killed_during:checkpointed])  # the restarted silo came back
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
    for package in ("fedlora", "strategies", "clients", "simulations", "configs"):
        shutil.copytree(REPO / package, app / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "tests" / "hostile_clientapp.py", app / "hostile_clientapp.py")
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert 'clientapp = "clients.app:app"' in pyproject
    (app / "pyproject.toml").write_text(pyproject.replace('clientapp = "clients.app:app"',
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
