"""A client's train and evaluation step against this machine's limit: the matrix-product ceiling,
then fedlora's own step in fp32, bf16 and compiled, with tokens/s and the fraction of the ceiling.

    python benchmarks/step.py                  # MiniLM, WordNet glosses, 1 thread, 5 interleaved repeats
    python benchmarks/step.py --threads 2      # a client with two cores (federation.num_cpus = 2)
    python benchmarks/step.py --model smollm2  # SmolLM2-135M (causal LM), WordNet definitions as instructions
    python benchmarks/step.py --quick          # the 2-layer random tiny-bert, a smoke test
                                               # (--quick --model tiny-llama: the causal-LM path)

**Models.** A classifier (default MiniLM: configs/quickstart.toml's LoRA classifier on WordNet
glosses) or a causal LM (``--model smollm2``: configs/llm.toml's LoRA SmolLM2-135M on WordNet
definitions as instructions; its train step is fedlora's per-sample response loss,
:func:`fedlora.causal_lm.causal_lm_loss`, and its evaluation pass the teacher-forced scoring of
:func:`fedlora.causal_lm.teacher_forced`, which fedlora's received metrics and response loss use;
generation for ROUGE-L is not timed). The model kind comes from the backbone registry.

**Ceiling.** The GFLOP/s of a float32 and a bfloat16 matrix product of the model's feed-forward
shape ((batch x tokens) x hidden @ hidden x intermediate: 384 x 1536 for MiniLM, 576 x 1536 for
SmolLM2) on ``--threads`` threads and on every core, best of ``--ceiling-repeat`` timed products.

**Arms** (interleaved through :mod:`harness` after a warm-up each; one arm = ``--steps`` train steps
of fedlora's :func:`fedlora.training.train` on one client's real WordNet batches, then one
evaluation pass over the same batches):

- ``fp32``: eager, float32 (what ``train.precision = "fp32"`` runs; today's default on a CPU
  without native bf16);
- ``bf16``: eager under CPU bf16 autocast (``train.precision = "bf16"``; ``--no-bf16`` drops it:
  on a CPU without native bf16 an emulated SmolLM2 bf16 step takes over a minute);
- ``fp32-compiled``: ``torch.compile(model, dynamic=True)`` (inductor; its compile time is
  measured once before the arms and reported, not counted in the step; ``--no-compile`` drops it);
- ``fp32-bucketed``: eager fp32 on the same examples batched by length (each batch of
  similar-length glosses, so less padding; a different batch composition, hence compared on
  tokens/s, not seconds per step).

**Figures per run**: seconds per train step and per evaluation batch; real (non-padding) tokens
per second; achieved GFLOP/s (the FLOPs of one train step / evaluation batch counted once with
``torch.utils.flop_counter.FlopCounterMode`` on the fp32 model, over the measured seconds); and
that as a fraction of the ceiling of the arm's dtype at the same thread count (where bf16 is
emulated, most of a bf16 step still runs in fp32, so its fraction of the tiny bf16 ceiling can
exceed 1; the bucketed arm's FLOPs are counted on its own, less padded, batches). The last line gives
the ratios fp32 / arm of the median seconds (above 1: the arm is faster).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import harness
from precision import Batches, build

NAME = "step"


def ffn_shape(model: Any) -> tuple[int, int]:
    """(hidden, intermediate) of the model's feed-forward layers: the shape of most of its FLOPs."""
    config = model.config
    return int(config.hidden_size), int(config.intermediate_size)


def matmul_gflops(dtype: Any, threads: int, rows: int, repeat: int, ffn: tuple[int, int]) -> float:
    """Best GFLOP/s of a (rows x hidden) @ (hidden x intermediate) product in ``dtype`` on ``threads`` threads."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a = torch.randn(rows, ffn[0], dtype=dtype)
        b = torch.randn(ffn[0], ffn[1], dtype=dtype)
        for _ in range(3):  # warm-up: kernel selection, caches
            a @ b
        best = float("inf")
        for _ in range(repeat):
            started = time.perf_counter()
            for _ in range(10):
                a @ b
            best = min(best, (time.perf_counter() - started) / 10)
        return 2 * rows * ffn[0] * ffn[1] / best / 1e9
    finally:
        torch.set_num_threads(before)


def causal(model_path: str) -> bool:
    """Whether ``model_path`` names a causal LM in the backbone registry."""
    from fedlora.backbones import BACKBONES

    spec = BACKBONES.get(model_path)
    return spec is not None and spec.kind == "causal_lm"


def loss_of(is_causal: bool) -> Any:
    """fedlora's training objective of the model kind."""
    from fedlora.causal_lm import causal_lm_loss
    from fedlora.training import cross_entropy_loss

    return causal_lm_loss if is_causal else cross_entropy_loss


