"""fp32 against bf16 (``train.precision``) on this machine: a LoRA train step and an evaluation batch.

    python benchmarks/precision.py                       # MiniLM, WordNet glosses, 1 thread, 5 pairs
    python benchmarks/precision.py --threads 2 --repeat 7
    python benchmarks/precision.py --quick               # the 2-layer random tiny-bert, a smoke test

Both arms run fedlora's own loops (:func:`fedlora.training.train` and
:func:`fedlora.training.evaluate`) on the same LoRA classifier and the same batches of real
WordNet glosses (one client's training split of configs/quickstart.toml's data), interleaved
fp32 / bf16 through :mod:`harness` after a warm-up each. Figures per run: seconds per train step
(``--steps`` steps of ``--batch-size`` x ``--max-length`` tokens) and per evaluation batch (the
same batches). The last line gives the ratios fp32 / bf16 of the medians (above 1: bf16 is
faster) and whether the CPU computes bf16 natively (:func:`fedlora.training.native_bf16`), which
is what ``train.precision = "auto"`` decides on. Without native bf16 (no AVX512-BF16 / AMX, or
torch's kernels held below AVX-512) bf16 is emulated and far slower: ``auto`` is fp32 there.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness

NAME = "precision"


def build(model_path: str, examples: int, batch_size: int, max_length: int, causal: bool = False):  # type: ignore[no-untyped-def]
    """The LoRA model of configs/quickstart.toml (a classifier on WordNet glosses) or, ``causal``,
    of configs/llm.toml (a causal LM on WordNet definitions as instructions: right-padded, labels
    -100 on the prompt) on ``model_path``, and its first client's training batches (``examples``
    of them), as fedlora's loaders make them."""
    from fedlora.backbones import load_tokenizer
    from fedlora.causal_lm import INSTRUCTIONS
    from fedlora.config import load_config
    from fedlora.data import build_federated_data
    from fedlora.models import build_model
    from fedlora.training import LABELLED_TEXTS, make_loader

    config = load_config(ROOT / ("configs/llm.toml" if causal else "configs/quickstart.toml"), [f"model.path={model_path!r}"])
    federated = build_federated_data(config.data)
    train = federated.client(0).train
    train = train.select(range(min(examples, len(train))))
    model = build_model(config.model, len(federated.label_names), config.model.lora_rank, device="cpu")
    loader = make_loader(train, load_tokenizer(model_path), batch_size, max_length, shuffle=False,
                         rows=INSTRUCTIONS if causal else LABELLED_TEXTS)
    return model, list(loader)


def batch_settings(batches) -> dict[str, object]:  # type: ignore[no-untyped-def]
    """What the batches are: how many, of how many rows, padded to how many tokens at most, and a
    short hash of their token ids (the same data in every arm)."""
    import hashlib

    digest = hashlib.sha256()
    for batch in batches:
        digest.update(batch["input_ids"].numpy().tobytes())
    return {"batches": len(batches), "batch_size": len(batches[0]["labels"]),
            "max_tokens": max(int(batch["input_ids"].shape[1]) for batch in batches),
            "data": digest.hexdigest()[:16]}


def arms(model, batches, steps: int, model_path: str = "") -> dict[str, harness.Arm]:  # type: ignore[no-untyped-def]
    """One arm per precision: ``steps`` train steps, then one evaluation pass over the batches;
    each run reports what it ran at (precision, torch threads, model, steps, batches), the
    precision being the only setting the arms may differ in."""
    import torch

    from fedlora.training import evaluate, train

    cpu = torch.device("cpu")
    shared = {"model": model_path, **batch_settings(batches)}

    def arm(precision: str) -> harness.Arm:
        def run() -> harness.Run:
            stats = train(model, batches, epochs=1, lr=1e-4, device=cpu, max_steps=steps,  # type: ignore[arg-type]
                          precision=precision)  # type: ignore[arg-type]
            started = time.perf_counter()
            evaluate(model, batches, cpu, precision)  # type: ignore[arg-type]
            figures = {"train_step_seconds": stats.seconds / max(stats.steps, 1),
                       "eval_batch_seconds": (time.perf_counter() - started) / len(batches)}
            return harness.Run(figures, {"precision": precision, "threads": torch.get_num_threads(),
                                         "steps": stats.steps, **shared})
        return run

    return {"fp32": arm("fp32"), "bf16": arm("bf16")}


class Batches(list):  # type: ignore[type-arg]
    """The batches as a loader for :func:`fedlora.training.evaluate` (it asks for ``.dataset``)."""

    @property
    def dataset(self) -> list[int]:
        return [0] * sum(len(batch["labels"]) for batch in self)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="minilm", help="model.path (default minilm; --quick: tiny-bert)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a client's federation.num_cpus)")
    parser.add_argument("--steps", type=int, default=8, help="train steps per run (and evaluation batches)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--quick", action="store_true", help="tiny-bert, 2 steps, 1 + 2 runs: a smoke test")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.max_length < 8 or args.threads < 1:
        parser.exit(2, "error: need --steps >= 1, --batch-size >= 1, --max-length >= 8, --threads >= 1\n")
    if args.quick:
        args.model, args.steps = "tiny-bert", 2
    harness.settle(args, NAME, quick=args.quick, repeat=2 if args.quick else harness.DEFAULT_REPEAT)
    import torch

    from fedlora.app.quiet import output
    from fedlora.training import native_bf16

    torch.set_num_threads(args.threads)
    env = harness.environment(args.note)
    native = native_bf16(torch.device("cpu"))
    with output(verbose=False):  # fedlora's lines only
        model, batches = build(args.model, args.steps * args.batch_size, args.batch_size, args.max_length)
        measured = harness.run_interleaved(arms(model, Batches(batches), args.steps, args.model),
                                           repeat=args.repeat, warmup=args.warmup, varies=("precision",))
    train_ratio = harness.compare(measured, "fp32", "bf16", "train_step_seconds")
    eval_ratio = harness.compare(measured, "fp32", "bf16", "eval_batch_seconds")
    print(harness.report(measured, train_ratio))
    print(f"fp32 / bf16 on eval_batch_seconds: ratio of medians {eval_ratio.ratio:.3f}; spread {eval_ratio.spread:.3f}")
    print("ratios are fp32 / bf16 seconds: above 1, bf16 is faster")
    last = (f"train_ratio={train_ratio.ratio:.3f} eval_ratio={eval_ratio.ratio:.3f} "
            f"native_bf16={native} cpu_capability={torch.backends.cpu.get_cpu_capability()} threads={args.threads} "
            f"spread={max(train_ratio.spread, eval_ratio.spread):.2f}")
    extra = {"eval_comparison": eval_ratio, "native_bf16": native,
             "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    return harness.finish(NAME, args, measured, train_ratio, last, extra, env)


if __name__ == "__main__":
    raise SystemExit(main())
