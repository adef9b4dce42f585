"""Saved adapters people can use: a filled model card, ``fedlora export`` and ``fedlora eval``.

A run saves its adapters in peft format (:func:`fedlora.models.save_adapter`): ``adapters/global``
(the server's global model) and, for personalised methods, ``adapters/client_<k>``. When the run
finishes, :func:`write_cards` gives every one of them

- ``README.md``: its model card (:func:`model_card`), replacing peft's blank template: the method,
  the backbone, the data, the rounds, the clients, the final metrics, the command that made it and
  how to load it;
- ``fedlora.json``: the run's resolved config, strategy, config hash and command, which is what
  ``fedlora export`` and ``fedlora eval`` need to rebuild the backbone exactly (a built-in's name,
  ``tiny-bert``'s seeded random weights, ``train.max_length``) without the run folder.

``fedlora export ADAPTER --out DIR`` (:func:`export`) loads the backbone offline (fedlora's own
loaders: :mod:`fedlora.backbones`), puts the adapter on it with peft, merges it
(``merge_and_unload``) and saves an ordinary transformers model folder (weights, config with the
class names, tokenizer, a model card): ``AutoModelForSequenceClassification`` /
``AutoModelForCausalLM`` load it without peft or fedlora. ``fedlora eval ADAPTER --data FILE``
(:func:`evaluate_file`) scores the adapter on a .csv / .jsonl / .json file: accuracy for a
classifier (labels by class name or index), ROUGE-L, loss and perplexity for a causal LM (columns
``prompt`` / ``response`` by default), with the run's tokenisation, ``train.max_length`` and
precision, so that on the run's held-out global test set it prints the run's final global score.

An adapter folder written before ``fedlora.json`` existed is read with the ``results.json`` of its
run (two folders up), when it is still there.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedlora.errors import ConfigError

if TYPE_CHECKING:
    from fedlora.config import ExperimentConfig

logger = logging.getLogger("fedlora")

CARD_FILE = "README.md"
INFO_FILE = "fedlora.json"
PEFT_CONFIG = "adapter_config.json"
COMMAND_ENV = "FEDLORA_COMMAND"  # the fedlora command line this process runs (set by the CLI)


class AdapterError(ConfigError):
    """An adapter folder fedlora cannot use (printed as one line by the CLI)."""


def adapter_folders(out_dir: Path) -> list[Path]:
    """A run's saved adapters: ``adapters/global`` and ``adapters/client_<k>`` (those present)."""
    root = out_dir / "adapters"
    return sorted(p for p in root.iterdir() if (p / PEFT_CONFIG).is_file()) if root.is_dir() else []


def command_line() -> str:
    """The fedlora command that runs in this process ('' from Python)."""
    return os.environ.get(COMMAND_ENV, "")