def evaluation(model: Any, batches: list[dict[str, Any]], precision: str, is_causal: bool) -> None:
    """fedlora's evaluation pass of the model kind over ``batches`` (a causal LM: teacher-forced)."""
    import torch

    from fedlora.causal_lm import teacher_forced
    from fedlora.training import evaluate

    scorer = teacher_forced if is_causal else evaluate
    scorer(model, Batches(batches), torch.device("cpu"), precision)  # type: ignore[arg-type, operator]


def counted_flops(model: Any, batches: list[dict[str, Any]], is_causal: bool) -> tuple[float, float]:
    """FLOPs of one train step (forward + backward of the loss) and of one evaluation batch
    (forward), averaged over ``batches``, counted by torch's FlopCounterMode on the eager model."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    loss = loss_of(is_causal)
    model.train()
    train_flops = eval_flops = 0.0
    for batch in batches:
        with FlopCounterMode(display=False) as counter:
            loss(model, batch).backward()
        train_flops += counter.get_total_flops()
        model.zero_grad(set_to_none=True)
    model.eval()
    with torch.no_grad():
        for batch in batches:
            with FlopCounterMode(display=False) as counter:
                loss(model, batch)
            eval_flops += counter.get_total_flops()
    return train_flops / len(batches), eval_flops / len(batches)


def real_tokens(batches: list[dict[str, Any]]) -> float:
    """Non-padding tokens per batch (the attention mask's ones), averaged."""
    return sum(float(batch["attention_mask"].sum()) for batch in batches) / len(batches)


def bucketed(batches: list[dict[str, Any]], tokenizer: Any, is_causal: bool) -> list[dict[str, Any]]:
    """The same examples re-batched by length (shortest first), padded per batch by transformers'
    collator (a causal LM's right-padded labels with -100, as fedlora's loader does): every batch
    holds examples of similar length."""
    from transformers import DataCollatorForSeq2Seq, DataCollatorWithPadding

    rows = []
    for batch in batches:
        for i in range(len(batch["labels"])):
            n = int(batch["attention_mask"][i].sum())
            row = {key: batch[key][i][:n].tolist() for key in ("input_ids", "attention_mask", "token_type_ids")
                   if key in batch}
            rows.append(row | {"labels": batch["labels"][i][:n].tolist() if is_causal else int(batch["labels"][i])})
    rows.sort(key=lambda row: len(row["input_ids"]))
    collator = (DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100, return_tensors="pt")
                if is_causal else DataCollatorWithPadding(tokenizer, return_tensors="pt"))
    size = len(batches[0]["labels"])
    return [dict(collator(rows[i:i + size])) for i in range(0, len(rows), size)]


def examples_digest(batches: list[dict[str, Any]]) -> str:
    """A short hash of the examples in ``batches`` (each one's real tokens, in sorted order): the
    same for the padded and the bucketed batches of the same examples."""
    import hashlib

    rows = sorted(tuple(b["input_ids"][i][b["attention_mask"][i].bool()].tolist())
                  for b in batches for i in range(len(b["labels"])))
    return hashlib.sha256(repr(rows).encode()).hexdigest()[:16]


# what the arms may differ in: the precision, compiling, and how the same examples are batched
VARIES = ("precision", "compiled", "batching")


