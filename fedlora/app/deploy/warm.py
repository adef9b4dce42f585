"""A SuperExec whose ClientApp processes start warm: forked from a parent that imported the heavy
libraries once.

Flower 1.39 runs every message of a SuperNode in a fresh ``flwr-clientapp`` process: the
SuperNode's SuperExec polls the SuperNode's Runtime API for a task token and starts
``flwr-clientapp --token T``, which pulls the message, loads the ClientApp from the run's FAB,
handles that one message, pushes the reply and exits. Each such process pays Python, flwr, torch,
transformers, peft and datasets imports before it can train (about 10-30 s on a loaded 2-core
machine). Flower's prestarted ("warm") executor pools serve only Kubernetes and only the agent,
model and connector task types, not ClientApps.

This module is a SuperExec for a SuperNode started with ``--isolation process`` (Flower's mode in
which the operator runs the SuperExec): it imports :data:`HEAVY_MODULES` once, then polls the Runtime
API like Flower's and, for every ClientApp token, forks a child that runs Flower's own
``run_clientapp`` with that token, exactly as ``flwr-clientapp`` does. Each message still runs in
its own process that handles one token and exits (Flower's isolation); only third-party modules
are imported before the message arrives: Flower installs the run's FAB (its configs) in the child
and loads the ClientApp, which imports the installed fedlora afresh there, so every fedlora cache
starts empty. The parent never runs a model, opens
no thread and holds no connection a child uses.

    flower-supernode ... --isolation process --port 9094
    python -m fedlora.app.deploy.warm --runtime-api-address 127.0.0.1:9094 --insecure --parent-pid <supernode pid>

``fedlora deploy local`` and ``fedlora deploy silo`` start one per SuperNode (``--clientapp warm``,
their default). It uses Flower internals (:data:`INTERNAL_MODULES`) of the Flower minor it was built
on (:data:`BUILT_ON_FLOWER`): :func:`unsupported` checks the installed Flower before a deployment
starts, which then falls back to Flower's public path (its own SuperExec, cold ClientApps) with
one line.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import time
from logging import ERROR, INFO, getLogger

log = getLogger("flwr").log  # Flower's logger, by its name: the SuperNode log shows its lines
TASK_STARTED_ENV = "FEDLORA_TASK_STARTED"  # clients/app.py: when this process was handed its message
POLL_ENV = "FLWR_SUPEREXEC_TASK_POLL_INTERVAL"  # Flower's SuperExec setting, honoured here (seconds)
DEFAULT_POLL_SECONDS = 1.0  # Flower's SuperExec default
# Third-party modules every fedlora ClientApp message imports (fedlora itself is not: the child
# imports it afresh, as a fresh flwr-clientapp does).
HEAVY_MODULES = ("numpy", "psutil", "pydantic", "torch", "transformers", "peft", "datasets", "flwr_datasets.partitioner",
                 "safetensors", "rouge_score.rouge_scorer", "flwr.clientapp.mod")
# transformers loads its classes lazily on first attribute access: touch the ones fedlora uses.
TRANSFORMERS_NAMES = ("AutoConfig", "AutoTokenizer", "PreTrainedTokenizerFast", "AutoModelForCausalLM",
                      "AutoModelForSequenceClassification", "LlamaForCausalLM", "BertForSequenceClassification",
                      "DataCollatorWithPadding", "DataCollatorForSeq2Seq")


BUILT_ON_FLOWER = "1.39"  # the Flower minor whose internals this module uses (pyproject bounds flwr to it)
INTERNAL_MODULES = ("flwr.proto.runtime_pb2", "flwr.supercore.constant", "flwr.supercore.exit",
                    "flwr.supercore.interceptors", "flwr.supercore.retry", "flwr.supercore.runtime",
                    "flwr.supercore.tls", "flwr.supernode.runtime.run_clientapp")


def unsupported(flower_version: str | None = None) -> str:
    """Why this SuperExec cannot run beside the installed Flower ('' when it can): another Flower
    minor than :data:`BUILT_ON_FLOWER`, or one of the internal modules it imports missing."""
    import importlib.metadata
    import importlib.util

    version = flower_version or importlib.metadata.version("flwr")
    if version.split(".")[:2] != BUILT_ON_FLOWER.split("."):
        return f"Flower {version} is installed, fedlora's warm SuperExec uses Flower {BUILT_ON_FLOWER} internals"
    for name in INTERNAL_MODULES:
        try:
            found = importlib.util.find_spec(name) is not None
        except ImportError:
            found = False
        if not found:
            return f"Flower {version} has no {name}, which fedlora's warm SuperExec imports"
    return ""


def preload() -> float:
    """Import :data:`HEAVY_MODULES` (and :data:`TRANSFORMERS_NAMES`); the seconds it took. A module
    that is not installed is skipped (the child imports what it needs, as a cold process would)."""
    started = time.perf_counter()
    for name in HEAVY_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            continue
    if "transformers" in sys.modules:
        transformers = sys.modules["transformers"]
        for name in TRANSFORMERS_NAMES:
            getattr(transformers, name, None)
    return time.perf_counter() - started


def _watch_parent(pid: int) -> None:
    """End this process at once when ``pid`` (the SuperNode) has exited, as Flower's SuperExec does
    (a thread that only polls; the children watch this process in turn)."""
    import threading

    def watch() -> None:
        while True:
            time.sleep(0.2)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(0)
            except PermissionError:
                continue

    threading.Thread(target=watch, daemon=True, name="fedlora-parent-watch").start()


def _reap(children: set[int]) -> None:
    """Collect the children that have exited (no zombies)."""
    for pid in list(children):
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            done = pid
        if done:
            children.discard(pid)


PROJECT_PACKAGES = ("fedlora",)  # the installed package (a run's FAB carries configs, no code)


def _forget_project_modules() -> None:
    """Drop the project's modules this parent imported (this module's own package): the child
    imports the ClientApp and fedlora afresh, as a fresh ``flwr-clientapp`` does."""
    for name in list(sys.modules):
        if name.split(".", 1)[0] in PROJECT_PACKAGES:
            del sys.modules[name]


def _run_child(token: str, handed: float, args: argparse.Namespace, certificates: bytes | None) -> None:
    """In the forked child: Flower's ``flwr-clientapp`` for ``token``; never returns."""
    code = 1
    try:
        from flwr.supercore.exit import exit_handler

        exit_handler.registered_exit_handlers.clear()  # the parent's own, if any: never run them here
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.environ[TASK_STARTED_ENV] = repr(handed)
        _forget_project_modules()
        from flwr.supernode.runtime.run_clientapp import run_clientapp

        log(INFO, "Start `flwr-clientapp` process (forked from fedlora's warm SuperExec)")
        run_clientapp(runtime_api_address=args.runtime_api_address, token=token, insecure=args.insecure,
                      certificates=certificates, parent_pid=os.getppid(), runtime_dependency_install=False)
        code = 0
    except SystemExit as done:  # flwr_exit ends the process with sys.exit after its exit handlers
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - report, then leave with an error status
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001, S110 - a closed stream: nothing to flush
                pass
        os._exit(code)


