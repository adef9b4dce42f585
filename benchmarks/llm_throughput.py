"""Throughput of a real causal-LM client's local training round, and where the rest of the round goes.

Each timed run is one **train message** handled by fedlora's ClientApp (``fedlora.clients.app.app``, mods
included), exactly as a node handles it: the message is built as the strategy builds it (server
round, the experiment, the client's rank, ``eval-received`` on evaluation rounds) and passed
through Flower's wire format (:func:`fedlora.simulations.inprocess.over_the_wire`); the client resolves
its config and data, swaps the adapter into the process's one base model, loads the download,
evaluates the received model when asked, trains with the strategy's trainer
(``fedlora.clients.trainers``, :func:`fedlora.training.optimise`), keeps its state and replies; the
reply is deflated for the wire. Message after message on the same node (its ``Context`` keeps the
client's state); the download of message ``i`` is the upload of message ``i - 1`` (FedIT's
aggregate of one client), the first message's download the empty initial adapter.

Nothing of the training is re-implemented here: the benchmark only *observes* it. While a message
runs, :class:`Probe` wraps :func:`fedlora.training.optimise` (its wall time; the loader it
iterates is wrapped to count the **non-padding input tokens** of the batches trained, prompt and
response, and the time spent fetching / collating batches), the trainer's ``fit`` (its wall time)
and ``received_metrics`` (the received-model evaluation). The reply's own start-up metrics
(``setup-<phase>-seconds``) give the set-up phases. Per message (seconds):

- ``steps``: forward + backward + optimiser steps = optimise wall - batch fetching;
- ``batches``: fetching and collating the batches inside the step loop;
- ``data_prep``: ``fit`` outside the step loop (tokenising the split on first use, the loader,
  the optimiser's construction);
- ``setup_libraries`` / ``setup_data`` / ``setup_model`` / ``setup_adapter``: the ClientApp's
  phases (heavy imports; config, profile and data; the base model, once per process; the
  adapter swap and the download loaded);
- ``received_eval``: the received model, teacher-forced on the local test split;
- ``reply_wire``: the reply deflated as Flower sends it;
- ``upload_other``: the rest (upload and kept-state payloads, checkpointing, the reply's records).

``overhead_fraction = (round - steps) / round``; ``tokens_per_second`` = tokens / round (what a
client delivers), ``step_tokens_per_second`` = tokens / steps. ``--repeat`` timed messages after
``--warmup`` discarded ones (the first also loads the base model and tokenises), through
:mod:`harness`: min / median / max of every figure, printed, written to the JSON record
(``benchmarks/results/llm_throughput-<device>.json``, with the machine: CPU model and cores,
torch threads and version, device, dtype, GPU name) and a markdown table beside it (``.md``).

Device and precision are the trainer's: ``--dtype`` is ``train.precision`` (bf16 autocast of the
forward pass, :func:`fedlora.training.autocast`, or fp32; ``auto``: bf16 where the device computes
it natively, :func:`fedlora.training.resolve_precision`). ``--threads`` is the client's
``federation.num_cpus`` (the ClientApp sets torch's threads from it).

    python benchmarks/llm_throughput.py --device cpu --threads 2 --steps 8 --repeat 3   # SmolLM2 on CPU
    python benchmarks/llm_throughput.py --device cuda --dtype bf16 --threads 4          # SmolLM2 on a GPU
    python benchmarks/llm_throughput.py --model tiny-llama --steps 2 --repeat 1         # seconds: a smoke test

The last line is ``tokens_per_second=<median> overhead_fraction=<median> steps_seconds=<median>
round_seconds=<median>``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import platform
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # the repository, then benchmarks/ (for harness)

import harness

CONFIG = ROOT / "configs" / "llm.toml"
PARTS = ("steps", "batches", "data_prep", "setup_libraries", "setup_data", "setup_model", "setup_adapter",
         "received_eval", "reply_wire", "upload_other")  # the round's wall time, split
PART_HELP = {
    "steps": "forward + backward + optimiser steps",
    "batches": "fetching / collating batches in the step loop",
    "data_prep": "fit outside the step loop (tokenising, loader, optimiser set-up)",
    "setup_libraries": "heavy imports (cached after the first message)",
    "setup_data": "config, profile, the client's data",
    "setup_model": "base model and tokenizer (once per process)",
    "setup_adapter": "adapter swap + download loaded",
    "received_eval": "received model evaluated (teacher-forced, local test split)",
    "reply_wire": "reply deflated for the wire",
    "upload_other": "upload / kept-state payloads, checkpoint, reply records",
}


class TimedLoader:
    """Iterates a loader; counts the non-padding input tokens of the batches it hands out and the
    time spent producing them."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.tokens = 0
        self.batches = 0
        self.seconds = 0.0

    def __iter__(self) -> Iterator[Any]:
        iterator = iter(self.loader)
        while True:
            started = time.perf_counter()
            try:
                batch = next(iterator)
            except StopIteration:
                self.seconds += time.perf_counter() - started
                return
            self.seconds += time.perf_counter() - started
            self.tokens += int(batch["attention_mask"].sum())
            self.batches += 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)


