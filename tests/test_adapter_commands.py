"""Adapters people can use: the model card a run writes into each adapter folder, ``fedlora export``
(merged into the backbone: transformers alone loads it and predicts as the adapter did) and
``fedlora eval`` (a saved adapter on a data file: on the run's held-out global test set it prints
the run's final global score), for a classifier and a causal LM; their bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cli_helpers import ROOT, SMOKE, fedlora_run

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

LLM_SMOKE = ROOT / "configs/llm_smoke.toml"
# A fresh interpreter that loads a merged model with transformers alone (no fedlora, no peft) and
# prints its outputs for the given texts as JSON: what a serving stack does
LOAD_ALONE = r"""
import json, sys
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
folder, kind, texts = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
auto = AutoModelForCausalLM if kind == "causal_lm" else AutoModelForSequenceClassification
model, tokenizer = auto.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder)
out = []
with torch.no_grad():
    for text in texts:
        batch = tokenizer(text, return_tensors="pt")
        out.append(model(**batch).logits[0].tolist())
loaded = sorted(name for name in sys.modules if name.split(".")[0] in ("peft", "fedlora"))
print(json.dumps({"logits": out, "id2label": {int(k): v for k, v in model.config.id2label.items()},
                  "loaded": loaded}))
"""


def fedlora(*args: str, timeout: int = 600) -> subprocess.CompletedProcess[str]:
    """``fedlora ARGS`` as a user runs it (returncode not checked)."""
    return subprocess.run([sys.executable, "-m", "fedlora.app.cli", *args], check=False, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def in_process(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``fedlora ARGV`` in this process (a fresh interpreter costs seconds of imports): its exit
    status, stdout and stderr. The console handler the command adds to the root logger is removed."""
    import logging

    from fedlora.app import cli

    handlers = list(logging.getLogger().handlers)
    capsys.readouterr()
    try:
        code = cli.main(argv)
    except SystemExit as stop:  # argparse's usage errors
        code = int(stop.code or 0)
    finally:
        for handler in [h for h in logging.getLogger().handlers if h not in handlers]:
            logging.getLogger().removeHandler(handler)
    out, err = capsys.readouterr()
    return code, out, err


