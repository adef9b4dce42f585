"""The ``fedlora`` command line.

    fedlora run CONFIG [--set key=value ...] [--out DIR] [--verbose] [--resume DIR | --overwrite]
                   [--engine ray|inprocess] [--ray-address HOST:PORT]
    fedlora compare CONFIG --strategies a,b,... [--seeds 0,1,2] [--out DIR] [--set k=v ...]
                   [--engine ray|inprocess] [--workers N] [--fresh-partitions] [--resume | --overwrite]
                   [--paired BASELINE [--primary LABEL] [--primary-metric METRIC]]
    fedlora tune CONFIG --strategies a,b --grid train.lr=1e-4,1e-3 [--seeds 0,1] [--out DIR]
                   [--resume | --overwrite]
    fedlora export ADAPTER --out DIR
    fedlora eval ADAPTER --data FILE [--text-column C] [--label-column C] [--batch-size N]
    fedlora strategies
    fedlora deploy certs DIR [--hosts HOST ...] [--nodes N]
    fedlora deploy local CONFIG --nodes N [--insecure] [--clientapp warm|cold] [--out DIR] [--set k=v ...] [--resume | --overwrite]
    fedlora deploy operator DIR [--address HOST:PORT --silos NAME ... [--silo-key NAME=PUB ...] [--config CONFIG]
                   [--listen IP] [--control-port N] [--days N]]
    fedlora deploy silo KIT --data FILE [--key PRIVATE_KEY] [--host IP] [--port N] [--clientapp warm|cold] [--rank N]
    fedlora deploy run DIR CONFIG [--set k=v ...] [--out DIR] [--overwrite] [--timeout S] [--join-timeout S]

A user mistake (bad config, missing model or data, unknown strategy, an output folder that cannot
be written, a corrupt checkpoint, a missing or unknown argument) prints one line on stderr and exits
with status 2; nothing
already written (results, adapters) is removed. An output folder that holds an earlier run is
never written into unless --resume continues it, nor removed: --overwrite moves it aside
(fedlora/app/folders.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
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


def _cmd_export(args: argparse.Namespace) -> int:
    from fedlora.app.adapters import export

    out = export(args.adapter, args.out)
    print(f"merged model: {out}/ (transformers' AutoModelFor... loads it without peft; model card: README.md)")
    return 0


def _cmd_eval(args: argparse.Namespace) -> int:
    from fedlora.app.adapters import evaluate_file
    from fedlora.config import ConfigError

    if args.batch_size is not None and args.batch_size < 1:
        raise ConfigError(f"--batch-size must be a positive integer, got {args.batch_size}")
    scores = evaluate_file(args.adapter, args.data, args.text_column, args.label_column, args.batch_size)
    print(scores.line())
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


def _cmd_deploy_operator(args: argparse.Namespace) -> int:
    from fedlora.app.deploy.roles import operator

    operator(args.dir, address=args.address, listen=args.listen, control_port=args.control_port, silos=args.silos,
             silo_keys=args.silo_key, config=args.config, days=args.days)
    return 0


def _cmd_deploy_silo(args: argparse.Namespace) -> int:
    from fedlora.app.deploy.roles import silo

    silo(args.kit, args.data, key=args.key, host=args.host, port=args.port, clientapp=args.clientapp, rank=args.rank)
    return 0


def _cmd_deploy_run(args: argparse.Namespace) -> int:
    from fedlora.app.deploy.roles import submit

    results = submit(args.dir, args.config, overrides=args.set, out_dir=args.out, timeout=args.timeout,
                     join_timeout=args.join_timeout, overwrite=args.overwrite)
    out = results["config"]["output"]["dir"]
    print(f"{_final_scores(results)}, {results['final'].get('bytes_total', 0) / 1e6:.2f} MB "
          f"in {results['deployment']['seconds']:.0f}s ({results['deployment']['silos']} silos, gRPC over TLS)")
    print(f"results: {out}/results.json")
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


class _Parser(argparse.ArgumentParser):
    """argparse's parser whose usage errors (a missing or unknown argument) are one line, exit 2."""

    def error(self, message: str) -> Any:
        self.exit(USER_ERROR, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from fedlora.version import __version__

    parser = _Parser(prog="fedlora", description="Federated LoRA fine-tuning on Flower.")
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

    _add_federation_roles(deploy_sub)
    export = sub.add_parser("export", help="merge a saved adapter into its backbone: a model transformers loads "
                            "without peft")
    export.add_argument("adapter", help="a run's adapter folder (adapters/global or adapters/client_<k>)")
    export.add_argument("--out", required=True, help="new or empty folder for the merged model")
    export.set_defaults(func=_cmd_export)

    evaluate = sub.add_parser("eval", help="score a saved adapter on a .csv / .jsonl / .json file")
    evaluate.add_argument("adapter", help="a run's adapter folder (adapters/global or adapters/client_<k>)")
    evaluate.add_argument("--data", required=True, help="the file: a text and a label column (classifier), or a "
                          "prompt and a response column (causal LM)")
    evaluate.add_argument("--text-column", default=None, help="default: text (classifier), prompt (causal LM)")
    evaluate.add_argument("--label-column", default=None,
                          help="default: label (classifier: class names or indices), response (causal LM)")
    evaluate.add_argument("--batch-size", type=int, default=None, help="default: the run's train.eval_batch_size")
    evaluate.set_defaults(func=_cmd_eval)

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


def _add_federation_roles(deploy_sub: Any) -> None:
    """``deploy operator`` / ``deploy silo`` / ``deploy run``: a federation of separate hosts
    (fedlora/app/deploy/roles.py, docs/deployment.md)."""
    op = deploy_sub.add_parser("operator", help="write a federation (first time), start its SuperLink (TLS + node "
                               "authentication) and print each silo's command; stays up")
    op.add_argument("dir", help="the federation's folder (federation.json, certs/, silos/<name>/ kits, logs/)")
    op.add_argument("--address", default=None, metavar="HOST:PORT",
                    help="first time: the SuperLink's Fleet API as the silos dial it (its certificate names HOST)")
    op.add_argument("--silos", nargs="+", default=[], metavar="NAME",
                    help="first time: the silos, in partition order; the operator writes each one's key pair")
    op.add_argument("--silo-key", action="append", default=[], metavar="NAME=PUB",
                    help="first time: a silo that made its own key pair (its OpenSSH public key; repeatable)")
    op.add_argument("--config", default=None, help="first time: the experiment whose columns and class names each "
                    "silo's data is checked against when it joins")
    op.add_argument("--listen", default=None, metavar="IP",
                    help="first time: the address the Fleet API binds (default: HOST when it is an IP, else 0.0.0.0)")
    op.add_argument("--control-port", type=int, default=None,
                    help="first time: the Control API's port on 127.0.0.1 (default 9093; runs are submitted there)")
    op.add_argument("--days", type=int, default=365, help="first time: how long the certificates are valid")
    op.set_defaults(func=_cmd_deploy_operator)
    silo = deploy_sub.add_parser("silo", help="join a federation with this host's data: a SuperNode and its "
                                 "ClientApp process, up across runs")
    silo.add_argument("kit", help="the silo's kit, the folder the operator wrote for it (silo.json, ca.crt, node.key)")
    silo.add_argument("--data", required=True, help="this silo's data: a CSV / JSONL / JSON file or a save_to_disk folder")
    silo.add_argument("--key", default=None, help="the silo's own private key (default: the kit's node.key)")
    silo.add_argument("--host", default="127.0.0.1", metavar="IP",
                      help="this host's address for the SuperNode's Runtime API (never exposed; default 127.0.0.1)")
    silo.add_argument("--port", type=int, default=9094, help="the SuperNode's Runtime API port (default 9094)")
    silo.add_argument("--clientapp", choices=("warm", "cold"), default="warm",
                      help="warm: ClientApp processes forked from fedlora's SuperExec (libraries imported once); "
                           "cold: Flower's own SuperExec")
    silo.add_argument("--rank", type=int, default=None, help="the LoRA rank this silo declares (default: the experiment's)")
    silo.set_defaults(func=_cmd_deploy_silo)
    run = deploy_sub.add_parser("run", help="submit CONFIG to the running federation and follow it: round lines "
                                "as it trains, then the results' path")
    run.add_argument("dir", help="the federation's folder (on the operator's host)")
    run.add_argument("config", help="TOML experiment config")
    _add_set(run)
    run.add_argument("--out", default=None, help="output folder on the operator's host (default: output.dir)")
    _add_overwrite(run, "run")
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds to wait for the run (then stop it)")
    run.add_argument("--join-timeout", type=float, default=300.0,
                     help="seconds to wait until every silo is online before submitting")
    run.set_defaults(func=_cmd_deploy_run)


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
    from fedlora.app.adapters import COMMAND_ENV

    outer = os.environ.get(COMMAND_ENV)  # the command that makes a run's adapters: their model cards say it
    os.environ[COMMAND_ENV] = outer or shlex.join(["fedlora", *(sys.argv[1:] if argv is None else argv)])
    try:
        return func(args)
    except _user_errors() as error:
        for line in getattr(error, "lines", None) or [str(error)]:  # a preflight: one line per failed check
            print(f"fedlora: error: {one_line(line)}", file=sys.stderr)
        return USER_ERROR
    except OSError as error:  # a file or folder the system refused (full disk, permissions, ...)
        where = f": {error.filename}" if error.filename else ""
        print(f"fedlora: error: {one_line(error.strerror or str(error))}{where}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt as interrupt:  # Ctrl-C: 130; SIGTERM / SIGHUP of a deployment: 128 + signal
        import signal

        signum = getattr(interrupt, "signum", signal.SIGINT)  # fedlora.app.deploy.processes.Terminated
        what = "interrupted" if signum == signal.SIGINT else f"stopped by {signal.Signals(signum).name}"
        print(f"fedlora: {what}; results written so far are kept", file=sys.stderr)
        return 128 + signum
    finally:
        if outer is None:
            os.environ.pop(COMMAND_ENV, None)
        else:
            os.environ[COMMAND_ENV] = outer


def _flower_logs_to_stdout() -> None:
    """Flower's logger has its own console handler on stderr: point it at stdout."""
    import flwr  # noqa: F401 - importing Flower attaches its handler to the logger "flwr": redirect that one

    logging.getLogger("flwr").propagate = False  # its own handler prints it: not a second time via the root
    for handler in logging.getLogger("flwr").handlers:
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) is sys.stderr:
            handler.setStream(sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