def arms(models: dict[str, Any], batch_sets: dict[str, list[dict[str, Any]]], steps: int,
         flops: dict[str, tuple[float, float]], tokens: dict[str, float], ceiling: dict[str, float],
         is_causal: bool, bf16: bool = True, model_path: str = "") -> dict[str, harness.Arm]:
    """One arm per setting (module docstring); each run reports what it ran at (harness.Run)."""
    import torch

    from fedlora.training import train

    cpu = torch.device("cpu")
    loss = loss_of(is_causal)

    def arm(name: str, precision: str) -> harness.Arm:
        model, batches, (train_flops, eval_flops) = models[name], Batches(batch_sets[name]), flops[name]
        peak = ceiling["bf16" if precision == "bf16" else "fp32"]
        fixed = {"precision": precision, "compiled": name == "compiled",
                 "batching": "by length" if name == "bucketed" else "padded", "model": model_path,
                 "batch_size": len(batches[0]["labels"]), "examples": examples_digest(batches)}

        def run() -> harness.Run:
            stats = train(model, batches, epochs=1, lr=1e-4, device=cpu, max_steps=steps,  # type: ignore[arg-type]
                          precision=precision, loss_fn=loss)  # type: ignore[arg-type]
            started = time.perf_counter()
            evaluation(model, batches, precision, is_causal)
            step = stats.seconds / max(stats.steps, 1)
            batch = (time.perf_counter() - started) / len(batches)
            figures = {"train_step_seconds": step, "eval_batch_seconds": batch,
                       "train_tokens_per_s": tokens[name] / step, "eval_tokens_per_s": tokens[name] / batch,
                       "train_gflops": train_flops / step / 1e9, "eval_gflops": eval_flops / batch / 1e9,
                       "train_fraction": train_flops / step / 1e9 / peak,
                       "eval_fraction": eval_flops / batch / 1e9 / peak}
            return harness.Run(figures, fixed | {"threads": torch.get_num_threads(), "steps": stats.steps})
        return run

    chosen = {"fp32": arm("fp32", "fp32"), "fp32-bucketed": arm("bucketed", "fp32")} | (
        {"bf16": arm("fp32", "bf16")} if bf16 else {})
    return chosen | ({"fp32-compiled": arm("compiled", "fp32")} if "compiled" in models else {})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default="minilm", help="model.path of a built-in classifier or causal LM (default "
                        "minilm; smollm2 for the causal LM; --quick: tiny-bert unless --model names another)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a client's federation.num_cpus)")
    parser.add_argument("--steps", type=int, default=8, help="train steps per run (and evaluation batches)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=32)
    parser.add_argument("--ceiling-repeat", type=int, default=5, help="timed products per ceiling figure (best kept)")
    parser.add_argument("--no-compile", action="store_true", help="leave out the torch.compile arm")
    parser.add_argument("--no-bf16", action="store_true", help="leave out the bf16 arm and ceiling (on a CPU without "
                        "native bf16 they are emulated: a SmolLM2 bf16 step takes over a minute, its product seconds)")
    parser.add_argument("--quick", action="store_true", help="tiny-bert, 2 steps, 1 + 2 runs: a smoke test")
    harness.add_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.max_length < 8 or args.threads < 1 or args.ceiling_repeat < 1:
        parser.exit(2, "error: need --steps >= 1, --batch-size >= 1, --max-length >= 8, --threads >= 1, "
                       "--ceiling-repeat >= 1\n")
    if args.quick:
        args.steps, args.ceiling_repeat = 2, 1
        args.model = "tiny-bert" if args.model == "minilm" else args.model
    harness.settle(args, NAME, quick=args.quick, repeat=2 if args.quick else harness.DEFAULT_REPEAT)
    import os

    import torch

    from fedlora.app.quiet import output
    from fedlora.backbones import load_tokenizer
    from fedlora.training import native_bf16

    torch.set_num_threads(args.threads)
    env = harness.environment(args.note)
    cores = os.cpu_count() or 1
    is_causal = causal(args.model)
    with output(verbose=False):  # fedlora's lines only
        model, batches = build(args.model, args.steps * args.batch_size, args.batch_size, args.max_length, is_causal)
    rows, ffn = args.batch_size * args.max_length, ffn_shape(model)
    dtypes = {"fp32": torch.float32} | ({} if args.no_bf16 else {"bf16": torch.bfloat16})
    ceiling = {f"{name}{suffix}": matmul_gflops(dtype, n, rows, args.ceiling_repeat, ffn)
               for suffix, n in (("", args.threads), ("_all_cores", cores)) for name, dtype in dtypes.items()}
    print(f"ceiling (GFLOP/s of a {args.model} feed-forward product, {rows} x {ffn[0]} @ {ffn[0]} x {ffn[1]}, best of "
          f"{args.ceiling_repeat}): " + ", ".join(f"{key} {value:.1f}" for key, value in ceiling.items())
          + f" ({args.threads} thread(s); all cores = {cores})")
    with output(verbose=False):
        bucket_batches = bucketed(batches, load_tokenizer(args.model), is_causal)
        flops = counted_flops(model, batches, is_causal)
        counted = {"fp32": flops, "compiled": flops, "bucketed": counted_flops(model, bucket_batches, is_causal)}
        models = {"fp32": model, "bucketed": model}
        compile_seconds = math.nan
        if not args.no_compile:
            from fedlora.training import train

            models["compiled"] = compiled = torch.compile(model, dynamic=True)
            started = time.perf_counter()  # compile: one train step and one evaluation batch
            train(compiled, Batches(batches[:1]), epochs=1, lr=1e-4, device=torch.device("cpu"), max_steps=1,  # type: ignore[arg-type]
                  loss_fn=loss_of(is_causal))
            evaluation(compiled, batches[:1], "fp32", is_causal)
            compile_seconds = time.perf_counter() - started
            print(f"torch.compile (inductor, dynamic shapes): {compile_seconds:.1f} s for the first train step and "
                  "evaluation batch")
        print(f"FLOPs per train step {flops[0] / 1e9:.2f} G, per evaluation batch {flops[1] / 1e9:.2f} G")
        tokens = {"fp32": real_tokens(batches), "compiled": real_tokens(batches), "bucketed": real_tokens(bucket_batches)}
        padded = sum(float(b["attention_mask"].numel()) for b in batches) / len(batches)
        padded_bucketed = sum(float(b["attention_mask"].numel()) for b in bucket_batches) / len(bucket_batches)
        print(f"real tokens per batch {tokens['fp32']:.0f} of {padded:.0f} padded ({tokens['fp32'] / padded:.0%}); "
              f"bucketed by length: {padded_bucketed:.0f} padded ({tokens['bucketed'] / padded_bucketed:.0%})")
        measured = harness.run_interleaved(
            arms(models, {"fp32": batches, "compiled": batches, "bucketed": bucket_batches}, args.steps, counted, tokens,
                 ceiling, is_causal, bf16=not args.no_bf16, model_path=args.model),
            repeat=args.repeat, warmup=args.warmup, varies=VARIES)
    compared = tuple(arm for arm in ("bf16", "fp32-compiled") if arm in measured.samples)
    ratios = {arm: harness.compare(measured, "fp32", arm, "train_step_seconds") for arm in compared}
    eval_ratios = {arm: harness.compare(measured, "fp32", arm, "eval_batch_seconds") for arm in compared}
    bucket_ratio = harness.compare(measured, "fp32-bucketed", "fp32", "train_tokens_per_s")
    main_ratio = ratios[compared[-1]] if compared else bucket_ratio  # --no-bf16 --no-compile: the bucketing
    print(harness.report(measured, main_ratio))
    for arm in compared:
        print(f"fp32 / {arm}: train step {ratios[arm].ratio:.3f} (spread {ratios[arm].spread:.3f}), "
              f"evaluation batch {eval_ratios[arm].ratio:.3f} (spread {eval_ratios[arm].spread:.3f})")
    print(f"bucketed / plain real train tokens per second: {bucket_ratio.ratio:.3f} (spread {bucket_ratio.spread:.3f})")
    fp32 = harness.describe(measured.samples["fp32"])
    compiled_text = (f"fp32/compiled train {ratios['fp32-compiled'].ratio:.2f} eval "
                     f"{eval_ratios['fp32-compiled'].ratio:.2f} (compile {compile_seconds:.0f}s)"
                     if "compiled" in models else "compiled arm left out")
    bf16_text = (f"fp32/bf16 train {ratios['bf16'].ratio:.2f} eval {eval_ratios['bf16'].ratio:.2f}"
                 if "bf16" in ratios else "bf16 arm left out")
    last = (f"model={args.model} fp32 train step {fp32['train_step_seconds'].median:.3f}s "
            f"({fp32['train_fraction'].median:.1%} of the {ceiling['fp32']:.0f} GFLOP/s ceiling), eval batch "
            f"{fp32['eval_batch_seconds'].median:.3f}s ({fp32['eval_fraction'].median:.1%}); {bf16_text}; "
            f"{compiled_text}; bucketed tokens/s "
            f"x{bucket_ratio.ratio:.2f}; native_bf16={native_bf16(torch.device('cpu'))} threads={args.threads}")
    extra = {"ceiling_gflops": ceiling, "flops_per_train_step": flops[0], "flops_per_eval_batch": flops[1],
             "compile_seconds": compile_seconds, "eval_comparisons": eval_ratios, "train_comparisons": ratios,
             "bucketed_tokens_comparison": bucket_ratio, "native_bf16": native_bf16(torch.device("cpu")),
             "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    return harness.finish(NAME, args, measured, main_ratio, last, extra, env)


if __name__ == "__main__":
    raise SystemExit(main())
