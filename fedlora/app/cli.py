"""The ``fedlora`` command line.

    fedlora run CONFIG [--set key=value ...] [--out DIR] [--verbose] [--resume DIR | --overwrite]
                   [--engine ray|inprocess] [--ray-address HOST:PORT]
    fedlora compare CONFIG --strategies a,b,... [--seeds 0,1,2] [--out DIR] [--set k=v ...]
                   [--engine ray|inprocess] [--workers N] [--fresh-partitions] [--resume | --overwrite]
                   [--paired BASELINE [--primary LABEL] [--primary-metric METRIC]]
    fedlora tune CONFIG --strategies a,b --grid train.lr=1e-4,1e-3 [--seeds 0,1] [--out DIR]
                   [--resume | --overwrite]
    fedlora strategies
    fedlora deploy certs DIR [--hosts HOST ...] [--nodes N]
    fedlora deploy local CONFIG --nodes N [--insecure] [--clientapp warm|cold] [--out DIR] [--set k=v ...] [--resume | --overwrite]

A user mistake (bad config, missing model or data, unknown strategy, an output folder that cannot
be written, a corrupt checkpoint) prints one line on stderr and exits with status 2; nothing
already written (results, adapters) is removed. An output folder that holds an earlier run is
never written into unless --resume continues it, nor removed: --overwrite moves it aside
(fedlora/app/folders.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

USER_ERROR = 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """The errors a user can fix. Only modules already imported are looked at: an error class
    whose module was never imported cannot have been raised (and importing the data layer to
    find out would cost seconds on every one-line error)."""
    from fedlora.errors import ConfigError  # ModelError, CheckpointError: subclasses

    errors: list[type[BaseException]] = [ConfigError]
    for module, name in (("fedlora.app.deploy.flwr_cli", "DeployError"), ("fedlora.app.runner", "RunError"),
                         ("fedlora.data.sources", "DataError")):
        if module in sys.modules:
            errors.append(getattr(sys.modules[module], name))
    return tuple(errors)


def _final_scores(results: dict[str, Any]) -> str:
    from fedlora.app.runner import final_scores

    return final_scores(results)


def _cmd_run(args: argparse.Namespace) -> int:
    from fedlora.app.runner import run

    # the run itself says its final scores and where its files are (fedlora.app.runner.final_lines)
    run(args.config, overrides=args.set, out_dir=args.out, verbose=args.verbose, resume=args.resume,
        engine=args.engine, overwrite=args.overwrite)
    return 0


def _parse_list(text: str, option: str, kind: type = str) -> list:
    from fedlora.config import ConfigError

    items = [item.strip() for item in text.split(",") if item.strip()]
    try:
        values = [kind(item) for item in items]
    except ValueError:
        raise ConfigError(f"{option} expects a comma-separated list of {kind.__name__}, got {text!r}") from None
    if not values:
        raise ConfigError(f"{option} is empty; give e.g. {option} {'fedit,flexlora' if kind is str else '0,1'}")
    return values


def _cmd_compare(args: argparse.Namespace) -> int:
    from fedlora.app.compare import compare

    table = compare(
        args.config,
        _parse_list(args.strategies, "--strategies"),
        seeds=_parse_list(args.seeds, "--seeds", int),
        out_dir=args.out,
        overrides=args.set,
        engine=args.engine,
        verbose=args.verbose,
        workers=args.workers,
        fresh_partitions=args.fresh_partitions,
        paired=args.paired,
        primary=args.primary,
        primary_metric=args.primary_metric,
        resume=args.resume,
        overwrite=args.overwrite,
    )
    print(table.to_text())
    paired = ""
    if table.paired_table is not None:
        print(table.paired_table.to_markdown())
        paired = f", {table.out_dir}/paired.csv"
    print(f"every column: {table.out_dir}/summary.md, {table.out_dir}/summary.csv{paired}   plots: {table.out_dir}/*.png")
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from fedlora.app.tune import parse_grid, tune

    table = tune(
        args.config,
        _parse_list(args.strategies, "--strategies"),
        parse_grid(args.grid),
        seeds=_parse_list(args.seeds, "--seeds", int),
        out_dir=args.out,
        overrides=args.set,
        engine=args.engine,
        resume=args.resume,
        overwrite=args.overwrite,
    )
    print(table.to_markdown())
    print(f"chosen settings: {table.out_dir}/tuning.json   summary: {table.out_dir}/summary.md")
    return 0


def _cmd_strategies(args: argparse.Namespace) -> int:
    from fedlora.methods import method, method_names

    for name in method_names():
        caps = method(name).capabilities
        kind = "personalised" if caps.personalized else "global"
        also = "".join(f"\n{alias:<12} = {name} (another name of it)" for alias in method(name).aliases)
        print(f"{name:<12} {kind:<13} up: {caps.uploads:<22} down: {caps.downloads}{also}")
    return 0


def _cmd_capabilities(args: argparse.Namespace) -> int:
    from fedlora.app.capabilities import (
        render_matrix,
        write_flower_doc,
        write_readme,
        write_secure_doc,
        write_strategies_doc,
    )

    if args.write:
        changed = write_readme(args.readme)
        print(f"{args.readme}: capability matrix {'updated' if changed else 'already current'}")
        changed = write_flower_doc(args.flower_doc)
        print(f"{args.flower_doc}: Flower DP table {'updated' if changed else 'already current'}")
        changed = write_secure_doc(args.secure_doc)
        print(f"{args.secure_doc}: secure aggregation table {'updated' if changed else 'already current'}")
        changed = write_strategies_doc(args.strategies_doc)
        print(f"{args.strategies_doc}: server optimiser / FedProx table {'updated' if changed else 'already current'}")
    else:
        print(render_matrix())
    return 0


def _cmd_deploy_certs(args: argparse.Namespace) -> int:
    from fedlora.app.deploy.certs import write_certs

    paths = write_certs(args.dir, hosts=args.hosts, num_nodes=args.nodes, days=args.days)
    print(f"CA: {paths.ca_cert} (keep {paths.ca_key} offline)")
    print(f"SuperLink: {paths.server_cert} {paths.server_key}")
    for key in paths.node_keys:
        print(f"SuperNode key: {key} (public: {key}.pub)")
    return 0


def _cmd_deploy_local(args: argparse.Namespace) -> int:
    from fedlora.app.deploy.local import deploy_local

    results = deploy_local(
        args.config, num_nodes=args.nodes, out_dir=args.out, overrides=args.set, insecure=args.insecure,
        timeout=args.timeout, overwrite=args.overwrite, resume=args.resume, clientapp=args.clientapp,
    )
    final, deployment = results["final"], results["deployment"]
    out = results["config"]["output"]["dir"]
    transport = "gRPC over TLS, SuperNode auth" if deployment["tls"] else "gRPC, INSECURE (no TLS, no auth)"
    print(
        f"{_final_scores(results)}, {final.get('bytes_total', 0) / 1e6:.2f} MB "
        f"in {deployment['timings']['total_seconds']:.0f}s ({deployment['nodes']} SuperNodes, {transport})"
    )
    print(f"results: {out}/results.json   logs: {out}/logs/   all processes stopped")
    return 0


def one_line(text: str) -> str:
    """``text`` on one line (an error message must never spill over several lines of stderr)."""
    return " ".join(text.split()) or "unknown error"


def _add_set(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key")


def _add_overwrite(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("--overwrite", action="store_true", help=f"move an earlier {what} in the output folder aside "
                        "(to DIR.old-<time>; nothing is deleted) and start afresh")


def _add_engine(parser: argparse.ArgumentParser,
                text: str = "ray: Flower's simulation engine; inprocess: same apps without Ray (fast, small runs)") -> None:
    parser.add_argument("--engine", choices=("ray", "inprocess"), default="ray", help=text)


def build_parser() -> argparse.ArgumentParser:
    from fedlora.version import __version__

    parser = argparse.ArgumentParser(prog="fedlora", description="Federated LoRA fine-tuning on Flower.")
    parser.add_argument("--version", action="version", version=f"fedlora {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one experiment in Flower's simulation engine")
    run.add_argument("config", help="TOML experiment config")
    _add_set(run)
    run.add_argument("--out", default=None, help="output folder (default: output.dir)")
    run.add_argument("--verbose", action="store_true", help="show Flower's and Ray's logs")
    run.add_argument("--resume", default=None, metavar="DIR",
                     help="continue the interrupted run in DIR after its last complete round (same config)")
    _add_overwrite(run, "run")
    run.add_argument("--ray-address", default=None, metavar="HOST:PORT",
                     help="join this running Ray cluster (ray start --head ...) instead of a local Ray")
    _add_engine(run)
    run.set_defaults(func=_cmd_run)

    cmp = sub.add_parser("compare", help="run strategies x seeds on the same partitions and summarise")
    cmp.add_argument("config", help="TOML experiment config")
    cmp.add_argument("--strategies", required=True, help="comma-separated strategy names, e.g. fedit,flexlora")
    cmp.add_argument("--seeds", default="0", help="comma-separated train.seed values (default 0)")
    cmp.add_argument("--out", default=None, help="comparison folder (default: <output.dir>/compare)")
    _add_set(cmp)
    cmp.add_argument("--ray-address", default=None, metavar="HOST:PORT", help="as for run")
    _add_engine(cmp)
    cmp.add_argument("--verbose", action="store_true", help="show Flower's and Ray's logs")
    cmp.add_argument("--workers", type=int, default=1,
                     help="runs at a time, each in its own process (in-process engine; they share a GPU)")
    cmp.add_argument("--fresh-partitions", action="store_true",
                     help="every seed a fresh partition (data.seed = config's data.seed + seed); default: "
                     "the config's data.seed for every seed (identical partitions)")
    cmp.add_argument("--paired", default=None, metavar="BASELINE",
                     help="paired statistics of every other strategy minus BASELINE, matched by seed (bootstrap "
                     "95%% CI, paired t-test, Holm): summary.md and paired.csv")
    cmp.add_argument("--primary", default=None, metavar="LABEL",
                     help="the declared primary comparison (LABEL - BASELINE): uncorrected, outside the Holm family")
    cmp.add_argument("--primary-metric", default="personalized_accuracy", metavar="METRIC",
                     help="metric of the primary comparison (default personalized_accuracy; or "
                     "personalized_accuracy_worst, global_accuracy, received_accuracy)")
    cmp.add_argument("--resume", action="store_true",
                     help="continue the comparison in the output folder: complete runs are kept, interrupted ones "
                          "resume from their checkpoint (or, without a usable one, are moved aside and rerun)")
    _add_overwrite(cmp, "comparison")
    cmp.set_defaults(func=_cmd_compare)

    tune = sub.add_parser("tune", help="same grid for every strategy; each picks its best setting on validation")
    tune.add_argument("config", help="TOML experiment config")
    tune.add_argument("--strategies", required=True, help="comma-separated strategy names")
    tune.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2",
                      help="a config key and its values, e.g. train.lr=1e-4,3e-4,1e-3 (repeatable)")
    tune.add_argument("--seeds", default="0", help="comma-separated train.seed values (default 0)")
    tune.add_argument("--out", default=None, help="tuning folder (default: <output.dir>/tune)")
    _add_set(tune)
    _add_engine(tune, "as for compare")
    tune.add_argument("--ray-address", default=None, metavar="HOST:PORT", help="as for run")
    tune.add_argument("--resume", action="store_true", help="continue the tuning in the output folder (as for compare)")
    _add_overwrite(tune, "tuning")
    tune.set_defaults(func=_cmd_tune)

    deploy = sub.add_parser("deploy", help="cross-silo deployment: certificates, local SuperLink + SuperNodes")
    deploy_sub = deploy.add_subparsers(dest="deploy_command", required=True)
    certs = deploy_sub.add_parser("certs", help="write a CA, a SuperLink certificate and SuperNode key pairs")
    certs.add_argument("dir", help="empty output folder (tls/, keys/)")
    certs.add_argument("--hosts", nargs="+", default=["localhost", "127.0.0.1", "::1"], metavar="HOST",
                       help="SuperLink host names / IPs for the certificate (127.0.0.1 is always added)")
    certs.add_argument("--nodes", type=int, default=0, help="number of SuperNode key pairs (keys/node_<i>)")
    certs.add_argument("--days", type=int, default=365, help="validity in days")
    certs.set_defaults(func=_cmd_deploy_certs)
    local = deploy_sub.add_parser("local", help="run CONFIG on a SuperLink + N SuperNodes on 127.0.0.1 (TLS + auth)")
    local.add_argument("config", help="TOML experiment config")
    local.add_argument("--nodes", type=int, default=None, help="SuperNodes (default and required: data.num_clients)")
    local.add_argument("--insecure", action="store_true", help="no TLS and no SuperNode authentication")
    local.add_argument("--out", default=None, help="output folder (default: output.dir); logs/, certs/, flwr/ go here")
    _add_set(local)
    local.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run (then stop it)")
    local.add_argument("--clientapp", choices=("warm", "cold"), default="warm",
                       help="warm: each message's ClientApp process is forked from a SuperExec that imported torch, "
                            "transformers, peft and datasets once (fedlora.app.deploy.warm; SuperNodes in --isolation "
                            "process); cold: Flower's own SuperExec starts a fresh flwr-clientapp per message")
    local.add_argument("--resume", action="store_true",
                       help="continue the interrupted run in the output folder from its checkpoint on a new federation "
                            "(the earlier one's certificates and logs are moved into deployment.old-<time>/)")
    _add_overwrite(local, "deployment")
    local.set_defaults(func=_cmd_deploy_local)

    strategies = sub.add_parser("strategies", help="list the registered strategies")
    strategies.set_defaults(func=_cmd_strategies)

    caps = sub.add_parser("capabilities", help="print (or --write into the README) the capability matrix")
    caps.add_argument("--write", action="store_true", help="regenerate the README's matrix in place")
    caps.add_argument("--readme", default="README.md", help="README to update (default: README.md)")
    caps.add_argument("--flower-doc", default="docs/flower.md",
                      help="Flower guide whose Flower DP table --write updates (default: docs/flower.md)")
    caps.add_argument("--secure-doc", default="docs/secure-aggregation.md",
                      help="secure aggregation guide whose table --write updates (default: docs/secure-aggregation.md)")
    caps.add_argument("--strategies-doc", default="docs/strategies.md",
                      help="strategies page whose server optimiser / FedProx table --write updates "
                      "(default: docs/strategies.md)")
    caps.set_defaults(func=_cmd_capabilities)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # stderr carries one thing: the one-line error of a failed command. fedlora's lines (and,
    # with --verbose, everyone's) go to stdout (fedlora.app.quiet); datasets' progress bars are off.
    from fedlora.app.quiet import console_handler

    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    logging.getLogger().addHandler(console_handler(getattr(args, "verbose", False)))
    logging.getLogger("fedlora").setLevel(logging.INFO)
    logging.captureWarnings(True)
    _flower_logs_to_stdout()
    if getattr(args, "ray_address", None):  # --ray-address is federation.ray_address for every run
        args.set = [*args.set, f'federation.ray_address="{args.ray_address}"']
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except _user_errors() as error:
        print(f"fedlora: error: {one_line(str(error))}", file=sys.stderr)
        return USER_ERROR
    except OSError as error:  # a file or folder the system refused (full disk, permissions, ...)
        where = f": {error.filename}" if error.filename else ""
        print(f"fedlora: error: {one_line(error.strerror or str(error))}{where}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print("fedlora: interrupted; results written so far are kept", file=sys.stderr)
        return 130


def _flower_logs_to_stdout() -> None:
    """Flower's logger has its own console handler on stderr: point it at stdout."""
    import flwr  # noqa: F401 - importing Flower attaches its handler to the logger "flwr": redirect that one

    logging.getLogger("flwr").propagate = False  # its own handler prints it: not a second time via the root
    for handler in logging.getLogger("flwr").handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stderr:
            handler.setStream(sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