def global_test_file(config_path: Path, path: Path, causal: bool = False, names: bool = True) -> Path:
    """The run's held-out global test set as a data file (.jsonl or .csv): text and class name (or
    index), or prompt and response."""
    import csv

    from fedlora.config import load_config
    from fedlora.data import build_federated_data

    federated = build_federated_data(load_config(config_path).data)
    test = federated.global_test
    if causal:
        rows = [{"prompt": r["prompt"], "response": r["response"]} for r in test]
    else:
        rows = [{"text": r["text"], "label": federated.label_names[r["label"]] if names else r["label"]} for r in test]
    if path.suffix == ".csv":
        with path.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def adapter_logits(run: Path, texts: list[str]) -> list[list[float]]:
    """The run's global adapter as the server evaluated it (fedlora's own model: the seeded backbone
    with the payload loaded, no peft loading or merging), its logits on ``texts``."""
    import torch
    from safetensors.torch import load_file

    from fedlora.backbones import load_tokenizer
    from fedlora.config import build_config
    from fedlora.data import build_federated_data
    from fedlora.evaluation import GlobalEvaluator
    from fedlora.lora import from_peft_state

    config = build_config(json.loads((run / "results.json").read_text())["config"])
    evaluator = GlobalEvaluator(config.model, config.train, build_federated_data(config.data))
    model = evaluator.model_for(from_peft_state(load_file(str(run / "adapters/global/adapter_model.safetensors"))))
    tokenizer = load_tokenizer(config.model.path)
    with torch.no_grad():
        return [model.eval()(**tokenizer(text, return_tensors="pt")).logits[0].tolist() for text in texts]


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 2-round smoke run (tiny BERT classifier), started from the command line."""
    out = tmp_path_factory.mktemp("adapters") / "run"
    proc = fedlora_run(out, "output.tensorboard=false", args=("--engine", "inprocess"))
    assert proc.returncode == 0, proc.stderr
    return out, json.loads((out / "results.json").read_text())


@pytest.fixture(scope="module")
def llm_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    """A 2-round causal-LM smoke run (tiny Llama), from Python."""
    import fedlora

    out = tmp_path_factory.mktemp("adapters") / "llm"
    results = fedlora.run(LLM_SMOKE, ["output.tensorboard=false"], out_dir=out, engine="inprocess")
    return out, dict(results)


# --------------------------------------------------------------------------- the model card
def test_the_adapters_model_card_says_method_backbone_data_rounds_clients_metrics_and_command(smoke_run) -> None:
    # Prepare
    out, results = smoke_run
    folder = out / "adapters" / "global"
    # Execute
    card = (folder / "README.md").read_text()
    info = json.loads((folder / "fedlora.json").read_text())
    # Assert: not peft's blank template; every part the card promises, with the run's own values
    assert "More Information Needed" not in card and card.startswith("---\nbase_model: tiny-bert\nlibrary_name: peft\n")
    assert "| method | `fedit` (Zhang et al." in card
    assert "| backbone | `tiny-bert` (classification), LoRA rank 8 (the clients declared ranks [2, 4, 8])" in card
    assert "| data | wordnet / noun8, 8 classes, 600 examples, dirichlet (alpha 0.5)" in card
    assert "| rounds | 2 rounds of 1 local epoch(s) capped at 5 steps, batch 16, lr 0.001" in card
    assert "| clients | 3 clients" in card
    assert "## Final metrics (round 2)" in card
    assert f"| global accuracy | {results['final']['global_accuracy']:.4f} |" in card
    assert f"| personalised accuracy | {results['final']['personalized_accuracy']:.4f} |" in card
    command = f"fedlora run {SMOKE} --out {out} --set output.tensorboard=false --engine inprocess"
    assert f"Made by `{command}`." in card and info["command"] == command
    assert info["config"] == results["config"] and info["config_hash"] == results["config_hash"]


def test_a_model_card_made_from_python_says_so_and_names_the_causal_metrics(llm_run) -> None:
    # Execute
    out, results = llm_run
    card = (out / "adapters" / "global" / "README.md").read_text()
    # Assert
    assert "pipeline_tag: text-generation" in card and "Made from Python" in card
    assert f"| global ROUGE-L | {results['final']['global_rouge_l']:.4f} |" in card
    assert f"| global perplexity | {results['final']['global_perplexity']:.4f} |" in card


# --------------------------------------------------------------------------- export
def test_an_exported_classifier_loads_with_transformers_alone_and_predicts_as_the_adapter(smoke_run, tmp_path) -> None:
    from fedlora.config import load_config
    from fedlora.data import build_federated_data

    # Prepare: the run and the texts of its global test set
    out, results = smoke_run
    federated = build_federated_data(load_config(SMOKE).data)
    texts = list(federated.global_test["text"][:])
    # Execute
    proc = fedlora("export", str(out / "adapters/global"), "--out", str(tmp_path / "merged"))
    alone = subprocess.run([sys.executable, "-c", LOAD_ALONE, str(tmp_path / "merged"), "classification",
                            json.dumps(texts)], capture_output=True, text=True, timeout=300, check=True)
    # Assert: one line, a plain transformers folder (no adapter files), loaded without peft or fedlora
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout.startswith("merged model: ")
    assert not (tmp_path / "merged" / "adapter_config.json").exists()
    loaded = json.loads(alone.stdout)
    assert loaded["loaded"] == [] and loaded["id2label"] == {str(i): n for i, n in enumerate(federated.label_names)}
    # ... and its logits are the adapter's as the server evaluated it; its accuracy the run's final one
    expected = adapter_logits(out, texts)
    assert loaded["logits"] == [pytest.approx(row, abs=1e-4) for row in expected]
    hits = [max(range(len(row)), key=row.__getitem__) == label
            for row, label in zip(loaded["logits"], federated.global_test["label"][:], strict=True)]
    assert sum(hits) / len(hits) == pytest.approx(results["final"]["global_accuracy"], abs=1e-6)


def test_an_exported_causal_lm_loads_with_transformers_alone_and_predicts_as_the_adapter(llm_run, tmp_path) -> None:
    # Prepare
    out, _results = llm_run
    prompts = ["Define the word 'dog' (noun).", "Define the word 'tree' (noun)."]
    # Execute
    proc = fedlora("export", str(out / "adapters/global"), "--out", str(tmp_path / "merged"))
    alone = subprocess.run([sys.executable, "-c", LOAD_ALONE, str(tmp_path / "merged"), "causal_lm",
                            json.dumps(prompts)], capture_output=True, text=True, timeout=300, check=True)
    # Assert
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    loaded = json.loads(alone.stdout)
    assert loaded["loaded"] == []
    expected = adapter_logits(out, prompts)
    for got, want in zip(loaded["logits"], expected, strict=True):
        assert got == [pytest.approx(row, abs=1e-3) for row in want]


# --------------------------------------------------------------------------- eval
def test_eval_on_the_runs_global_test_set_prints_the_runs_final_accuracy(smoke_run, tmp_path, capsys) -> None:
    # Prepare: the global test set as files, labels by class name (JSONL) and by index (CSV)
    out, results = smoke_run
    named = global_test_file(SMOKE, tmp_path / "global_test.jsonl")
    indexed = global_test_file(SMOKE, tmp_path / "global_test.csv", names=False)
    # Execute: as a user runs it, and (the CSV) in this process
    proc = fedlora("eval", str(out / "adapters/global"), "--data", str(named))
    code, printed, errors = in_process(["eval", str(out / "adapters/global"), "--data", str(indexed)], capsys)
    # Assert
    expected = f"accuracy {results['final']['global_accuracy']:.4f} on 100 examples"
    assert proc.returncode == 0 and proc.stderr == "" and proc.stdout.startswith(expected), proc.stderr
    assert code == 0 and errors == "" and printed.startswith(expected)


def test_eval_of_a_causal_lm_prints_the_runs_final_rouge_and_loss(llm_run, tmp_path) -> None:
    from fedlora.app.adapters import evaluate_file

    # Prepare
    out, results = llm_run
    data = global_test_file(LLM_SMOKE, tmp_path / "global_test.jsonl", causal=True)
    # Execute
    scores = evaluate_file(out / "adapters/global", data)
    # Assert: the run's global-test ROUGE-L (on its first rouge_examples instructions), loss, perplexity
    final = results["final"]
    assert scores.examples == 24 and scores.rouge_examples == 4
    assert scores.rouge_l == pytest.approx(final["global_rouge_l"], abs=1e-9)
    assert scores.loss == pytest.approx(final["global_loss"], rel=1e-6)
    assert scores.perplexity == pytest.approx(final["global_perplexity"], rel=1e-5)
    assert scores.line().startswith(f"ROUGE-L {final['global_rouge_l']:.4f} on 4 of 24 examples")


def test_an_adapter_without_fedlora_json_is_read_with_its_runs_results_or_refused(smoke_run, tmp_path) -> None:
    import shutil

    from fedlora.app.adapters import AdapterError, read_adapter

    # Prepare: the run copied, its adapter's fedlora.json removed (an adapter saved before it existed);
    # the adapter folder alone, copied elsewhere
    out, results = smoke_run
    shutil.copytree(out, tmp_path / "run")
    (tmp_path / "run/adapters/global/fedlora.json").unlink()
    shutil.copytree(tmp_path / "run/adapters/global", tmp_path / "alone")
    # Execute
    adapter = read_adapter(tmp_path / "run/adapters/global")
    # Assert: the run's config from its results.json, the classes from labels.json
    assert adapter.config.model_dump(mode="json") == results["config"]
    assert adapter.labels == [results["id2label"][str(i)] for i in range(len(results["id2label"]))]
    with pytest.raises(AdapterError, match="has no fedlora.json .* and no results.json two folders up"):
        read_adapter(tmp_path / "alone")


# --------------------------------------------------------------------------- bad input
def bad_label_file(d: Path) -> Path:
    (d / "bad.jsonl").write_text('{"text": "a dog", "label": "noun.animal"}\n{"text": "x", "label": "noun.bogus"}\n')
    return d / "bad.jsonl"


def other_columns_file(d: Path) -> Path:
    (d / "cols.csv").write_text("sentence,topic\na dog,noun.animal\n")
    return d / "cols.csv"


def full_folder(d: Path) -> Path:
    (d / "full").mkdir()
    (d / "full" / "mine.txt").write_text("keep me")
    return d / "full"


@pytest.mark.parametrize("args, message", [
    (lambda run, d: ["eval", str(run / "adapters/global"), "--data", str(bad_label_file(d))],
     "row 2: label 'noun.bogus' (column 'label') is not one of the adapter's 8 classes"),
    (lambda run, d: ["eval", str(run / "adapters/global"), "--data", str(other_columns_file(d))],
     "column 'text' (data.text_column) not found"),
    (lambda run, d: ["eval", str(run / "adapters/global"), "--data", str(d / "none.csv")], "data file not found"),
    (lambda run, d: ["eval", str(run / "adapters/global"), "--data", str(bad_label_file(d)), "--batch-size", "0"],
     "--batch-size must be a positive integer"),
    (lambda run, d: ["eval", str(run), "--data", str(bad_label_file(d))], "holds no adapter_config.json"),
    (lambda run, d: ["eval", str(run / "adapters/global")], "the following arguments are required: --data"),
    (lambda run, d: ["export", str(run / "adapters/global"), "--out", str(full_folder(d))],
     "is not a new or empty folder"),
    (lambda run, d: ["export", str(d / "nowhere"), "--out", str(d / "merged")], "does not exist"),
], ids=["unknown-label", "missing-column", "missing-file", "zero-batch", "not-an-adapter", "no-data", "out-not-empty",
        "no-adapter"])
def test_bad_input_to_export_and_eval_is_one_line_exit_2(smoke_run, tmp_path, capsys, args, message) -> None:
    # Prepare
    run, _ = smoke_run
    before = {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}
    # Execute (in this process: tests/test_bad_input.py runs such cases as fresh processes)
    code, printed, errors = in_process(args(run, tmp_path), capsys)
    # Assert: one line naming the problem, exit 2, nothing written or changed
    assert code == 2, errors
    lines = errors.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], errors
    assert "Traceback" not in errors and printed == ""
    assert {str(p): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()} == before
    assert not (tmp_path / "merged").exists()
    if (tmp_path / "full").exists():
        assert [p.name for p in (tmp_path / "full").iterdir()] == ["mine.txt"]