class Probe:
    """Observes one message: wall times of ``optimise``, the trainer's ``fit`` and
    ``received_metrics``, and the loader of the step loop (:class:`TimedLoader`)."""

    def __init__(self) -> None:
        self.seconds = {"optimise": 0.0, "fit": 0.0, "received_eval": 0.0}
        self.loaders: list[TimedLoader] = []
        self.sync: Any = None  # torch.cuda.synchronize on CUDA: a wall time ends when the GPU is done

    def _timed(self, name: str, function: Any) -> Any:
        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.sync is not None:
                self.sync()
            started = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                if self.sync is not None:
                    self.sync()
                self.seconds[name] += time.perf_counter() - started
        return wrapper

    @contextlib.contextmanager
    def watching(self, trainer_cls: type) -> Iterator[Probe]:
        from unittest import mock

        import fedlora.training

        real_optimise = fedlora.training.optimise

        def optimise(model: Any, loader: Any, *args: Any, **kwargs: Any) -> Any:
            timed = TimedLoader(loader)
            self.loaders.append(timed)
            return real_optimise(model, timed, *args, **kwargs)

        with mock.patch.object(fedlora.training, "optimise", self._timed("optimise", optimise)), \
                mock.patch.object(trainer_cls, "fit", self._timed("fit", trainer_cls.fit)), \
                mock.patch.object(trainer_cls, "received_metrics",
                                  self._timed("received_eval", trainer_cls.received_metrics)):
            yield self


def machine(device: str, dtype: str, threads: int) -> dict[str, Any]:
    """What the figures were measured on: CPU model and cores, torch threads and version, device,
    dtype, GPU name (cuda)."""
    import os

    import torch

    env = harness.environment()
    return {"cpu_model": env["cpu_model"], "cpu_count": os.cpu_count(), "cpus_usable": env["cpus_usable"],
            "torch_threads": threads, "torch_version": torch.__version__, "device": device, "dtype": dtype,
            "gpu_name": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "python": platform.python_version(), "platform": platform.platform()}


