"""Cross-silo deployment: certificates, a real TLS + auth SuperLink with SuperNodes on 127.0.0.1.

The slow tests start real Flower 1.39 processes (``flower-superlink``, ``flower-supernode``,
``flwr``); after each one no process that belongs to the test's folder may be left.
"""

from __future__ import annotations

import contextlib
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
from deploy_helpers import processes_of, rounds_written, try_supernode
from result_checks import assert_accuracies_add_up

from fedlora.app.deploy.certs import write_certs, write_node_key
from fedlora.app.deploy.federation import LocalDeployment
from fedlora.app.deploy.flwr_cli import HOST, DeployError
from fedlora.app.deploy.local import deploy_local
from fedlora.config import ConfigError

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

REPO = Path(__file__).resolve().parents[1]
FEDLORA = str(Path(sys.executable).parent / "fedlora")
# Two silos with different ranks, a heterogeneous-rank method, 2 rounds of the smoke experiment.
TWO_SILOS = ["data.num_clients=2", "clients.ranks=[2, 8]", "strategy.name=hetlora", "train.rounds=2"]


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


# A process that ignores SIGTERM (as a busy or stuck Flower process may: SIGTERM runs its exit
# handlers) and starts a child in a session of its own that ignores it too.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "if sys.argv[1] == 'parent':\n"
    "    subprocess.Popen([sys.executable, '-c', sys.argv[2], 'child', ''], start_new_session=True)\n"
    "time.sleep(600)\n"
)


def test_an_interrupted_stop_kills_what_ignores_sigterm_within_seconds(tmp_path: Path) -> None:
    """stop_daemons with INTERRUPT_GRACE: a daemon that ignores SIGTERM, its child in another
    session, and a process found only by its FLWR_HOME (no descendant of any daemon) are all
    gone within the grace and the kill wait, loaded machine or not."""
    from fedlora.app.deploy.processes import (
        INTERRUPT_GRACE,
        KILL_WAIT,
        Daemon,
        processes_with_home,
        stop_daemons,
    )

    home = tmp_path / "flwr"
    daemon = Daemon("stubborn", [sys.executable, "-c", STUBBORN, "parent", STUBBORN],
                    {**os.environ, "FLWR_HOME": str(home / "a")}, tmp_path / "stubborn.log")
    stray = subprocess.Popen([sys.executable, "-c", STUBBORN, "child", ""], env={**os.environ, "FLWR_HOME": str(home / "b")},
                             start_new_session=True)
    find = processes_with_home(home)
    deadline = time.monotonic() + 30
    while len(find()) < 3 and time.monotonic() < deadline:  # the daemon, its child, the stray process
        time.sleep(0.1)
    assert len(find()) == 3
    try:
        started = time.monotonic()
        stop_daemons([daemon], grace=INTERRUPT_GRACE, others=find)
        took = time.monotonic() - started
        print(f"stop_daemons after an interrupt: {took:.1f}s")
        assert find() == [] and stray.poll() is not None  # (psutil reaped it: its status is gone)
        assert took < INTERRUPT_GRACE + 2 * KILL_WAIT + 2, took
    finally:
        for proc in find():
            proc.kill()
        stray.kill()


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
        probes["unregistered"] = try_supernode(deployment, "neg-unregistered-key", key=rogue, tls=True)
        probes["plaintext"] = try_supernode(deployment, "neg-plaintext", key=None, tls=False)
        probes["keyless"] = try_supernode(deployment, "neg-keyless", key=None, tls=True)
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
    for record in results["rounds"]:  # the silos' evaluation replies add up to the round's accuracies
        assert_accuracies_add_up(record, results["config"]["data"]["global_test_size"])
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


# What a Ctrl-C may take, loaded machine or not: fedlora.app.deploy.processes.INTERRUPT_GRACE (2 s) +
# twice its KILL_WAIT (3 s) + the CLI's own exit; generous for a loaded 2-core machine.
CTRL_C_BOUND = 30.0


