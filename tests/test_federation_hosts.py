"""A federation of separate hosts, as docs/deployment.md's walk-through runs it: the operator and two
silos as separate processes, each in its own folder with its own HOME, the operator's Fleet API on
127.0.0.1 and the silos' SuperNodes on 127.0.0.2 and 127.0.0.3, TLS with the host name checked, every
silo on its own data file, WordNet out of reach of every process. The run's results equal the same
run in simulation (the in-process engine, each client on the same file); bad silos are refused in
one line and start nothing; SIGTERM stops every role with status 143 and nothing left running.

The commands are the page's: read from the block under :data:`WALK`, with the test's folders, free
ports and an output folder put in (:func:`commands`). One federation serves the whole module.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from deploy_helpers import REPO, processes_of

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

FEDLORA = str(Path(sys.executable).parent / "fedlora")
WALK = "<!-- the walk-through: tests/test_federation_hosts.py runs these commands, in this order -->"
SILOS = {"alpha": "127.0.0.2", "beta": "127.0.0.3"}
START = 180.0  # seconds a role may take to say it is up (imports on a loaded 2-core machine)
TOLERANCE = 1e-6  # deployment vs simulation: the same computation (tests/test_flwr_run.py's tolerance)
COMPARED = ("global_accuracy", "personalized_accuracy", "received_accuracy", "train_loss", "bytes_up", "bytes_down",
            "clients", "failures")


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def page_commands() -> list[list[str]]:
    """The walk-through's commands, as docs/deployment.md shows them (comments dropped)."""
    text = (REPO / "docs/deployment.md").read_text(encoding="utf-8")
    assert WALK in text, f"docs/deployment.md lost the marker {WALK!r}"
    block = text.split(WALK, 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    return [shlex.split(line.split(" #", 1)[0]) for line in block.splitlines()
            if line.strip() and not line.strip().startswith("#")]


class Federation:
    """The walk-through's processes and folders."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fed = root / "fed"
        self.data = root / "data"
        self.ports = {"fleet": free_port("127.0.0.1"), "control": free_port("127.0.0.1"),
                      **{name: free_port(ip) for name, ip in SILOS.items()}}
        self.roles: dict[str, subprocess.Popen[str]] = {}
        self.outputs: dict[str, Path] = {}
        self.run: dict[str, object] = {}

    def env(self, home: Path) -> dict[str, str]:
        home.mkdir(parents=True, exist_ok=True)
        return {**os.environ, "HOME": str(home), "FLWR_TELEMETRY_ENABLED": "0",
                "FEDLORA_WORDNET_DIR": str(self.root / "no-wordnet-here")}  # any WordNet read fails

    def start(self, role: str, argv: list[str], cwd: Path, ready: str) -> None:
        """Start a role that stays up, its HOME its own folder; wait until its output says ``ready``."""
        out = self.root / f"{role}.out"
        self.outputs[role] = out
        home = self.root / ("operator" if role == "operator" else f"host-{role}")
        with out.open("w") as handle:
            self.roles[role] = subprocess.Popen(argv, cwd=cwd, env=self.env(home), stdout=handle,
                                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        deadline = time.monotonic() + START
        while ready not in out.read_text():
            assert self.roles[role].poll() is None, f"{role} exited: {out.read_text()}"
            assert time.monotonic() < deadline, f"{role} did not say {ready!r} in {START:.0f}s: {out.read_text()}"
            time.sleep(0.5)

    def follow(self, argv: list[str], cwd: Path, timeout: float = 900.0) -> None:
        """Run the run command; record each stdout line with the time it arrived."""
        started = time.monotonic()
        process = subprocess.Popen(argv, cwd=cwd, env=self.env(self.root / "operator"), stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE, text=True)
        lines = []
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.monotonic() - started, line.rstrip("\n")))
            assert time.monotonic() - started < timeout, "the run did not finish"
        self.run = {"rc": process.wait(), "lines": lines, "stderr": process.stderr.read() if process.stderr else ""}

    def stop(self) -> None:
        for process in self.roles.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)


def commands(fed: Federation) -> list[tuple[str, list[str], Path]]:
    """The page's commands with the test's folders, ports and output folder: (role, argv, cwd)."""
    roles = []
    for argv in page_commands():
        if argv[0] == "make":
            assert argv == ["make", "install"]  # this environment is installed
            continue
        words = [str(fed.fed) if word == "fed" else word for word in argv]
        words = [word.replace("127.0.0.1:9092", f"127.0.0.1:{fed.ports['fleet']}") for word in words]
        if argv[0] == "python":
            roles.append(("data", [sys.executable, *words[1:-3], str(fed.data), *words[-2:]], REPO))
            assert argv[-3] == "data"
        elif argv[:3] == ["fedlora", "deploy", "operator"]:
            roles.append(("operator", [FEDLORA, *words[1:], "--control-port", str(fed.ports["control"])], REPO))
        elif argv[:3] == ["fedlora", "deploy", "silo"]:
            name = Path(argv[3]).name
            host = fed.root / f"host-{name}"  # its own folder: the kit and the data file copied there
            assert argv[3] == f"fed/silos/{name}" and argv[5] == f"data/{name}.csv" and argv[7] == SILOS[name]
            words = [*words[:3], str(host / name), "--data", str(host / f"{name}.csv"), *words[6:]]
            roles.append((name, [FEDLORA, *words[1:], "--port", str(fed.ports[name])], host))
        else:
            assert argv[:3] == ["fedlora", "deploy", "run"]
            roles.append(("run", [FEDLORA, *words[1:], "--out", str(fed.root / "run")], REPO))
    assert [role for role, _, _ in roles] == ["data", "operator", *SILOS, "run"]
    return roles


def hand_over(fed: Federation, name: str) -> None:
    """What the operator hands silo ``name``: its kit, copied to the silo's own folder (its host)."""
    host = fed.root / f"host-{name}"
    host.mkdir(parents=True, exist_ok=True)
    shutil.copytree(fed.fed / "silos" / name, host / name)
    shutil.copy(fed.data / f"{name}.csv", host / f"{name}.csv")


@pytest.fixture(scope="module")
def federation(tmp_path_factory: pytest.TempPathFactory):
    fed = Federation(tmp_path_factory.mktemp("hosts"))
    try:
        for role, argv, cwd in commands(fed):
            if role == "data":
                subprocess.run(argv, cwd=cwd, env=fed.env(fed.root / "operator"), check=True, capture_output=True,
                               timeout=300)
            elif role == "operator":
                fed.start(role, argv, cwd, "ready:")
            elif role in SILOS:
                hand_over(fed, role)
                fed.start(role, argv, cwd, "joined:")
            else:
                fed.follow(argv, cwd)
        yield fed
    finally:
        fed.stop()


def test_the_walkthrough_trains_over_tls_and_prints_its_rounds_as_they_happen(federation: Federation) -> None:
    run = federation.run
    lines = [line for _, line in run["lines"]]
    assert run["rc"] == 0, (run["stderr"], lines)
    # Assert: the startup phases, then each round as it ended (round 1 long before the run ended)
    said = "\n".join(lines)
    assert "link up: SuperLink at 127.0.0.1:" in said and "silos joined 2/2: alpha, beta" in said
    rounds = [(at, line) for at, line in run["lines"] if line.startswith("round ")]
    assert [line.split()[1] for _, line in rounds] == ["1/2", "2/2"]
    finished = next(at for at, line in run["lines"] if line.startswith("results: "))
    assert rounds[0][0] < finished - 5.0, run["lines"]
    assert lines[-1] == f"results: {federation.root / 'run'}/results.json"
    # Assert: the silos dialled the SuperLink over TLS (checked in their preflight) from their own hosts
    for name, ip in SILOS.items():
        said = federation.outputs[name].read_text()
        assert "check ok: TLS: TLSv1.3, the SuperLink's certificate is signed by the kit's CA and names 127.0.0.1" in said
        assert f"check ok: the SuperNode's Runtime API: {ip}:{federation.ports[name]} free" in said
        assert f"joined: silo {name} is node " in said
    operator = federation.outputs["operator"].read_text()
    assert "TLS, SuperNode authentication" in operator and "silo alpha joined" in operator and "silo beta joined" in operator
    superlink_log = (federation.fed / "logs" / "superlink.log").read_text()
    assert "Uvicorn running on https://" in superlink_log and "Option --insecure was set" not in superlink_log


def test_the_deployment_equals_the_same_run_in_simulation(federation: Federation, tmp_path: Path) -> None:
    from fedlora.app.runner import run_inprocess
    from fedlora.config import load_config

    # Prepare: the same experiment, each simulated client on its silo's file (the node config a silo sends)
    deployed = json.loads((federation.root / "run" / "results.json").read_text())
    config = load_config(REPO / "configs/cross-silo.toml")
    nodes = [{"partition-id": k, "num-partitions": 2, "data-path": str(federation.root / f"host-{name}" / f"{name}.csv")}
             for k, name in enumerate(SILOS)]
    # Execute
    run_inprocess(config, tmp_path, configs=nodes)
    simulated = json.loads((tmp_path / "results.json").read_text())
    # Assert: round by round the same numbers; the bound partitions are the ones the silos hold
    assert len(deployed["rounds"]) == len(simulated["rounds"]) == 2
    for mine, theirs in zip(deployed["rounds"], simulated["rounds"], strict=True):
        for key in COMPARED:
            assert mine[key] == pytest.approx(theirs[key], abs=TOLERANCE), (mine["round"], key)
    assert sorted(deployed["strategy_info"]["clients"]) == ["0", "1"] and deployed["strategy_info"]["refused"] == []
    profiles = deployed["strategy_info"]["clients"]
    assert [Path(profiles[str(k)]["data_path"]).name for k in range(2)] == ["alpha.csv", "beta.csv"]


def expired_ca(path: Path) -> None:
    """A CA certificate that expired yesterday, in place of a kit's."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP384R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedlora-ca")])
    now = dt.datetime.now(dt.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(days=400))
            .not_valid_after(now - dt.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True).sign(key, hashes.SHA384()))
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def other_federations_ca(path: Path) -> None:
    from fedlora.app.deploy.certs import write_certs

    shutil.copy(write_certs(path.parent / "other-federation").ca_cert, path)


def other_version(kit: Path) -> None:
    silo = json.loads((kit / "silo.json").read_text())
    silo["versions"]["fedlora"] = "0.0.9"  # the operator runs another fedlora
    (kit / "silo.json").write_text(json.dumps(silo))


def unreachable(kit: Path) -> None:
    silo = json.loads((kit / "silo.json").read_text())
    silo["superlink"] = f"127.0.0.1:{free_port('127.0.0.1')}"  # nothing listens there
    (kit / "silo.json").write_text(json.dumps(silo))


BAD_HOSTS = {
    "wrong-certificate": (lambda kit: other_federations_ca(kit / "ca.crt"),
                          "presents a certificate that fails verification", "belongs to another federation"),
    "expired-certificate": (lambda kit: expired_ca(kit / "ca.crt"), "the federation's CA certificate",
                            "expired on"),
    "other-fedlora": (other_version, "this host runs fedlora 0.1.0, the federation's operator runs fedlora 0.0.9",
                      "install fedlora 0.0.9 here"),
    "unreachable-superlink": (unreachable, "cannot reach the SuperLink at 127.0.0.1:",
                              "check that the operator's SuperLink runs"),
}


@pytest.fixture(scope="module")
def bad_hosts(federation: Federation) -> dict[str, tuple[subprocess.CompletedProcess[str], Path]]:
    """Each bad case's silo command (all at once: each pays its imports), on a host of its own with
    silo alpha's kit, one thing wrong with it: case -> (what the command did, the host's folder)."""
    started = {}
    for case, (damage, _, _) in BAD_HOSTS.items():
        host = federation.root / f"bad-{case}"
        shutil.copytree(federation.fed / "silos" / "alpha", host / "alpha")
        shutil.copy(federation.data / "alpha.csv", host / "alpha.csv")
        damage(host / "alpha")
        argv = [FEDLORA, "deploy", "silo", str(host / "alpha"), "--data", str(host / "alpha.csv"), "--host", "127.0.0.4",
                "--port", str(free_port("127.0.0.4"))]
        started[case] = (subprocess.Popen(argv, cwd=host, env=federation.env(host), stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True), host)
    done = {}
    for case, (process, host) in started.items():
        stdout, stderr = process.communicate(timeout=300)
        done[case] = (subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr), host)
    return done


@pytest.mark.parametrize("case", sorted(BAD_HOSTS))
def test_a_bad_silo_is_refused_in_one_line_and_starts_nothing(bad_hosts: dict, case: str) -> None:
    # Prepare / Execute: the fixture
    done, host = bad_hosts[case]
    _, problem, fix = BAD_HOSTS[case]
    # Assert: status 2, one line naming the host, the fault and the fix; no process of its own started
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith("fedlora: error: silo alpha (127.0.0.4): ") and problem in lines[0] and fix in lines[0]
    assert processes_of(host) == []
    assert not (host / "alpha" / "logs").exists() and not (host / "alpha" / "flwr").exists()


def test_sigterm_stops_every_role_with_status_143_and_nothing_left(federation: Federation) -> None:
    # Execute: SIGTERM to each silo, then to the operator
    codes = {}
    for role in [*SILOS, "operator"]:
        process = federation.roles[role]
        process.send_signal(signal.SIGTERM)
        codes[role] = process.wait(timeout=60)
    # Assert
    assert codes == {"alpha": 143, "beta": 143, "operator": 143}
    for role in codes:
        assert "fedlora: stopped by SIGTERM" in federation.outputs[role].read_text()
    _, alive = __import__("psutil").wait_procs(processes_of(federation.root), timeout=10)
    assert [" ".join(p.cmdline()[:3]) for p in alive] == []