class Client:
    """One node of ``configs/llm.toml`` (client ``--client``) receiving train messages."""

    def __init__(self, args: argparse.Namespace) -> None:
        from fedlora.clients.app import app
        from fedlora.clients.trainers import trainer_class
        from fedlora.config import load_config
        from fedlora.simulations.inprocess import InProcessGrid, node_configs

        overrides = [f"model.path={args.model!r}", f"train.device={args.device!r}", f"train.precision={args.dtype!r}",
                     f"train.max_steps={args.steps}", f"train.batch_size={args.batch_size}",
                     f"train.max_length={args.max_length}", f"federation.num_cpus={args.threads}", *args.set]
        self.config = load_config(args.config, overrides)
        self.args = args
        self.trainer_cls = trainer_class(self.config.strategy.name)
        num_clients = self.config.data.num_clients
        if not 0 <= args.client < num_clients:
            raise ValueError(f"--client {args.client}: the config has clients 0..{num_clients - 1}")
        # the in-process engine's nodes (Flower's task identity set, as the simulation engine does);
        # the benchmark calls the ClientApp itself to time the handler and the reply's wire apart
        grid = InProcessGrid(app, node_configs(num_clients))
        self.context = grid.contexts[1000 + args.client]
        self.download: dict[str, Any] = {}  # the empty initial adapter: the client's seeded start
        self.server_round = 0
        self.threads = 0
        self.last_probe: Probe | None = None
        self.last_reply: dict[str, float] = {}

    def message(self) -> Any:
        """The next train message, as the strategy builds it and the node receives it."""
        from flwr.app import ConfigRecord, Message, MessageType, RecordDict

        from fedlora import protocol
        from fedlora.lora import to_array_record
        from fedlora.simulations.inprocess import over_the_wire
        from fedlora.strategies.base import evaluation_round

        self.server_round += 1
        cfg = self.config
        config = ConfigRecord({protocol.SERVER_ROUND: self.server_round, protocol.EXPERIMENT: cfg.to_json(),
                               protocol.RANK: cfg.model.lora_rank})
        if evaluation_round(cfg, self.server_round):  # the strategy's own rule
            config[protocol.EVAL_RECEIVED] = True
        content = RecordDict({protocol.ARRAYS_RECORD: to_array_record(self.download), protocol.CONFIG_RECORD: config})
        return over_the_wire(Message(content=content, dst_node_id=self.context.node_id, message_type=MessageType.TRAIN))

    def round(self) -> harness.Run:
        """One train message, observed; its figures (seconds by part, tokens, rates) and the
        settings it ran at (precision and torch threads as the client reported them)."""
        import torch

        from fedlora import protocol
        from fedlora.clients.app import app
        from fedlora.lora import from_array_record
        from fedlora.simulations.inprocess import deflate

        message = self.message()
        probe = Probe()
        if self.args.device == "cuda":
            probe.sync = torch.cuda.synchronize
            torch.cuda.synchronize()
        with probe.watching(self.trainer_cls):
            started = time.perf_counter()
            reply = app(message, self.context)
            wire_started = time.perf_counter()
            deflate(reply)
            ended = time.perf_counter()
        if reply.has_error():
            raise RuntimeError(f"the client failed: {reply.error.reason}")
        self.threads = torch.get_num_threads()  # as the ClientApp set them (federation.num_cpus)
        metrics = {key: float(value) for key, value in reply.content.metric_records[protocol.METRICS_RECORD].items()
                   if isinstance(value, (int, float))}
        self.download = from_array_record(reply.content.array_records[protocol.ARRAYS_RECORD])
        self.last_probe, self.last_reply = probe, metrics
        [loader] = probe.loaders  # one step loop per message
        round_seconds = ended - started
        parts = {
            "steps": probe.seconds["optimise"] - loader.seconds,
            "batches": loader.seconds,
            "data_prep": probe.seconds["fit"] - probe.seconds["optimise"],
            "setup_libraries": metrics.get(protocol.SETUP_LIBRARIES_SECONDS, 0.0),
            "setup_data": metrics.get(protocol.SETUP_DATA_SECONDS, 0.0),
            "setup_model": metrics.get(protocol.SETUP_MODEL_SECONDS, 0.0),
            "setup_adapter": metrics.get(protocol.SETUP_ADAPTER_SECONDS, 0.0),
            "received_eval": probe.seconds["received_eval"],
            "reply_wire": ended - wire_started,
        }
        parts["upload_other"] = round_seconds - sum(parts.values())
        worker = reply.content.config_records[protocol.WORKER_RECORD]
        settings = {"precision": str(worker[protocol.WORKER_PRECISION]), "threads": int(str(worker[protocol.WORKER_THREADS])),
                    "device": self.args.device, "model": self.args.model, "steps": self.args.steps,
                    "batch_size": self.args.batch_size, "max_length": self.args.max_length, "client": self.args.client}
        figures = {"round_seconds": round_seconds, **{f"{k}_seconds": v for k, v in parts.items()},
                   "overhead_fraction": (round_seconds - parts["steps"]) / round_seconds,
                   "tokens": float(loader.tokens), "steps": metrics[protocol.TRAIN_STEPS],
                   "tokens_per_second": loader.tokens / round_seconds,
                   "step_tokens_per_second": loader.tokens / parts["steps"],
                   "train_seconds_reported": metrics[protocol.TRAIN_SECONDS]}
        return harness.Run(figures, settings)