# --------------------------------------------------------------------------- model cards
def write_cards(out_dir: Path, results: dict[str, Any]) -> list[Path]:
    """``README.md`` (the model card) and ``fedlora.json`` in every adapter folder of the run in
    ``out_dir`` (``results``: its results.json); returns the folders."""
    from fedlora.version import __version__

    command = command_line()
    folders = adapter_folders(out_dir)
    for folder in folders:
        info = {"fedlora": __version__, "adapter": folder.name, "strategy": results.get("strategy"),
                "config_hash": results.get("config_hash"), "command": command, "config": results.get("config")}
        (folder / INFO_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        card = model_card(results, folder.name, command, _ranks(folder))
        (folder / CARD_FILE).write_text(card, encoding="utf-8")
    return folders


def _ranks(folder: Path) -> str:
    """The LoRA rank(s) the saved adapter holds (peft's ``r`` and ``rank_pattern``), as text."""
    try:
        saved = json.loads((folder / PEFT_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    ranks = sorted({int(saved.get("r") or 0), *(int(r) for r in (saved.get("rank_pattern") or {}).values())} - {0})
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]} by module" if ranks else ""


def _number(value: Any, digits: int = 4) -> str:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return f"{value:.{digits}f}" if ok else "n/a"


def _client(adapter: str) -> str | None:
    """The partition id of a ``client_<k>`` adapter folder (None for ``global``)."""
    suffix = adapter.removeprefix("client_")
    return suffix if suffix != adapter and suffix.isdigit() else None


def model_card(results: dict[str, Any], adapter: str, command: str = "", ranks: str = "") -> str:
    """The model card (README.md) of the adapter folder ``adapter`` of a run with ``results``
    (``ranks``: the LoRA rank(s) the folder holds, e.g. ``rank 4``)."""
    from fedlora.backbones import public_model_name
    from fedlora.version import __version__

    cfg = results.get("config") or {}
    model, data, train, fed = (cfg.get(k) or {} for k in ("model", "data", "train", "federation"))
    causal = model.get("kind") == "causal_lm"
    base = public_model_name(str(model.get("path", "")))
    strategy = str(results.get("strategy", ""))
    info = results.get("strategy_info") or {}
    client = _client(adapter)
    which = f"client {client}'s own adapter (its personalised model)" if client else "the server's global adapter"
    front = ["---", f"base_model: {base}", "library_name: peft",
             f"pipeline_tag: {'text-generation' if causal else 'text-classification'}",
             "tags:", "- fedlora", "- federated-learning", "- lora", f"- {strategy}", "---", ""]
    lines = [f"# {strategy}: {which}", "",
             (f"A LoRA adapter for `{base}` trained by federated learning with fedlora {__version__} "
             f"(Flower, peft): {which}."), "", "## Training", "", "| | |", "|---|---|",
             *(f"| {key} | {value} |" for key, value in _training_rows(results, model, data, train, fed, info, ranks)),
             "", *_metric_lines(results, causal, client), "", "## Reproduce", ""]
    lines.append(f"Made by `{command}`." if command else
                 "Made from Python (`fedlora.run` / `fedlora.compare`): the resolved config is results.json's "
                 "`config` and this folder's fedlora.json.")
    lines += [f"Config hash `{results.get('config_hash', '')}` (fedlora.json holds the resolved config).", "",
              *_use_lines(str(model.get("path", "")), base, causal)]
    return "\n".join(front + lines) + "\n"


def _use_lines(path: str, base: str, causal: bool) -> list[str]:
    """The card's "Use" section: the commands, then peft with the base found offline where it can be."""
    from fedlora.backbones import BACKBONES

    entry = BACKBONES.get(path)
    if entry is not None and not entry.public_name:
        peft_route = (f"`{path}` is a random-weight backbone fedlora builds in code (for tests): load the adapter "
                      "with the commands above.")
    else:
        where = (f"`fedlora.backbones.resolve_model_path('{path}')` gives its local copy, no hub needed" if entry
                 else "the folder or hub id the run was configured with")
        peft_route = (f"With peft: the base is `{base}` ({where}), then `PeftModel.from_pretrained(base, ADAPTER)`"
                      + ("" if causal else "; the class names, in the head's order, are in labels.json") + ".")
    return ["## Use", "", "Offline, with fedlora installed (ADAPTER: this folder):", "", "```bash",
            f"fedlora eval ADAPTER --data FILE.csv      # {'ROUGE-L, loss, perplexity' if causal else 'accuracy'}",
            "fedlora export ADAPTER --out merged/      # a transformers model, no peft needed", "```", "", peft_route]


def _training_rows(results: dict[str, Any], model: dict[str, Any], data: dict[str, Any], train: dict[str, Any],
                   fed: dict[str, Any], info: dict[str, Any], ranks: str) -> list[tuple[str, str]]:
    cfg = results.get("config") or {}
    kind = "personalised" if info.get("personalized") else "global"
    paper = f" ({info['paper']})" if info.get("paper") else ""
    declared = (cfg.get("clients") or {}).get("ranks") or []
    rank = ranks or f"rank {model.get('lora_rank')}"
    if declared:
        rank += f" (the clients declared ranks {declared})"
    partition = str(data.get("partition"))
    if partition in ("dirichlet", "grouped"):
        partition += f" (alpha {data.get('dirichlet_alpha')})"
    elif partition == "pathological":
        partition += f" ({data.get('classes_per_client')} classes per client)"
    classes = len(results.get("id2label") or {})
    rows = [
        ("method", f"`{results.get('strategy')}`{paper}, a {kind} method"),
        ("backbone", (f"`{model.get('path')}` ({model.get('kind')}), LoRA {rank}, alpha {model.get('lora_alpha')}, "
                     f"dropout {model.get('lora_dropout')}, on {', '.join(model.get('target_modules') or [])}, "
                     f"init {model.get('init')}")),
        ("data", f"{data.get('source')} / {data.get('task')}" + (f", {classes} classes" if classes else "")
         + f", {data.get('max_examples') or 'all'} examples, {partition} over the clients, data.seed {data.get('seed')}, "
         f"held-out global test of {data.get('global_test_size')}"
         + (f", label noise {data.get('label_noise')} {data.get('noise_rate')}" if data.get("label_noise") not in
            (None, "none") else "")),
        ("rounds", (f"{train.get('rounds')} rounds of {train.get('local_epochs')} local epoch(s) capped at "
                   f"{train.get('max_steps')} steps, batch {train.get('batch_size')}, lr {train.get('lr')}, "
                   f"max_length {train.get('max_length')}, train.seed {train.get('seed')}")),
        ("clients", (f"{data.get('num_clients')} clients, {fed.get('fraction_train')} of them training and "
                    f"{fed.get('fraction_evaluate')} evaluating per round")),
    ]
    privacy = results.get("privacy")
    if privacy:
        rows.append(("privacy", ", ".join(f"{k} {_number(v, 3) if isinstance(v, float) else v}"
                                          for k, v in privacy.items())))
    return rows


def _metric_lines(results: dict[str, Any], causal: bool, client: str | None) -> list[str]:
    final = results.get("final") or {}
    rounds = results.get("rounds") or []
    if causal:
        zero_shot = rounds[0].get("global_rouge_l") if rounds and rounds[0].get("round") == 0 else None
        rows = [("global ROUGE-L", final.get("global_rouge_l"), ("the global model's greedy generations on the "
                 "held-out global test instructions")),
                ("zero-shot ROUGE-L", zero_shot, "the backbone without training (round 0)"),
                ("global perplexity", final.get("global_perplexity"), "per response token, global test"),
                ("personalised ROUGE-L", final.get("personalized_rouge_l"), ("clients' own models on their local "
                 "tests, example-weighted"))]
    else:
        rows = [("global accuracy", final.get("global_accuracy"), "the global model on the held-out global test set"),
                ("personalised accuracy", final.get("personalized_accuracy"), ("each client's own model on its local "
                 "test, example-weighted")),
                ("worst client", final.get("personalized_accuracy_worst"), "lowest personalised accuracy"),
                ("received accuracy", final.get("received_accuracy"), "each client's download before local training")]
    if client is not None:
        own = ((rounds[-1].get("per_client") or {}).get(client) or {}) if rounds else {}
        key = "rouge-l" if causal else "accuracy"
        rows.insert(0, (f"this client's {'ROUGE-L' if causal else 'accuracy'}", own.get(key),
                        f"client {client}'s model on its local test split, last round"))
    shown = [f"| {name} | {_number(value)} | {meaning} |" for name, value, meaning in rows]
    total = final.get("bytes_total")
    return [f"## Final metrics (round {final.get('round', 'n/a')})", "", "| metric | value | what |",
            "|---|---|---|", *shown, "",
            (f"Communication: {_number((total or 0) / 1e6, 2)} MB of adapters exchanged in all; "
            f"run time {_number(results.get('wall_seconds'), 0)} s.")]


# --------------------------------------------------------------------------- reading an adapter
@dataclass
class Adapter:
    """A saved adapter folder and what rebuilding its model needs."""

    folder: Path
    config: ExperimentConfig  # the resolved config of the run that saved it
    labels: list[str] | None  # a classifier's class names, in the head's order
    extra: list[str]  # further adapters in subfolders (FedDPA's local branch), active with "default"

    @property
    def causal(self) -> bool:
        return self.config.model.kind == "causal_lm"


def read_adapter(folder: str | Path) -> Adapter:
    """The adapter in ``folder``: its run's config (``fedlora.json``, else the run's results.json
    two folders up), its class names (``labels.json``) and further adapters. AdapterError (one line)
    for a folder that is not a fedlora adapter."""
    from fedlora.config import build_config
    from fedlora.schema import with_record_defaults

    path = Path(folder)
    if not (path / PEFT_CONFIG).is_file():
        what = "does not exist" if not path.exists() else f"holds no {PEFT_CONFIG} (not a peft adapter folder)"
        raise AdapterError(f"adapter {folder} {what}; give a run's adapters/global or adapters/client_<k> folder")
    raw = _run_config(path)
    try:
        config = build_config(with_record_defaults(raw))
    except ConfigError as error:
        raise AdapterError(f"adapter {folder}: its run's config is not valid here: {error}") from None
    labels = None
    if config.model.kind != "causal_lm":
        labels = _labels(path)
    extra = sorted(p.name for p in path.iterdir() if (p / PEFT_CONFIG).is_file())
    return Adapter(path, config, labels, extra)


def _run_config(path: Path) -> dict[str, Any]:
    for source, key in ((path / INFO_FILE, "config"), (path.parent.parent / "results.json", "config")):
        if source.is_file():
            try:
                config = json.loads(source.read_text(encoding="utf-8")).get(key)
            except (OSError, ValueError, AttributeError) as error:
                raise AdapterError(f"adapter {path}: cannot read {source}: {error}") from None
            if isinstance(config, dict):
                return config
    raise AdapterError(f"adapter {path} has no {INFO_FILE} (written by fedlora runs) and no results.json two "
                       "folders up: fedlora cannot tell its backbone and settings")


def _labels(path: Path) -> list[str]:
    from fedlora.models import LABELS_FILE

    try:
        id2label = json.loads((path / LABELS_FILE).read_text(encoding="utf-8"))["id2label"]
        return [str(id2label[str(i)]) for i in range(len(id2label))]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise AdapterError(f"adapter {path}: no readable {LABELS_FILE} (the classifier's class names): "
                           f"{type(error).__name__}") from None


def load_model(adapter: Adapter, device: str = "cpu") -> Any:
    """The peft model of ``adapter`` on its backbone, loaded offline with fedlora's loaders (the
    seeded classifier or causal LM the run trained on; every adapter of the folder active), in eval mode."""
    from peft import PeftModel

    from fedlora.backbones import base_classifier, load_causal_lm
    from fedlora.models import _peft_deprecation_quiet

    cfg = adapter.config
    if adapter.labels is None:
        base = load_causal_lm(cfg.model.path, device)
    else:
        base = copy.deepcopy(base_classifier(cfg.model.path, len(adapter.labels), cfg.train.seed))
        base.config.id2label = dict(enumerate(adapter.labels))
        base.config.label2id = {name: i for i, name in enumerate(adapter.labels)}
    with _peft_deprecation_quiet():  # peft's wrap reads an attribute transformers deprecates: one warning dropped
        model = PeftModel.from_pretrained(base, str(adapter.folder), is_trainable=False)
        for name in adapter.extra:
            model.load_adapter(str(adapter.folder / name), adapter_name=name)
    if adapter.extra:
        layers: Any = model.base_model  # peft's LoraModel: several adapters active at once
        layers.set_adapter(["default", *adapter.extra])
    return model.to(device).eval()


# --------------------------------------------------------------------------- export
def export(folder: str | Path, out: str | Path) -> Path:
    """Merge the adapter in ``folder`` into its backbone and save a transformers model folder in
    ``out`` (new or empty): weights, config (a classifier's class names included), tokenizer and a
    model card. Returns ``out``."""
    from fedlora.app.folders import check_writable
    from fedlora.app.quiet import output

    adapter = read_adapter(folder)
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise AdapterError(f"--out {out} is not a new or empty folder; give one (nothing there is overwritten)")
    check_writable(target, "--out")
    existed = target.exists()
    try:
        with output():  # fedlora's lines only: no loading or saving bars
            _save_merged(adapter, target)
    except BaseException:  # no half-written model left behind
        if existed:
            for entry in target.iterdir():
                shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        else:
            shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def _save_merged(adapter: Adapter, target: Path) -> None:
    from fedlora.backbones import load_tokenizer

    merged = load_model(adapter).merge_and_unload()
    merged.config.name_or_path = ""
    target.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(str(target))
    load_tokenizer(adapter.config.model.path).save_pretrained(str(target))
    card_source = adapter.folder / CARD_FILE
    card = card_source.read_text(encoding="utf-8") if card_source.is_file() else ""
    note = (f"\n## Merged\n\nThis folder is the adapter `{adapter.folder}` merged into its backbone by `fedlora "
            "export` (peft's merge_and_unload): an ordinary transformers model, loaded without peft.\n")
    (target / CARD_FILE).write_text(card.replace("library_name: peft", "library_name: transformers") + note,
                                    encoding="utf-8")


# --------------------------------------------------------------------------- eval
@dataclass
class FileScores:
    """``fedlora eval``'s scores of an adapter on a data file."""

    examples: int
    accuracy: float = math.nan  # classifier
    rouge_l: float = math.nan  # causal LM: greedy generations on the first rouge_examples rows
    rouge_examples: int = 0
    loss: float = math.nan  # causal LM: per response token; classifier: mean cross-entropy
    perplexity: float = math.nan

    def line(self) -> str:
        if math.isfinite(self.accuracy) or not math.isfinite(self.rouge_l):
            return f"accuracy {_number(self.accuracy)} on {self.examples} examples (loss {_number(self.loss)})"
        return (f"ROUGE-L {_number(self.rouge_l)} on {self.rouge_examples} of {self.examples} examples, loss "
                f"{_number(self.loss)} per response token, perplexity {_number(self.perplexity, 2)}")


def evaluate_file(folder: str | Path, data: str | Path, text_column: str | None = None,
                  label_column: str | None = None, batch_size: int | None = None) -> FileScores:
    """Score the adapter in ``folder`` on the .csv / .jsonl / .json file ``data``: a classifier's
    accuracy (``text_column`` default ``text``, ``label_column`` default ``label``: class names or
    indices), a causal LM's ROUGE-L, loss and perplexity (default columns ``prompt`` / ``response``;
    ROUGE-L on the first ``train.rouge_examples`` rows, as the run scored). Tokenisation,
    ``train.max_length`` and precision are the run's; ``batch_size`` defaults to its
    ``train.eval_batch_size``."""
    import torch

    from fedlora.app.quiet import output
    from fedlora.backbones import load_tokenizer, resolve_device
    from fedlora.data.sources import read_local
    from fedlora.training import resolve_precision

    adapter = read_adapter(folder)
    cfg = adapter.config
    texts_column = text_column or ("prompt" if adapter.causal else "text")
    targets_column = label_column or ("response" if adapter.causal else "label")
    columns = read_local(Path(data), texts_column, targets_column, where=str(data))
    if not columns.texts:
        raise AdapterError(f"{data}: no rows to evaluate")
    device = resolve_device(cfg.train.device)
    precision = resolve_precision(cfg.train.precision, device)
    tokenizer = load_tokenizer(cfg.model.path)
    size = batch_size or cfg.train.eval_batch_size
    with output(), torch.no_grad():
        model = load_model(adapter, str(device))
        if adapter.labels is None:
            return _score_instructions(model, columns, tokenizer, device, precision, size, cfg)
        return _score_classes(model, columns, adapter.labels, tokenizer, device, precision, size, cfg.train.max_length,
                              str(data), targets_column)


def _class_ids(raw: list[Any], labels: list[str], where: str, column: str) -> list[int]:
    """Each raw label as the head's class index: a class name, or an index in 0..K-1."""
    index = {name: i for i, name in enumerate(labels)}
    ids = []
    for row, value in enumerate(raw, start=1):
        if str(value) in index:
            ids.append(index[str(value)])
        elif isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(labels):
            ids.append(value)
        else:
            shown = ", ".join(labels[:8]) + (", ..." if len(labels) > 8 else "")
            raise AdapterError(f"{where}: row {row}: label {value!r} (column '{column}') is not one of the adapter's "
                               f"{len(labels)} classes ({shown}) nor an index 0..{len(labels) - 1}")
    return ids


def _score_classes(model: Any, columns: Any, labels: list[str], tokenizer: Any, device: Any, precision: Any,
                   batch_size: int, max_length: int, where: str, column: str) -> FileScores:
    import datasets

    from fedlora.data.sources import label_features
    from fedlora.training import evaluate, make_loader

    ids = _class_ids(columns.labels, labels, where, column)
    texts = ["" if text is None else str(text) for text in columns.texts]
    dataset = datasets.Dataset.from_dict({"text": texts, "label": ids}, features=label_features(labels))
    stats = evaluate(model, make_loader(dataset, tokenizer, batch_size, max_length, shuffle=False), device, precision)
    return FileScores(examples=stats.examples, accuracy=stats.accuracy, loss=stats.loss)


def _score_instructions(model: Any, columns: Any, tokenizer: Any, device: Any, precision: Any, batch_size: int,
                        cfg: ExperimentConfig) -> FileScores:
    import datasets

    from fedlora.causal_lm import INSTRUCTIONS, evaluate_generation
    from fedlora.training import make_loader

    prompts = ["" if text is None else str(text) for text in columns.texts]
    responses = ["" if text is None else str(text) for text in columns.labels]
    dataset = datasets.Dataset.from_dict({"prompt": prompts, "response": responses})
    loader = make_loader(dataset, tokenizer, batch_size, cfg.train.max_length, shuffle=False, rows=INSTRUCTIONS)
    scores = evaluate_generation(model, dataset, loader, tokenizer, device, cfg.train.max_new_tokens,
                                 cfg.train.rouge_examples, batch_size, precision=precision)
    return FileScores(examples=len(dataset), rouge_l=scores.rouge_l, rouge_examples=scores.rouge_examples,
                      loss=scores.loss, perplexity=scores.perplexity)
