"""One contract: every key on the wire is declared in fedlora/protocol.py and used from there, and
payload keys go to and from peft's state dict through one codec (fedlora/lora/peft_keys.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import numpy as np
import pytest
from sources import ROOT, source_files  # the code that builds or reads messages: every layer

from fedlora import protocol
from fedlora.lora import from_peft_state, payload_key, peft_key, peft_module, to_peft_state

# lowercase words joined by hyphens, Flower's style for record keys: fedlora's own are all declared
KEY_SHAPED = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)+-?$")
# hyphenated strings in key positions that are no wire keys of fedlora's: Flower's CLI JSON
# (``flwr ... --format json``), read by the deployment driver; and the entries FedDR-LoRA's home
# names under its declared prefix (noise-<entry>: built and read there alone)
NOT_OURS = {
    "fedlora/app/deploy/flwr_cli.py": {"run-id", "error-message", "node-id"},
    "fedlora/app/deploy/local.py": {"status-details"},  # Flower's run status (flwr ls --format json)
    "fedlora/app/deploy/roles.py": {"status-details"},
    "fedlora/methods/feddr_lora.py": {"true-positives", "flagged-fraction", "weight-n-", "weight-sum-"},
}
# record names and one-word message keys and reply metrics: spelt out only in protocol.py within the
# protocol layer and the engines (elsewhere the same words name results.json fields, CLI
# arguments, checkpoint entries; a node config's "rank" and the round metric "clients" are such words)
WORDS = protocol.RECORDS | {
    key for key in (protocol.MESSAGE_KEYS | protocol.METHOD_CONFIG_KEYS | protocol.TRAIN_METRICS
                    | protocol.EVALUATE_METRICS | protocol.WORKER_ENTRIES | {protocol.PROFILE_JSON})
    if "-" not in key
}
PROTOCOL_LAYER = ("strategies/", "clients/", "simulations/")


def key_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """String literals in key positions: dict display keys, subscripts, the first argument of
    ``get`` / ``pop`` / ``setdefault`` / ``startswith`` / ``removeprefix``, the left side of ``in``."""
    found: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            found += [key for key in node.keys if key is not None]
        elif isinstance(node, ast.Subscript):
            found.append(node.slice)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args and node.func.attr in (
            "get", "pop", "setdefault", "startswith", "removeprefix"
        ):
            found.append(node.args[0])
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)):
            found.append(node.left)
        elif isinstance(node, ast.JoinedStr):  # f"budget-{name}": its leading text
            first = node.values[0] if node.values else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and len(node.values) > 1:
                found.append(first)
    return [(node.lineno, node.value) for node in found if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def bare_keys() -> list[str]:
    problems = []
    for path in source_files():
        name = path.relative_to(ROOT).as_posix()
        if name == "fedlora/protocol.py":
            continue
        layer = name.startswith(PROTOCOL_LAYER)
        for line, text in key_literals(ast.parse(path.read_text(encoding="utf-8"))):
            if text in NOT_OURS.get(name, ()):
                continue
            if KEY_SHAPED.match(text) or text in protocol.WIRE_PREFIXES or (layer and text in WORDS):
                problems.append(f"{name}:{line}: {text!r}")
    return problems


def test_no_wire_key_is_spelt_out_outside_the_protocol() -> None:
    # Execute
    problems = bare_keys()
    # Assert: a key-shaped literal in a key position is a key someone did not declare (or did not use)
    assert not problems, "use (or declare) the key in fedlora/protocol.py: " + "; ".join(problems)


def test_the_scan_finds_a_bare_key(tmp_path: Path) -> None:
    # Prepare: code that reads a metric by its bare name, and one that uses the constant
    bare = ast.parse('metrics = {"val-accuracy": 1.0}\nx = reply.get("num-examples")\nif "rouge-l" in row: pass\n')
    declared = ast.parse("metrics = {protocol.VAL_ACCURACY: 1.0}\n")
    # Execute / Assert
    assert [text for _, text in key_literals(bare)] == ["val-accuracy", "num-examples", "rouge-l"]
    assert key_literals(declared) == []


def test_every_reply_metric_has_one_contract() -> None:
    # Execute / Assert: every metric a reply may carry has its rule; what a rule needs beside it, or
    # stays below, and what a reply must carry, are declared metrics of the same reply
    assert protocol.TRAIN_METRICS == set(protocol.TRAIN_RULES)
    assert protocol.EVALUATE_METRICS == set(protocol.EVALUATE_RULES)
    for rules, names in ((protocol.TRAIN_RULES, protocol.TRAIN_METRICS), (protocol.EVALUATE_RULES, protocol.EVALUATE_METRICS)):
        for key, rule in rules.items():
            assert set(rule.needs) <= names and set(rule.at_most) <= names, key
            assert rule.high <= protocol.MAX_COUNT or rule.infinite or key == protocol.PERPLEXITY, key
            assert len(key) <= protocol.MAX_METRIC_KEY_LENGTH
    assert set(protocol.TRAIN_REQUIRED) <= protocol.TRAIN_METRICS
    assert {key for keys in protocol.EVALUATE_REQUIRED.values() for key in keys} <= protocol.EVALUATE_METRICS
    # a method's names under its prefix: declared prefixes, a pattern no fixed name matches
    for pattern in protocol.TRAIN_PATTERNS:
        assert pattern.prefix in protocol.METRIC_PREFIXES
        assert not any(pattern.pattern.fullmatch(key) for key in protocol.TRAIN_METRICS)


def test_declared_knows_keys_and_prefixes() -> None:
    # Execute / Assert
    assert protocol.declared("num-examples") and protocol.declared("fedtreelora-lam-3")
    assert protocol.declared("budget-time") and protocol.declared("noise-recall")
    assert not protocol.declared("fedtreelora-lam-") and not protocol.declared("num-example")
    # the record names are no config or metric keys, and no two groups share a spelling by accident
    assert not protocol.RECORDS & protocol.WIRE_KEYS
    assert protocol.MESSAGE_KEYS.isdisjoint(protocol.TRAIN_METRICS | protocol.EVALUATE_METRICS)


def private_writes(tree: ast.AST) -> list[str]:
    """Assignments to another object's private attribute (``layer._active_adapter = ...``,
    ``setattr(x, "_y", ...)``); ``self._x`` / ``cls._x`` are the object's own."""
    found = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and str(name.value).startswith("_"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        for target in targets:
            for part in ast.walk(target):
                if (isinstance(part, ast.Attribute) and part.attr.startswith("_") and not part.attr.startswith("__")
                        and not (isinstance(part.value, ast.Name) and part.value.id in ("self", "cls"))):
                    found.append(f"{node.lineno}: {ast.unparse(part)}")
    return found


def test_no_code_writes_another_objects_private_attribute() -> None:
    # Prepare: the scan sees the write FedTreeLoRA's client once made to peft's layers
    assert private_writes(ast.parse('layer._active_adapter = ["default", "external"]')) == [
        '1: layer._active_adapter']
    assert private_writes(ast.parse("self._cache = {}\nlayer.set_adapter(['default'])")) == []
    # Execute
    problems = [f"{path.relative_to(ROOT)}:{problem}" for path in source_files()
                for problem in private_writes(ast.parse(path.read_text(encoding="utf-8")))]
    # Assert: peft's (and Flower's) state is changed through their public API only
    assert not problems, problems


# ---------------------------------------------------------------- the payload <-> peft codec
MODULE = "bert.encoder.layer.0.attention.self.query"
CASES = [
    (f"{MODULE}::A", f"base_model.model.{MODULE}.lora_A.weight"),
    (f"{MODULE}::B", f"base_model.model.{MODULE}.lora_B.weight"),
    ("head::classifier.weight", "base_model.model.classifier.weight"),
    ("head::classifier.bias", "base_model.model.classifier.bias"),
    ("model.layers.1.self_attn.q_proj::A", "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"),
]


@pytest.mark.parametrize(("payload", "peft"), CASES)
def test_codec_maps_payload_keys_to_peft_keys_and_back(payload: str, peft: str) -> None:
    # Execute / Assert: both directions against hand-written keys
    assert peft_key(payload) == peft
    assert payload_key(peft) == payload


def test_codec_reads_a_factor_key_that_names_its_adapter() -> None:
    # model.state_dict() / named_parameters() spell the adapter's name inside the key
    assert payload_key(f"base_model.model.{MODULE}.lora_B.default.weight") == f"{MODULE}::B"
    assert payload_key(f"base_model.model.{MODULE}.lora_A.local.weight") == f"{MODULE}::A"
    assert peft_module(MODULE) == f"base_model.model.{MODULE}"


def test_codec_round_trips_a_peft_state_dict_and_loads_into_the_model() -> None:
    # Prepare: a tiny classifier's adapter state as peft gives it, and a payload of new values
    import torch
    from peft import get_peft_model_state_dict

    from fedlora.models import adapter_payload, build_model, load_payload
    from fedlora.schema import ModelConfig

    model = build_model(ModelConfig(path="tiny-bert", lora_rank=2), 3, 2, seed=0, device="cpu")
    state = get_peft_model_state_dict(model, save_embedding_layers=False)
    # Execute
    payload = from_peft_state(state)
    back = to_peft_state(payload)
    # Assert: keys as the codec names them, the same tensors after the round trip
    assert set(payload) == {f"{m}::{f}" for m in ("bert.encoder.layer.0.attention.self.query",
                                                  "bert.encoder.layer.0.attention.self.value",
                                                  "bert.encoder.layer.1.attention.self.query",
                                                  "bert.encoder.layer.1.attention.self.value") for f in "AB"} | {
        "head::classifier.weight", "head::classifier.bias"}
    assert back.keys() == state.keys()
    assert all(torch.equal(back[key], state[key].float()) for key in state)
    # Execute: a changed B through load_payload lands in peft's lora_B of that module, nowhere else
    new_B = np.full((32, 2), 0.25, dtype=np.float32)
    load_payload(model, {f"{MODULE}::B": new_B})
    layer = model.get_submodule(peft_module(MODULE))
    assert torch.equal(layer.lora_B["default"].weight, torch.from_numpy(new_B))
    after = adapter_payload(model)
    assert all(np.array_equal(after[key], payload[key]) for key in payload if key != f"{MODULE}::B")
    with pytest.raises(ValueError, match="not a parameter"):
        load_payload(model, {"nowhere::A": new_B})


def test_external_expert_is_activated_through_peft_public_api() -> None:
    # Prepare: an external expert on block 1 of a tiny model
    from fedlora.clients.trainers.fedtreelora import EXTERNAL_ADAPTER, add_external_expert
    from fedlora.models import adapter_payload, build_model
    from fedlora.schema import ModelConfig

    model = build_model(ModelConfig(path="tiny-bert", lora_rank=2), 3, 2, seed=0, device="cpu")
    external = {k: v + 1.0 for k, v in adapter_payload(model).items() if ".layer.1." in k}
    # Execute
    mixed = add_external_expert(model, external, 4.0, 0.0)
    # Assert: both experts are active in block 1 only; the external one is frozen
    for module in ("bert.encoder.layer.0.attention.self.query", "bert.encoder.layer.1.attention.self.query"):
        layer = model.get_submodule(peft_module(module))
        if module in mixed:
            assert layer.active_adapters == ["default", EXTERNAL_ADAPTER]
            assert not layer.lora_B[EXTERNAL_ADAPTER].weight.requires_grad
            assert np.array_equal(layer.lora_B[EXTERNAL_ADAPTER].weight.detach().numpy(), external[f"{module}::B"])
        else:
            assert layer.active_adapters == ["default"]
        assert layer.lora_A["default"].weight.requires_grad
    assert mixed == ["bert.encoder.layer.1.attention.self.query", "bert.encoder.layer.1.attention.self.value"]
