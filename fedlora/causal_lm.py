"""Instruction tuning of causal language models: tokenisation, the per-sample loss, greedy
generation and ROUGE-L (client side, and the server's global evaluation).

- **Prompts** use the model's chat template (one user turn, then the assistant header); a
  tokenizer without a template gets ``### Instruction:\\n{prompt}\\n\\n### Response:\\n``. The
  response follows the prompt tokens, ended by the EOS token (``<|im_end|>`` for SmolLM2), and
  the whole is cut to ``train.max_length`` tokens.
- **Loss only on the response**: prompt positions are labelled -100. Batches are padded per
  batch (transformers' ``DataCollatorForSeq2Seq``: pads labels with -100).
- **Per-sample loss**: each example's mean token cross-entropy over its response tokens, then
  the mean over the batch. Every example weighs the same whatever its length, and the loss is a
  mean of per-sample terms, which is what Opacus' per-sample gradients and clipping assume (a
  batch-wide token mean, as Hugging Face computes it, mixes the examples' token counts into every
  per-sample gradient).
- **Evaluation**: token-level loss (total response NLL / response tokens) and its perplexity on
  the whole split; teacher-forced next-token accuracy (the argmax at position t equals response
  token t + 1; the received-model metric, no generation); ROUGE-L F1 (the ``rouge-score`` package, Porter stemming) of greedy generations
  (``train.max_new_tokens`` tokens) on the first ``train.rouge_examples`` instructions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from fedlora.training import Precision, RowFormat, autocast

if TYPE_CHECKING:
    import datasets
    import torch
    from torch.utils.data import DataLoader
    from transformers import PreTrainedTokenizerBase

IGNORE_INDEX = -100  # label of positions without loss (prompt and padding)
FALLBACK_TEMPLATE = "### Instruction:\n{prompt}\n\n### Response:\n"


@dataclass
class GenerationEval:
    """One split evaluated with the causal-LM metrics."""

    loss: float  # mean NLL per response token over the split
    perplexity: float  # exp(loss)
    rouge_l: float  # mean ROUGE-L F1 of greedy generations
    examples: int  # examples in the split (loss)
    tokens: int  # response tokens in the split (loss weights)
    rouge_examples: int  # examples whose generations were scored
    samples: list[dict[str, str]] = field(default_factory=list)  # prompt, reference, generation


def prompt_ids(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of the instruction up to where the answer starts (chat template + assistant header)."""
    if getattr(tokenizer, "chat_template", None):
        encoded: Any = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                     tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded  # a BatchEncoding in transformers 5
        return [int(i) for i in ids]
    return [int(i) for i in tokenizer(FALLBACK_TEMPLATE.format(prompt=prompt))["input_ids"]]


def encode_instruction(tokenizer: PreTrainedTokenizerBase, prompt: str, response: str, max_length: int) -> dict[str, list[int]]:
    """``input_ids`` = prompt + response + EOS (cut to ``max_length``), ``labels`` = -100 on the
    prompt, the token ids on the response and EOS, ``attention_mask`` = 1."""
    head = prompt_ids(tokenizer, prompt)
    answer = [int(i) for i in tokenizer(response, add_special_tokens=False)["input_ids"]]
    if tokenizer.eos_token_id is not None:
        answer.append(int(tokenizer.eos_token_id))
    input_ids = (head + answer)[:max_length]
    labels = ([IGNORE_INDEX] * len(head) + answer)[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}


def tokenize_instructions(dataset: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int) -> datasets.Dataset:
    """Every row's :func:`encode_instruction` (no padding; padding happens per batch)."""
    import datasets as hf_datasets

    hf_datasets.disable_progress_bars()

    def encode(rows: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        encoded = [encode_instruction(tokenizer, p, r, max_length) for p, r in zip(rows["prompt"], rows["response"])]
        return {key: [e[key] for e in encoded] for key in ("input_ids", "attention_mask", "labels")}

    return dataset.map(encode, batched=True, remove_columns=dataset.column_names)


def instruction_collator(tokenizer: PreTrainedTokenizerBase) -> Any:
    """transformers' collator that right-pads a batch, its ``labels`` with -100."""
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=IGNORE_INDEX, return_tensors="pt")


# :func:`fedlora.training.make_loader`'s rows for instruction tuning: right-padded batches of
# ``input_ids``, ``attention_mask``, ``labels`` (-100 on the prompt and the padding), in the split's order
INSTRUCTIONS = RowFormat(tokenize_instructions, instruction_collator, by_length=False)


def token_losses(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(summed NLL, number of labelled tokens) per example: position t predicts token t + 1.
    ``logits`` (batch, seq, vocab), ``labels`` (batch, seq) with -100 where there is no loss; the
    cross-entropy is computed on the labelled positions only."""
    import torch
    import torch.nn.functional as F

    shifted = labels[:, 1:]  # (batch, seq - 1)
    mask = shifted != IGNORE_INDEX
    rows = mask.nonzero(as_tuple=True)[0]  # (labelled,) the example of every labelled position
    nll = F.cross_entropy(logits[:, :-1][mask].float(), shifted[mask], reduction="none")  # (labelled,)
    total = torch.zeros(len(labels), dtype=nll.dtype, device=nll.device).index_add(0, rows, nll)
    return total, mask.sum(1)


def response_logits(model: Any, batch: dict[str, torch.Tensor], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, labels) of the positions from the batch's first response token on: the model
    projects only those onto the vocabulary (``logits_to_keep``), not the prompts."""
    labels = batch["labels"].to(device)
    width = labels.shape[1]
    first = int((labels != IGNORE_INDEX).int().argmax(1).min())  # earliest labelled position in the batch
    keep = width - max(first - 1, 0)  # the logits at first - 1 predict the first labelled token
    logits = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device),
                   logits_to_keep=keep).logits  # (batch, keep, vocab)
    return logits, labels[:, width - keep:]


