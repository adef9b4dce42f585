"""Throughput of one client's LoRA training on a causal LM, and the per-message overhead.

A client in a federated round receives an adapter, swaps it into the process's one base model
(:func:`fedlora.models.build_model` unloads the previous adapter and wraps the base again; the base
is never copied), loads the downloaded factors (:func:`fedlora.models.load_payload`), builds its
AdamW optimiser, then trains ``--steps`` local steps with fedlora's loop
(:func:`fedlora.training.optimise` on :func:`fedlora.causal_lm.causal_lm_loss`). This script times
exactly that, message after message, on client 0 of ``configs/llm.toml`` (SmolLM2-135M-Instruct,
WordNet definitions), as two arms of :mod:`harness` (benchmarks/harness.py):

- ``swap``: adapter swap + payload load + optimiser set-up of one message (``seconds``);
- ``train``: that message's training loop (``seconds``, ``tokens``: input tokens, prompt +
  response, padding excluded, and ``tokens_per_second``); its upload is the next message's
  download.

The harness runs them in message order, swap train swap train ..., after ``--warmup`` discarded
messages (default 1: the first also loads the base model), ``--repeat`` times (default 5). Pair i is
message i, so the ratio of the medians swap / train is the **overhead fraction**, and ``spread=`` is
max / min of the per-message fractions. One device per run: ``--device`` (default ``cuda`` when
a GPU is present, bf16 there, else ``cpu``). The last line is
``tokens_per_second=<median> overhead_fraction=<ratio of medians> spread=<...>``; the JSON record
(``benchmarks/results/llm_throughput-<device>.json`` by default) holds the machine and every
message. Goal (GPU, 20 local steps): overhead_fraction <= 0.05.

    python benchmarks/llm_throughput.py                      # SmolLM2, 20 steps, batch 8, 96 tokens, 5 messages
    python benchmarks/llm_throughput.py --steps 4 --batch-size 4 --max-length 64 --repeat 3   # CPU, quicker
    python benchmarks/llm_throughput.py --model tiny-llama --steps 2 --repeat 2              # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # the repository, then benchmarks/ (for harness)

import harness


class CountingLoader:
    """Iterates a loader and counts the non-padding input tokens of the batches it hands out."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.tokens = 0

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            self.tokens += int(batch["attention_mask"].sum())
            yield batch

    def __len__(self) -> int:
        return len(self.loader)


class Client:
    """Client 0 of ``configs/llm.toml`` on one device, message after message.

    :meth:`swap` and :meth:`train` are the two arms; they must alternate (the harness runs them in
    that order within every pair), as a client's messages do.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from fedlora.backbones import load_tokenizer, resolve_device
        from fedlora.config import load_config
        from fedlora.data import build_federated_data

        self.torch = torch
        self.args = args
        self.config = load_config(ROOT / "configs/llm.toml",
                                  [f"model.path={args.model!r}", f"train.device={args.device!r}"])
        self.device = resolve_device(args.device)
        self.federated = build_federated_data(self.config.data)
        self.tokenizer = load_tokenizer(self.config.model.path)
        self.split = self.federated.client(0).train
        self.payload: dict[str, Any] = {}
        self.message = 0
        self.model: Any = None
        self.optimizer: Any = None

    def _sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def swap(self) -> dict[str, float]:
        """A new message arrives: swap the adapter in, load the download, build the optimiser."""
        from fedlora.models import build_model, load_payload

        self._sync()
        started = time.perf_counter()
        self.model = build_model(self.config.model, len(self.federated.label_names), self.config.model.lora_rank,
                                 seed=self.message, device=self.args.device)
        if self.payload:
            load_payload(self.model, self.payload)
        self.model.to(self.device).train()
        self.optimizer = self.torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad],
                                                lr=self.config.train.lr)
        self._sync()
        return {"seconds": time.perf_counter() - started}

    def train(self) -> dict[str, float]:
        """The message's local steps; its upload becomes the next message's download."""
        from fedlora.causal_lm import causal_lm_loss, make_causal_loader
        from fedlora.models import adapter_payload
        from fedlora.training import optimise

        if self.model is None:
            raise RuntimeError("train before swap: the arms must alternate swap, train")
        a = self.args
        loader = CountingLoader(make_causal_loader(self.split, self.tokenizer, a.batch_size, a.max_length,
                                                   shuffle=True, seed=self.message,
                                                   cache_key=f"bench|{a.max_length}"))
        self._sync()
        stats = optimise(self.model, loader, self.optimizer, epochs=100, max_steps=a.steps,
                         loss_fn=causal_lm_loss, autocast_device=self.device)
        self._sync()
        self.payload = adapter_payload(self.model)
        self.model = self.optimizer = None
        self.message += 1
        return {"seconds": stats.seconds, "tokens": float(loader.tokens),
                "tokens_per_second": loader.tokens / stats.seconds, "steps": float(stats.steps)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="model.path: smollm2, tiny-llama or a local folder")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="one device per run; auto: cuda when a GPU is present, else cpu")
    parser.add_argument("--steps", type=int, default=20, help="local steps per message")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    import torch

    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.exit(2, "error: --device cuda, but torch sees no GPU\n")
    if args.steps < 1 or args.batch_size < 1 or args.max_length < 8 or args.threads < 0:
        parser.exit(2, "error: need --steps >= 1, --batch-size >= 1, --max-length >= 8, --threads >= 0\n")
    harness.settle(args, f"llm_throughput-{args.device}")
    if args.threads:
        torch.set_num_threads(args.threads)
    env = harness.environment(args.note)
    client = Client(args)
    measured = harness.run_interleaved({"swap": client.swap, "train": client.train},
                                       repeat=args.repeat, warmup=args.warmup)
    comparison = harness.compare(measured, "swap", "train", "seconds")
    tokens = harness.describe(measured.samples["train"])["tokens_per_second"].median
    where = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(harness.report(measured, comparison, digits=4))
    print(f"{args.device} ({where}): {args.model}, batch {args.batch_size} x <= {args.max_length} tokens, "
          f"{args.steps} steps per message, {args.repeat} messages after {args.warmup} warm-up")
    last = f"tokens_per_second={tokens:.1f} overhead_fraction={comparison.ratio:.4f} spread={comparison.spread:.2f}"
    extra = {"device_name": where, "threads": torch.get_num_threads()}
    return harness.finish("llm_throughput", args, measured, comparison, last, extra, env)


if __name__ == "__main__":
    raise SystemExit(main())
