"""What does fedlora (Flower + Ray + serialisation) cost on top of a plain PyTorch FedAvg loop?

Runs the same local training twice, under the shared CPU lock
(``flock /tmp/fedlora-cpu.lock python benchmarks/overhead.py``):

(a) **plain**: one process, a Python loop over clients. Each round every client loads the global
    adapter into a model, trains with :func:`fedlora.training.train` on a
    :func:`fedlora.training.make_loader` loader (tokenised once, as fedlora's clients do), and the
    server averages the uploads with :func:`fedlora.lora.weighted_average` (FedAvg = FedIT).
(b) **fedlora**: ``fedlora run`` on Flower's simulation engine (Ray backend), strategy ``fedit``,
    the same config, in a subprocess.

Same model, data, partitions, seeds, local steps, threads (each simulated client gets every core
via ``federation.num_cpus``, so clients train one at a time in both). Evaluation is excluded from
both sides: no personalised evaluation (``federation.fraction_evaluate = 0``), and the global
test evaluation runs only after the last round (``evaluate_every = rounds``), outside the timed
rounds (a round's ``seconds`` in results.json stop before the server's global evaluation).
Tokeniser threads are off on both sides (``TOKENIZERS_PARALLELISM=false``, as fedlora sets it).

Timed: the federated rounds. One-off costs (Ray start, actor start-up with its imports, the
query round, data building) are reported separately. Steady state = rounds 2..R (round 1 also
loads the backbone and tokenises every client's split, on both sides). The machine is shared, so a
steady-state side is its *median* round time x (R - 1): one round slowed by a neighbour's job does
not decide the ratio (the raw round times are printed too). The last line is
``plain_seconds=<x> fedlora_seconds=<y> ratio=<y/x>`` for the steady-state rounds. Each side's
rounds are also split into the clients' training loops (``train-seconds``) and the rest, so the
overhead is visible even when the training loops themselves are slowed by other load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def benchmark_overrides(args: argparse.Namespace) -> list[str]:
    cpus = os.cpu_count() or 1
    return [
        f"model.path={json.dumps(args.model)}",
        f"model.lora_rank={args.rank}",
        f"data.num_clients={args.clients}",
        f"data.max_examples={args.max_examples}",
        f"data.global_test_size={args.global_test}",
        f"train.rounds={args.rounds}",
        f"train.max_steps={args.steps}",
        f"train.batch_size={args.batch_size}",
        f"train.max_length={args.max_length}",
        "train.device=\"cpu\"",
        "strategy.name=\"fedit\"",
        "federation.fraction_train=1.0",
        "federation.fraction_evaluate=0.0",
        f"federation.evaluate_every={args.rounds}",
        f"federation.min_clients={args.clients}",
        f"federation.num_cpus={cpus}",
        "clients.ranks=[]",
        "clients.rank_tiers={}",
        "output.save_adapters=false",
    ]


def plain_fedavg(config) -> dict[str, object]:
    """(a): a plain PyTorch loop over clients with FedAvg, timed per round."""
    import torch

    from fedlora.app.server import GlobalEvaluator
    from fedlora.data import build_federated_data
    from fedlora.lora import weighted_average
    from fedlora.models import adapter_payload, build_model, load_payload, load_tokenizer, resolve_device
    from fedlora.training import make_loader, train

    torch.set_num_threads(max(1, int(config.federation.num_cpus)))
    cfg = config.train
    device = resolve_device(cfg.device)
    federated = build_federated_data(config.data)  # one-off (fedlora: in the query round)
    evaluator = GlobalEvaluator(config, federated)
    global_payload = evaluator.initial_adapter(config.model.lora_rank)  # one-off (fedlora: server start)
    model = tokenizer = None
    round_seconds, train_seconds = [], []
    for server_round in range(1, cfg.rounds + 1):
        started = time.perf_counter()
        if model is None:  # round 1 loads the backbone, as fedlora's clients do
            tokenizer = load_tokenizer(config.model.path)
            model = build_model(config.model, len(federated.label_names), config.model.lora_rank, seed=cfg.seed)
        uploads, weights, trained = [], [], 0.0
        for client in federated.clients:
            load_payload(model, global_payload)
            loader = make_loader(
                client.train, tokenizer, cfg.batch_size, cfg.max_length, shuffle=True,
                seed=cfg.seed + 1000 * server_round + client.partition_id,
                cache_key=f"plain|{client.partition_id}",
            )
            stats = train(model, loader, epochs=cfg.local_epochs, lr=cfg.lr, device=device,
                          max_steps=cfg.max_steps, weight_decay=cfg.weight_decay)
            uploads.append(adapter_payload(model))
            weights.append(len(client.train))
            trained += stats.seconds
        global_payload = weighted_average(uploads, weights)
        round_seconds.append(time.perf_counter() - started)
        train_seconds.append(trained)
    accuracy = evaluator.accuracy(global_payload)  # untimed, as on the fedlora side
    return {"round_seconds": round_seconds, "train_seconds": train_seconds, "global_accuracy": accuracy}


def fedlora_run(config_path: Path, overrides: list[str], out: Path) -> dict[str, object]:
    """(b): ``fedlora run`` on Flower's simulation engine, in a fresh process."""
    command = [sys.executable, "-m", "fedlora.app.cli", "run", str(config_path), "--out", str(out)]
    for override in overrides:
        command += ["--set", override]
    started = time.perf_counter()
    proc = subprocess.run(command, check=False, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - started
    if proc.returncode != 0:
        raise SystemExit(f"fedlora run failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    results = json.loads((out / "results.json").read_text())
    return {
        "round_seconds": [r["seconds"] for r in results["rounds"]],
        "train_seconds": [r["client_train_seconds"] for r in results["rounds"]],
        "global_accuracy": results["final"]["global_accuracy"],
        "wall": wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs/smoke.toml"), help="base config (data source)")
    parser.add_argument("--model", default="minilm")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="local optimiser steps per client and round")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--max-examples", type=int, default=2000)
    parser.add_argument("--global-test", type=int, default=200)
    args = parser.parse_args()

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from fedlora.config import load_config

    overrides = benchmark_overrides(args)
    config = load_config(args.config, overrides)
    print(f"scale: model {args.model} rank {args.rank}, {args.clients} clients, {args.rounds} rounds x "
          f"{args.steps} steps of {args.batch_size} x {args.max_length} tokens, "
          f"{config.federation.num_cpus:g} CPU threads per client", flush=True)

    plain = plain_fedavg(config)
    with tempfile.TemporaryDirectory(prefix="fedlora-overhead-") as tmp:
        fed = fedlora_run(Path(args.config), overrides, Path(tmp))

    plain_rounds, fed_rounds = plain["round_seconds"], fed["round_seconds"]
    for name, side in (("plain  ", plain), ("fedlora", fed)):
        rest = [r - t for r, t in zip(side["round_seconds"], side["train_seconds"], strict=True)]
        print(f"{name} round seconds: " + " ".join(f"{s:.2f}" for s in side["round_seconds"])
              + "   of which clients' training loops: " + " ".join(f"{s:.2f}" for s in side["train_seconds"])
              + "   rest: " + " ".join(f"{s:.2f}" for s in rest))
    one_off = fed["wall"] - sum(fed_rounds)
    print(f"fedlora one-off (process + Ray start, actor start-up, query round, data, final evaluation and "
          f"writing): {one_off:.1f}s of {fed['wall']:.1f}s wall")
    print(f"all rounds (sum): plain {sum(plain_rounds):.2f}s, fedlora {sum(fed_rounds):.2f}s, "
          f"ratio {sum(fed_rounds) / sum(plain_rounds):.3f}")
    print(f"final global accuracy: plain {plain['global_accuracy']:.4f}, fedlora {fed['global_accuracy']:.4f}")
    steady = max(1, len(plain_rounds) - 1)
    steady_plain = statistics.median(plain_rounds[1:] or plain_rounds) * steady
    steady_fed = statistics.median(fed_rounds[1:] or fed_rounds) * steady
    print(f"plain_seconds={steady_plain:.3f} fedlora_seconds={steady_fed:.3f} ratio={steady_fed / steady_plain:.3f}")


if __name__ == "__main__":
    main()
