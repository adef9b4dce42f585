"""Throughput of one client's LoRA training on a causal LM, and the per-message overhead.

A client in a federated round receives an adapter, swaps it into the process's one base model
(:func:`fedlora.models.build_model` unloads the previous adapter and wraps the base again; the base
is never copied), loads the downloaded factors (:func:`fedlora.models.load_payload`), builds its
AdamW optimiser, then trains ``--steps`` local steps with fedlora's loop
(:func:`fedlora.training.optimise` on :func:`fedlora.causal_lm.causal_lm_loss`). This script times
exactly that, message after message, on client 0 of ``configs/llm.toml`` (SmolLM2-135M-Instruct,
WordNet definitions):

- ``tokens_per_second``: input tokens (prompt + response, padding excluded) per second of the
  training loop;
- ``overhead_fraction``: (adapter swap + payload load + optimiser setup) / training-loop time of
  the same message.

The first message also loads the base model and is reported apart (warm-up, one step); the figures
are medians over the ``--messages`` that follow. It measures the CPU, and CUDA too when a GPU is
present (bf16 there). The last line is ``tokens_per_second=<x> overhead_fraction=<y>`` of the last
device measured (CUDA when present). Goal (GPU, 20 local steps): overhead_fraction <= 0.05.

    python benchmarks/llm_throughput.py                      # SmolLM2, 20 steps, batch 8, 96 tokens
    python benchmarks/llm_throughput.py --steps 5 --batch-size 4 --max-length 64 --messages 2   # CPU, quicker
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


class CountingLoader:
    """Iterates a loader and counts the non-padding input tokens of the batches it hands out."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.tokens = 0

    def __iter__(self) -> Any:
        for batch in self.loader:
            self.tokens += int(batch["attention_mask"].sum())
            yield batch

    def __len__(self) -> int:
        return len(self.loader)


def measure(args: argparse.Namespace, device_name: str) -> tuple[float, float]:
    """(median tokens / s, median overhead fraction) of ``args.messages`` messages on one device."""
    import torch

    from fedlora.causal_lm import causal_lm_loss, make_causal_loader
    from fedlora.config import load_config
    from fedlora.data import build_federated_data
    from fedlora.models import adapter_payload, build_model, load_payload, load_tokenizer, resolve_device
    from fedlora.training import optimise

    config = load_config(ROOT / "configs/llm.toml", [f"model.path={args.model!r}", f"train.device={device_name!r}"])
    device = resolve_device(device_name)
    federated = build_federated_data(config.data)
    tokenizer = load_tokenizer(config.model.path)
    train_split = federated.client(0).train
    payload: dict[str, Any] = {}
    rates, fractions = [], []
    for message in range(args.messages + 1):
        steps = 1 if message == 0 else args.steps
        loader = CountingLoader(make_causal_loader(train_split, tokenizer, args.batch_size, args.max_length,
                                                   shuffle=True, seed=message, cache_key=f"bench|{args.max_length}"))
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        model = build_model(config.model, len(federated.label_names), config.model.lora_rank, seed=message,
                            device=device_name)  # the adapter swap on the one base model
        if payload:
            load_payload(model, payload)  # the download
        model.to(device).train()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.train.lr)
        if device.type == "cuda":
            torch.cuda.synchronize()
        overhead = time.perf_counter() - started
        stats = optimise(model, loader, optimizer, epochs=100, max_steps=steps, loss_fn=causal_lm_loss,
                         autocast_device=device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        payload = adapter_payload(model)  # the upload, which the next message downloads
        rate, fraction = loader.tokens / stats.seconds, overhead / stats.seconds
        label = "warm-up (loads the base model)" if message == 0 else f"message {message}"
        print(f"{device.type} {label}: swap+optimiser {overhead:.3f} s, {stats.steps} steps in {stats.seconds:.2f} s, "
              f"{loader.tokens} tokens, {rate:.1f} tokens/s, overhead fraction {fraction:.4f}", flush=True)
        if message:
            rates.append(rate)
            fractions.append(fraction)
    return statistics.median(rates), statistics.median(fractions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model.path: smollm2, tiny-llama or a local folder")
    parser.add_argument("--steps", type=int, default=20, help="local steps per message")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--messages", type=int, default=3, help="timed messages after the warm-up one")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for device in devices:
        rate, fraction = measure(args, device)
        name = torch.cuda.get_device_name(0) if device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
        print(f"{device} ({name}): {args.model}, batch {args.batch_size} x <= {args.max_length} tokens, "
              f"{args.steps} steps per message: tokens/s {rate:.1f}, overhead fraction {fraction:.4f}", flush=True)
    print(f"tokens_per_second={rate:.1f} overhead_fraction={fraction:.4f}")


if __name__ == "__main__":
    main()