def causal_lm_loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over the batch of each example's mean response-token NLL (the per-sample loss)."""
    device = next(model.parameters()).device
    total, count = token_losses(*response_logits(model, batch, device))
    return (total / count.clamp(min=1)).mean()


@lru_cache(maxsize=1)
def _scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=True)


def rouge_l(predictions: list[str], references: list[str]) -> list[float]:
    """ROUGE-L F1 of every prediction against its reference (rouge-score, with Porter stemming)."""
    scorer = _scorer()
    return [float(scorer.score(ref, pred)["rougeL"].fmeasure) for pred, ref in zip(predictions, references, strict=True)]


def generate(model: Any, tokenizer: PreTrainedTokenizerBase, prompts: list[str], max_new_tokens: int,
             device: torch.device, batch_size: int, precision: Precision = "fp32") -> list[str]:
    """Greedy continuations of the instructions (left-padded batches), decoded without special tokens."""
    import torch

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.to(device).eval()
    outputs: list[str] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [prompt_ids(tokenizer, p) for p in prompts[start:start + batch_size]]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in encoded], device=device)
        attention = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in encoded], device=device)
        with torch.no_grad(), autocast(device, precision):
            generated = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                                       do_sample=False, pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
        outputs += tokenizer.batch_decode(generated[:, width:], skip_special_tokens=True)
    return [text.strip() for text in outputs]


def token_hits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per example, how many labelled tokens the argmax predicts (position t predicts token t + 1);
    ``logits`` (batch, seq, vocab), ``labels`` (batch, seq) with -100 where there is no loss."""
    shifted = labels[:, 1:]  # (batch, seq - 1)
    return ((logits[:, :-1].argmax(-1) == shifted) & (shifted != IGNORE_INDEX)).sum(1)


@dataclass
class TeacherForced:
    """A split scored with teacher forcing (no generation)."""

    loss: float  # mean NLL per response token
    accuracy: float  # fraction of response tokens whose argmax prediction is right
    tokens: int  # response tokens scored


def teacher_forced(model: Any, loader: DataLoader[Any], device: torch.device,
                   precision: Precision = "fp32") -> TeacherForced:
    """Loss and next-token accuracy per response token over a loader, in eval mode without gradients."""
    import torch

    model.to(device).eval()
    total, hits, tokens = 0.0, 0, 0
    with torch.no_grad(), autocast(device, precision):
        for batch in loader:
            logits, labels = response_logits(model, batch, device)
            nll, count = token_losses(logits, labels)
            total, tokens = total + float(nll.sum()), tokens + int(count.sum())
            hits += int(token_hits(logits, labels).sum())
    return TeacherForced(total / tokens if tokens else math.nan, hits / tokens if tokens else math.nan, tokens)


def response_loss(model: Any, loader: DataLoader[Any], device: torch.device,
                  precision: Precision = "fp32") -> tuple[float, int]:
    """(mean NLL per response token, response tokens) over a loader, in eval mode without gradients."""
    scored = teacher_forced(model, loader, device, precision)
    return scored.loss, scored.tokens


def evaluate_generation(
    model: Any,
    dataset: datasets.Dataset,
    loader: DataLoader[Any],
    tokenizer: PreTrainedTokenizerBase,
    device: torch.device,
    max_new_tokens: int,
    rouge_examples: int,
    batch_size: int,
    samples: int = 0,
    precision: Precision = "fp32",
) -> GenerationEval:
    """Token-level loss / perplexity over ``loader`` (the tokenised ``dataset``) and ROUGE-L of
    greedy generations on its first ``rouge_examples`` rows (0 = all); ``samples`` of them are
    returned as (prompt, reference, generation)."""
    if len(dataset) == 0:
        return GenerationEval(math.nan, math.nan, math.nan, 0, 0, 0)
    loss, tokens = response_loss(model, loader, device, precision)
    n = len(dataset) if rouge_examples == 0 else min(rouge_examples, len(dataset))
    head = dataset.select(range(n))
    prompts, references = list(head["prompt"][:]), list(head["response"][:])
    generations = generate(model, tokenizer, prompts, max_new_tokens, device, batch_size, precision)
    scores = rouge_l(generations, references)
    shown = [{"prompt": p, "reference": r, "generation": g} for p, r, g in list(zip(prompts, references, generations))[:samples]]
    return GenerationEval(loss, math.exp(min(loss, 700.0)) if math.isfinite(loss) else math.nan,
                          float(sum(scores) / len(scores)) if scores else math.nan, len(dataset), tokens, n, shown)