def markdown(summary: dict[str, harness.Stats], info: dict[str, Any], args: argparse.Namespace) -> str:
    """The medians with min / max as a markdown table, and the machine."""
    def row(label: str, key: str, digits: int) -> str:
        s = summary[key]
        return f"| {label} | {s.median:.{digits}f} | {s.min:.{digits}f} | {s.max:.{digits}f} |"

    head = (f"Client {args.client} of `{Path(args.config).name}`, model `{args.model}`, {args.steps} steps x batch "
            f"{args.batch_size} x <= {args.max_length} tokens per message; {summary['round_seconds'].n} messages "
            f"after {args.warmup} warm-up.")
    lines = [head, "",
             "| figure | median | min | max |", "|---|---:|---:|---:|",
             row("tokens / s per client (tokens / round wall)", "tokens_per_second", 1),
             row("tokens / s in the steps (tokens / steps time)", "step_tokens_per_second", 1),
             row("overhead fraction (round - steps) / round", "overhead_fraction", 4),
             row("non-padding tokens trained per message", "tokens", 0),
             row("round wall (s)", "round_seconds", 3)]
    lines += [row(f"- {part} (s): {PART_HELP[part]}", f"{part}_seconds", 3) for part in PARTS]
    lines += ["", "| machine | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in info.items()]
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model.path: smollm2, tiny-llama or a local folder")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the experiment (default configs/llm.toml)")
    parser.add_argument("--client", type=int, default=0, help="the client (partition) whose messages are timed")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="train.device; auto: cuda when a GPU is present, else cpu")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help="train.precision: bf16 autocast or fp32 (auto: bf16 where the device computes it "
                        "natively)")
    parser.add_argument("--steps", type=int, default=20, help="train.max_steps: local steps per message")
    parser.add_argument("--batch-size", type=int, default=8, help="train.batch_size")
    parser.add_argument("--max-length", type=int, default=96, help="train.max_length (tokens per example)")
    parser.add_argument("--threads", type=int, default=1,
                        help="federation.num_cpus: the client's torch threads (the ClientApp sets them)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="further config overrides, as the CLI's --set (repeatable)")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "error: --device cuda, but torch sees no GPU\n")
    from fedlora.training import resolve_precision

    args.dtype = resolve_precision(args.dtype, torch.device(args.device))
    if args.steps < 1 or args.batch_size < 1 or args.max_length < 8 or args.threads < 1:
        parser.exit(2, "error: need --steps >= 1, --batch-size >= 1, --max-length >= 8, --threads >= 1\n")
    harness.settle(args, f"llm_throughput-{args.device}")
    env = harness.environment(args.note)
    from fedlora.app.quiet import output

    with output(verbose=False):  # fedlora's lines, not the libraries' warnings and progress bars
        try:
            client = Client(args)
        except ValueError as error:  # ConfigError and the like: one line, exit 2
            parser.exit(2, f"error: {error}\n")
        measured = harness.run_interleaved({"round": client.round}, repeat=args.repeat, warmup=args.warmup)
    summary = harness.describe(measured.samples["round"])
    info = machine(args.device, args.dtype, client.threads)
    print(harness.report(measured, digits=4))
    where = info["gpu_name"] or f"{info['cpu_model']}, {info['torch_threads']} torch threads"
    print(f"{args.device} {args.dtype} ({where}), torch {info['torch_version']}: {args.model}, batch {args.batch_size} "
          f"x <= {args.max_length} tokens, {args.steps} steps per message, {args.repeat} messages after "
          f"{args.warmup} warm-up")
    med = {key: stats.median for key, stats in summary.items()}
    last = (f"tokens_per_second={med['tokens_per_second']:.1f} overhead_fraction={med['overhead_fraction']:.4f} "
            f"steps_seconds={med['steps_seconds']:.3f} round_seconds={med['round_seconds']:.3f}")
    data = harness.record("llm_throughput", args, measured, None, last, extra={"machine": info, "parts": PART_HELP},
                          env=env)
    data["machine"] = data["extra"]["machine"]
    path = harness.write_record(args.out, data)
    table = Path(path).with_suffix(".md")
    table.write_text(markdown(summary, info, args))
    print(f"record: {path}  table: {table}")
    print(last)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