def serve(args: argparse.Namespace) -> None:
    """Preload, then hand every ClientApp task token of the Runtime API to a forked child."""
    from flwr.proto.runtime_pb2 import AcquireTaskRequest
    from flwr.supercore.constant import TaskType
    from flwr.supercore.interceptors import RuntimeVersionHttpInterceptor
    from flwr.supercore.retry import make_simple_http_retry_invoker
    from flwr.supercore.runtime import RuntimeHttpClient
    from flwr.supercore.tls import validate_and_resolve_root_certificates
    from flwr.supernode.runtime.run_clientapp import run_clientapp  # noqa: F401 - preloaded for the children

    if args.parent_pid is not None:
        _watch_parent(args.parent_pid)
    seconds = preload()
    log(INFO, "fedlora warm SuperExec: heavy libraries imported in %.1f s; serving %s", seconds,
        args.runtime_api_address)
    certificates = validate_and_resolve_root_certificates(args.root_certificates, args.insecure)
    client = RuntimeHttpClient.from_server_address(
        server_address=args.runtime_api_address, insecure=args.insecure, root_certificates=certificates,
        interceptors=[RuntimeVersionHttpInterceptor(component_name="SuperExec")],
        retry_invoker=make_simple_http_retry_invoker(),
    )
    children: set[int] = set()
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP.value])
    try:
        while True:
            _reap(children)
            try:  # Flower's retry invoker waits out a SuperNode that is not up yet
                reply = client.AcquireTask(request)
            except Exception as error:  # noqa: BLE001 - a refused request: try again at the next poll
                log(ERROR, "fedlora warm SuperExec: AcquireTask failed: %s", error)
                time.sleep(args.poll)
                continue
            if reply.HasField("task") and reply.token:
                handed = time.time()
                pid = os.fork()
                if pid == 0:
                    _run_child(reply.token, handed, args, certificates)
                children.add(pid)
                continue  # another message may be waiting: ask again at once
            time.sleep(args.poll)
    finally:
        client.close()


def parser() -> argparse.ArgumentParser:
    parse = argparse.ArgumentParser(
        prog="python -m fedlora.app.deploy.warm",
        description="SuperExec for a SuperNode in --isolation process: ClientApp processes forked warm.")
    parse.add_argument("--runtime-api-address", required=True,
                       help="the SuperNode's Runtime API, host:port (its --host / --port)")
    security = parse.add_mutually_exclusive_group(required=True)
    security.add_argument("--insecure", action="store_true", help="plain HTTP to the Runtime API (loopback)")
    security.add_argument("--root-certificates", help="CA certificate (PEM) of the Runtime API's TLS")
    parse.add_argument("--parent-pid", type=int, default=None,
                       help="stop when this process (the SuperNode) has exited")
    return parse


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    reason = unsupported()
    if reason:
        print(f"error: {reason}; run the SuperNode without --isolation process (Flower's own SuperExec)",
              file=sys.stderr)
        sys.exit(2)
    try:
        args.poll = float(os.environ.get(POLL_ENV, DEFAULT_POLL_SECONDS))
    except ValueError:
        print(f"error: {POLL_ENV} must be a number of seconds", file=sys.stderr)
        sys.exit(2)
    if not 0.01 <= args.poll <= 60.0:
        print(f"error: {POLL_ENV} must be between 0.01 and 60 seconds", file=sys.stderr)
        sys.exit(2)
    serve(args)


if __name__ == "__main__":
    main()
