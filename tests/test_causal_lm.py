"""Causal language models (``model.kind = 'causal_lm'``): every strategy on configs/llm_smoke.toml
(a tiny random Llama with SmolLM2's tokenizer), the response-only loss, ROUGE-L, saved adapters
that load into ``AutoModelForCausalLM``, the one-line config errors, DP-SGD with a per-sample loss,
and the one base model per process. SmolLM2 itself (15 s to dequantise once) only in a slow test.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from result_checks import assert_generation_scores_add_up
from strategy_helpers import short_run_overrides

from fedlora.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs/llm_smoke.toml"


def strategy_names() -> list[str]:
    from fedlora.strategies.registry import strategy_names as names

    return names()


def refusal(strategy: str) -> str:
    from fedlora.methods import method

    return method(strategy).capabilities.causal_lm


def tokenizer():
    from fedlora.backbones import load_tokenizer

    return load_tokenizer("tiny-llama")


@pytest.mark.e2e
@pytest.mark.parametrize("strategy", strategy_names())
def test_every_strategy_runs_on_the_causal_lm_smoke_or_refuses_in_one_line(strategy: str, tmp_path: Path) -> None:
    from fedlora.app.runner import run_inprocess

    overrides = [f"strategy.name={strategy}", *short_run_overrides(strategy)]
    if refusal(strategy):
        # Execute / Assert: a method without a meaning for generation says so in one line
        with pytest.raises(ConfigError, match=f"strategy '{strategy}' does not run with model.kind") as error:
            load_config(SMOKE, overrides)
        assert "\n" not in str(error.value)
        return
    # Prepare
    config = load_config(SMOKE, overrides)
    # Execute
    run_inprocess(config, tmp_path)
    results = json.loads((tmp_path / "results.json").read_text())
    # Assert: round 0 is the zero-shot model; every round trains, every evaluated round scores
    rounds = results["rounds"]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[0]["clients"] == 0 and rounds[0]["global_accuracy"] is None
    for record in rounds:
        assert math.isfinite(record["global_rouge_l"]) and 0.0 <= record["global_rouge_l"] <= 1.0
        assert math.isclose(record["global_perplexity"], math.exp(record["global_loss"]), rel_tol=1e-6)
    for record in rounds[1:]:
        assert record["clients"] > 0 and record["failures"] == 0
        assert_generation_scores_add_up(record)  # the clients' replies add up to the round's scores
        assert record["validation_loss"] > 0 and math.isfinite(record["train_loss"])
    # best round: the lowest validation loss (never a test score)
    validated = [r for r in rounds if r["validation_loss"] is not None]
    assert results["final"]["round"] == 2 and results["final"]["best_round"] == min(
        validated, key=lambda r: r["validation_loss"])["round"]
    adapters = sorted(p.parent.name for p in (tmp_path / "adapters").rglob("adapter_config.json"))
    assert adapters, "no adapter saved"
    # sample generations: the zero-shot model, then the global model when the method has one (else
    # the global scores are the clients' own models on the global test set, as for classification)
    samples = [json.loads(line) for line in (tmp_path / "generations.jsonl").read_text().splitlines()]
    has_global = "global" in adapters
    assert [s["round"] for s in samples] == ([0, 0, 1, 1, 2, 2] if has_global else [0, 0])
    assert {"prompt", "reference", "generation"} <= set(samples[0])


@pytest.mark.e2e
def test_the_zero_shot_round_is_the_base_model_for_every_init(tmp_path: Path) -> None:
    from fedlora.app.runner import run_inprocess

    # Execute: the same smoke with the plain init and with PiSSA (which rewrites W0 as a residual)
    losses = []
    for index, overrides in enumerate((["train.rounds=1"], ["train.rounds=1", "strategy.name=fedpissa"])):
        run_inprocess(load_config(SMOKE, overrides), tmp_path / str(index))
        losses.append(json.loads((tmp_path / str(index) / "results.json").read_text())["rounds"][0]["global_loss"])
    # Assert: B = 0 (kaiming) and W_res + B A (PiSSA) are both the base model at round 0
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_prompt_tokens_are_labelled_minus_100_and_the_response_ends_with_eos() -> None:
    from fedlora.causal_lm import IGNORE_INDEX, encode_instruction, prompt_ids

    # Prepare: a hand example with SmolLM2's chat template
    tok = tokenizer()
    prompt, response = "Define the word 'dog' (noun).", "a domestic animal"
    head = prompt_ids(tok, prompt)
    # Execute
    encoded = encode_instruction(tok, prompt, response, max_length=256)
    cut = encode_instruction(tok, prompt, response, max_length=len(head) + 2)
    # Assert: the prompt (system, user turn, assistant header) has no loss; the answer and EOS do
    rendered = tok.decode(head)
    assert rendered.endswith("<|im_start|>assistant\n") and "Define the word 'dog' (noun)." in rendered
    labels = encoded["labels"]
    assert labels[: len(head)] == [IGNORE_INDEX] * len(head)
    assert labels[len(head):] == encoded["input_ids"][len(head):]
    assert tok.decode(labels[len(head):]) == "a domestic animal<|im_end|>"
    assert labels[-1] == tok.eos_token_id
    assert encoded["attention_mask"] == [1] * len(encoded["input_ids"])
    assert len(cut["input_ids"]) == len(cut["labels"]) == len(head) + 2  # cut to train.max_length


def test_the_loss_is_the_mean_over_examples_of_their_mean_response_token_nll() -> None:
    import torch

    from fedlora.causal_lm import IGNORE_INDEX, token_losses

    # Prepare: vocabulary 4; example 0 has 1 response token, example 1 has 2
    logits = torch.zeros(2, 4, 4)  # uniform: NLL log 4 for any token ...
    logits[1, 1, 3] = math.log(3.0)  # ... except: p(3 | position 1 of example 1) = 3 / 6 = 1/2
    labels = torch.tensor([[IGNORE_INDEX, IGNORE_INDEX, 2, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 3, 1]])
    # Execute
    total, count = token_losses(logits, labels)
    # Assert: position t predicts label t + 1; prompt and padding (-100) count nothing
    assert count.tolist() == [1, 2]
    assert total.tolist() == pytest.approx([math.log(4), math.log(2) + math.log(4)])
    per_sample = (total / count).mean()
    assert float(per_sample) == pytest.approx((math.log(4) + (math.log(2) + math.log(4)) / 2) / 2)


def test_rouge_l_is_computed_by_rouge_score_on_a_hand_example() -> None:
    from fedlora.causal_lm import rouge_l

    # Execute: the longest common subsequence of the two is "the cat on the mat" (5 of 6 tokens each)
    scores = rouge_l(["The cat sat on the mat.", "completely different"], ["the cat is on the mat", "the cat is on the mat"])
    # Assert: P = R = F1 = 5/6; nothing in common: 0
    assert scores == pytest.approx([5 / 6, 0.0])


@pytest.mark.e2e
def test_saved_adapters_load_with_peft_on_auto_model_for_causal_lm_and_generate(tmp_path: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fedlora.app.runner import run_inprocess
    from fedlora.causal_lm import prompt_ids
    from fedlora.models import bare_causal_model

    # Prepare: a FedIT run, and the tiny Llama's random base saved as an ordinary HF folder
    run_inprocess(load_config(SMOKE, ["train.rounds=1"]), tmp_path / "run")
    bare_causal_model("tiny-llama").save_pretrained(tmp_path / "base")
    tok = tokenizer()
    # Execute
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model = PeftModel.from_pretrained(base, tmp_path / "run/adapters/global")
    ids = torch.tensor([prompt_ids(tok, "Define the word 'dog' (noun).")])
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    # Assert: the adapter is the q / v LoRA of the run, with non-zero B, and it generates
    config = json.loads((tmp_path / "run/adapters/global/adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == ["q_proj", "v_proj"] and config["task_type"] == "CAUSAL_LM"
    assert config["base_model_name_or_path"] == "tiny-llama"  # model.path as configured, not a cache folder
    assert not (tmp_path / "run/adapters/global/labels.json").exists()  # no classes: no head
    assert any(float(p.abs().sum()) > 0 for n, p in model.named_parameters() if "lora_B" in n)
    assert out.shape == (1, ids.shape[1] + 5)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.target_modules=['q_proj', 'nope']"], "model.target_modules: ['nope'] match no module of 'tiny-llama'"),
        (["data.task=noun8"], "model.kind = 'causal_lm' needs instruction data"),
        (["model.kind=classification", "model.path=tiny-bert"], "holds instructions, not labelled text"),
        (["data.label_noise=symmetric", "data.noise_rate=0.2"], "data.label_noise = 'symmetric' flips class labels"),
        (["strategy.name=feddpa", "strategy.instance_weighting=true"], "strategy.instance_weighting = true is for classification"),
    ],
)
def test_config_mistakes_are_one_line_config_errors(overrides: list[str], message: str) -> None:
    from fedlora.app.runner import check_inputs

    # Execute: the checks a run makes before anything starts
    with pytest.raises(ConfigError) as error:
        check_inputs(load_config(SMOKE, overrides))
    # Assert
    assert message in str(error.value) and "\n" not in str(error.value)


def test_target_modules_default_to_the_attention_projections_of_the_model_kind() -> None:
    assert load_config(SMOKE).model.target_modules == ["q_proj", "v_proj"]
    assert load_config(ROOT / "configs/smoke.toml").model.target_modules == ["query", "value"]


def test_one_base_model_per_process_and_edited_weights_come_back() -> None:
    import torch

    from fedlora.lora import peft_module
    from fedlora.models import adapter_payload, build_model, protect_base_weights

    # Prepare
    cfg = load_config(SMOKE).model
    first = build_model(cfg, 8, 4, seed=0, device="cpu")
    base = first.get_base_model()
    module = next(k for k in adapter_payload(first) if k.endswith("::A"))[:-3]
    original = base.get_submodule(module).base_layer.weight.detach().clone()
    # Execute: a method edits W0 (FLoRA's merge), then the next message builds its model
    protect_base_weights(first, [module])
    with torch.no_grad():
        first.get_submodule(peft_module(module)).base_layer.weight += 1.0
    second = build_model(cfg, 8, 2, seed=0, init="pissa", device="cpu")
    third = build_model(cfg, 8, 4, seed=0, device="cpu")
    # Assert: the same base object every time (no copy), W0 restored, the seeded adapter identical
    assert second.get_base_model() is base and third.get_base_model() is base
    assert torch.equal(third.get_submodule(peft_module(module)).base_layer.weight, original)
    before, after = adapter_payload(first), adapter_payload(third)
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_dp_sgd_clips_per_sample_gradients_of_the_per_sample_loss_and_changes_the_adapter(monkeypatch) -> None:
    import torch

    import fedlora.privacy
    from fedlora.causal_lm import INSTRUCTIONS, causal_lm_loss
    from fedlora.data import build_federated_data
    from fedlora.models import adapter_payload, build_model
    from fedlora.privacy import private_train
    from fedlora.training import TrainStats, make_loader

    # Prepare: no dropout (exact gradients), a small clipping bound, three examples of different lengths
    cfg = load_config(SMOKE, ["model.lora_dropout=0.0", "privacy.dp=true", "privacy.noise_multiplier=0",
                              "privacy.max_grad_norm=0.01"])
    train = build_federated_data(cfg.data).client(0).train.select(range(3))
    model = build_model(cfg.model, 8, 4, seed=0, device="cpu")
    params = [p for p in model.parameters() if p.requires_grad]
    alone = []  # each example's gradient norm, computed on its own without Opacus
    for row in range(3):
        batch = next(iter(make_loader(train.select([row]), tokenizer(), 1, 64, shuffle=False, rows=INSTRUCTIONS)))
        grads = torch.autograd.grad(causal_lm_loss(model, batch), params)
        alone.append(float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads))))
    batch3 = make_loader(train, tokenizer(), 3, 64, shuffle=False, rows=INSTRUCTIONS)
    observed = {}

    def probe(private_model, loader, optimizer, epochs, max_steps, loss_fn, *args, **kwargs):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(private_model, next(iter(batch3))).backward()
        observed["raw"] = torch.stack([g.reshape(len(g), -1).norm(dim=-1) for g in optimizer.grad_samples], 1).norm(dim=1)
        optimizer.clip_and_accumulate()
        observed["clipped"] = float(torch.sqrt(sum((p.summed_grad.double() ** 2).sum() for p in optimizer.params)))
        return TrainStats(0.0, 0, 0, 0.0)

    monkeypatch.setattr(fedlora.privacy, "optimise", probe)
    kwargs = {"epochs": 1, "lr": 1e-2, "device": torch.device("cpu"), "rounds": 1, "history": [], "max_steps": 1,
              "loss_fn": causal_lm_loss}
    # Execute: Opacus' per-sample gradients on a batch of three
    private_train(model, batch3, privacy=cfg.privacy, **kwargs)
    monkeypatch.undo()
    # Assert: they are each example's own gradient (the per-sample loss), then clipped to the bound
    assert observed["raw"].tolist() == pytest.approx(alone, rel=1e-3)
    assert min(alone) > 0.01 and observed["clipped"] <= 3 * 0.01 * (1 + 1e-3)
    # Execute: a real private step with noise
    cfg.privacy.noise_multiplier = 1.0
    before = {k: v.copy() for k, v in adapter_payload(model).items()}
    result = private_train(model, make_loader(train, tokenizer(), 3, 64, shuffle=True, rows=INSTRUCTIONS), privacy=cfg.privacy,
                           seed=1, **{**kwargs, "max_steps": 2})
    after = adapter_payload(model)
    # Assert: every LoRA factor moved and the privacy was accounted
    assert all(not np.array_equal(before[k], after[k]) for k in before)
    assert result.epsilon > 0


def test_instruction_sources_have_prompts_responses_and_topics() -> None:
    from fedlora.data import build_federated_data

    # Execute
    define = build_federated_data(load_config(SMOKE).data)
    chat = build_federated_data(load_config(SMOKE, ["data.source=chatterbot", "data.max_examples=0"]).data)
    mixed = build_federated_data(load_config(SMOKE, ["data.source=wordnet+chatterbot", "data.max_examples=0",
                                                     "data.partition=pathological", "data.classes_per_client=1"]).data)
    # Assert
    row = define.clients[0].train[0]
    assert row["prompt"].startswith("Define the word '") and row["prompt"].endswith("' (noun).") and row["response"]
    assert len(define.label_names) == 8 and all(name.startswith("noun.") for name in define.label_names)
    assert len(chat.label_names) == 21 and "tech_support" in chat.label_names
    assert mixed.label_names == ["define", "chat"]
    tasks = [set(c.train["label"][:]) for c in mixed.clients]
    assert tasks == [{0}, {1}, {0}]  # pathological, one class per client: clients differ in task


@pytest.mark.slow
def test_smollm2_is_dequantised_once_quietly_and_answers_an_instruction(tmp_path: Path, monkeypatch, capfd) -> None:
    import time

    from fedlora.backbones import load_tokenizer, smollm2_model_path
    from fedlora.causal_lm import generate
    from fedlora.models import build_model

    # Prepare: the dequantised float32 copy, made in an empty cache (once per machine, ~15 s): it
    # prints no progress bar of transformers' GGUF reader
    monkeypatch.setenv("FEDLORA_CACHE", str(tmp_path / "cache"))
    folder = smollm2_model_path()
    assert folder.is_relative_to(tmp_path) and "de-quantizing" not in "".join(capfd.readouterr())
    started = time.perf_counter()
    cfg = load_config(ROOT / "configs/llm.toml").model
    model = build_model(cfg, 8, 8, seed=0, device="cpu")
    # Execute
    text = generate(model, load_tokenizer("smollm2"), ["What is the capital of France?"], 8, model.device, 1)[0]
    # Assert
    assert (folder / "model.safetensors").is_file() and time.perf_counter() - started < 120
    assert "Paris" in text