# The CLI as a command typed in a terminal, with SIGINT at its default. A command started in the
# background of a non-interactive shell (`make test &`, `nohup bash .ci/run &`) inherits SIGINT
# *ignored*, and so does every process it starts: Python then installs no Ctrl-C handler and the
# CLI under test never sees the interrupt (the run went on for rounds: why this test failed inside
# a backgrounded fresh-clone `make test` and passed in CI). preexec_fn is not safe beside xdist's
# threads, so the CLI's own interpreter restores the handler before it runs the module.
CLI_AS_IN_A_TERMINAL = [
    sys.executable, "-c",
    ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
     "sys.argv[0] = 'fedlora'; runpy.run_module('fedlora.app.cli', run_name='__main__')"),
]  # fmt: skip


@pytest.mark.slow
def test_ctrl_c_stops_every_process(no_leftovers: Path, busy_cores: int) -> None:
    # Prepare: a CLI deployment (this checkout's code: python -m, cwd first on sys.path) with every
    # core busy, interrupted once it printed round 1's line on its terminal (the ServerApp's line, relayed
    # as it comes: round 1 is written by then); the run is long (500 rounds), so the interrupt cannot
    # arrive after it has finished (2 rounds finished first on a loaded machine, and the CLI then rightly
    # exited 0)
    import threading

    out = no_leftovers / "run"
    sets = [arg for item in [*TWO_SILOS, "train.rounds=500"] for arg in ("--set", item)]
    cli = subprocess.Popen(
        [*CLI_AS_IN_A_TERMINAL, "deploy", "local", "configs/smoke.toml", "--nodes", "2", "--out", str(out), *sets],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    printed: list[str] = []
    reader = threading.Thread(target=lambda: printed.extend(iter(cli.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 480
    while time.monotonic() < deadline and cli.poll() is None and not any(
            line.startswith("round   1/500  global ") for line in list(printed)):
        time.sleep(0.5)
    assert cli.poll() is None, (printed, cli.stderr.read())
    written = rounds_written(out)
    assert written, f"no round line within 480 s: {printed}"
    started = processes_of(no_leftovers)

    # Execute: Ctrl-C
    os.kill(cli.pid, signal.SIGINT)
    interrupted = time.monotonic()
    with contextlib.suppress(subprocess.TimeoutExpired):
        cli.wait(timeout=CTRL_C_BOUND + 30)  # past the bound: fail below, not hang here
    took = time.monotonic() - interrupted
    cli.kill()
    reader.join(10)
    stderr = cli.stderr.read()
    print(f"Ctrl-C: the CLI exited {took:.1f}s after SIGINT, {busy_cores} cores busy, rounds written {written}")

    # Assert: stopped within seconds, interrupted and reported; the processes that were running are
    # gone, and every other one of the deployment (fixture: after 5 s more); the rounds written are kept
    assert took < CTRL_C_BOUND, f"Ctrl-C took {took:.1f}s with {busy_cores} busy cores"
    assert cli.returncode == 130, stderr
    assert "interrupted" in stderr
    assert len(started) >= 3  # SuperLink + 2 SuperNodes (and their SuperExecs, the ServerApp, flwr log)
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert processes_of(no_leftovers) == []
    assert rounds_written(out)[: len(written)] == written


@pytest.mark.slow
def test_sigterm_stops_deploy_local_with_status_143(no_leftovers: Path) -> None:
    # Prepare: a CLI deployment, stopped by SIGTERM once its SuperLink is up (the processes it started
    # meanwhile: the SuperLink and its SuperExec, SuperNodes being started)
    out = no_leftovers / "run"
    sets = [arg for item in TWO_SILOS for arg in ("--set", item)]
    cli = subprocess.Popen([FEDLORA, "deploy", "local", "configs/smoke.toml", "--nodes", "2", "--out", str(out), *sets],
                           cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    superlink_log = out / "logs" / "superlink.log"
    deadline = time.monotonic() + 180
    while cli.poll() is None and time.monotonic() < deadline and (
            not superlink_log.is_file() or "Uvicorn running on https://" not in superlink_log.read_text()):
        time.sleep(0.2)
    assert cli.poll() is None, cli.communicate()
    # Execute
    cli.send_signal(signal.SIGTERM)
    _, stderr = cli.communicate(timeout=CTRL_C_BOUND + 30)
    # Assert: 128 + SIGTERM, said in one line; nothing of the deployment left (the fixture)
    assert cli.returncode == 143, stderr
    assert stderr.strip() == "fedlora: stopped by SIGTERM; results written so far are kept"
