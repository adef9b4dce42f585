"""Instruction data for causal language models: every source becomes one ``datasets.Dataset`` with
``prompt`` (the instruction), ``response`` (the reference answer) and ``label`` (a ``ClassLabel``:
what the instruction is about, used only to partition the clients and to split stratified).

Sources (``DataConfig.source`` with ``model.kind = 'causal_lm'``), all offline:

- ``wordnet`` with ``task = 'define'``: WordNet 3.0 (Debian ``wordnet-base``) noun synsets of the
  8 largest noun topics as "Define the word 'X' (noun)." -> the gloss (its definition part,
  without the quoted examples); the class is the lexicographer topic (``noun.artifact``, ...),
  so a Dirichlet or pathological partition over topics makes clients differ in what they are
  asked about.
- ``chatterbot``: the English part of the ``chatterbot-corpus`` wheel (BSD licence): every pair
  of consecutive turns of a conversation is an instruction and its answer; the class is the
  corpus file (21 categories: ai, coding, emotion, tech_support, trivia, ...).
- ``wordnet+chatterbot``: both task types in one federation, balanced (as many WordNet
  definitions, a seeded sample, as chatterbot pairs); the class is the task
  (``define`` / ``chat``), so ``partition = 'pathological'`` with ``classes_per_client = 1``
  gives each client one kind of task (the NLG setting of FedTreeLoRA).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from pathlib import Path

import datasets
import numpy as np

from fedlora.data.sources import LEXICOGRAPHER_FILES, WORDNET_DIR, DataError, subsample
from fedlora.schema import INSTRUCTION_SOURCES, DataConfig

DEFINE_TEMPLATE = "Define the word '{word}' ({pos})."


def instruction_features(names: list[str]) -> datasets.Features:
    """``prompt``, ``response`` (strings) and ``label`` (ClassLabel over ``names``)."""
    return datasets.Features({
        "prompt": datasets.Value("string"),
        "response": datasets.Value("string"),
        "label": datasets.ClassLabel(names=names),
    })


def load_instructions(cfg: DataConfig) -> datasets.Dataset:
    """The instruction source named by ``cfg.source`` (and ``cfg.task`` for WordNet), deterministic;
    with ``cfg.max_examples > 0`` a subsample stratified by class (seeded by ``cfg.seed``)."""
    return subsample(_instruction_source(cfg), cfg)


def _instruction_source(cfg: DataConfig) -> datasets.Dataset:
    if cfg.source == "wordnet":
        if cfg.task != "define":
            raise DataError(f"data.task = {cfg.task!r} is not an instruction task; use data.task = 'define'")
        return _wordnet_definitions()
    if cfg.source == "chatterbot":
        return _chatterbot()
    if cfg.source == "wordnet+chatterbot":
        return _mixed(cfg.seed)
    raise DataError(f"data.source = {cfg.source!r} has no instructions; use one of {', '.join(INSTRUCTION_SOURCES)}")


# ---------------------------------------------------------------- WordNet definitions


@functools.lru_cache(maxsize=1)
def _wordnet_definitions() -> datasets.Dataset:
    """"Define the word 'X' (noun)." -> gloss, for the noun synsets of the 8 largest noun topics."""
    path = WORDNET_DIR / "data.noun"
    if not path.is_file():
        raise DataError(f"WordNet file missing: {path}: install the Debian package wordnet-base")
    rows: list[tuple[str, str, int]] = []  # (word, definition, lex_filenum)
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if line[:2] == "  ":  # licence header
                continue
            parsed = parse_definition_line(line)
            if parsed is not None:
                rows.append(parsed)
    lex = np.array([r[2] for r in rows])
    counts = np.bincount(lex, minlength=len(LEXICOGRAPHER_FILES))
    nouns = [i for i, name in enumerate(LEXICOGRAPHER_FILES) if name.startswith("noun.")]
    top8 = sorted(sorted(nouns, key=lambda i: -counts[i])[:8])  # the classification task noun8's topics
    new_label = {old: new for new, old in enumerate(top8)}
    keep = [r for r in rows if r[2] in new_label]
    return datasets.Dataset.from_dict(
        {
            "prompt": [DEFINE_TEMPLATE.format(word=word, pos="noun") for word, _, _ in keep],
            "response": [definition for _, definition, _ in keep],
            "label": [new_label[lex_file] for _, _, lex_file in keep],
        },
        features=instruction_features([LEXICOGRAPHER_FILES[i] for i in top8]),
    )


def parse_definition_line(line: str) -> tuple[str, str, int] | None:
    """``offset lex_filenum ss_type w_cnt word lex_id ... | gloss`` -> (first word, definition,
    lex_filenum); None for a synset without a definition. Underscores in the word become spaces;
    the definition is the gloss up to its first quoted example."""
    head, _, gloss = line.partition("|")
    fields = head.split()
    definition = gloss.split('; "', 1)[0].strip()
    if not definition or len(fields) < 5:
        return None
    word = fields[4].replace("_", " ")
    return word, definition, int(fields[1])


# ---------------------------------------------------------------- chatterbot-corpus


def chatterbot_dir() -> Path:
    """The English data folder of the chatterbot-corpus wheel (located without importing it)."""
    spec = importlib.util.find_spec("chatterbot_corpus")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("data.source 'chatterbot' needs the corpus: pip install --no-deps chatterbot-corpus==1.3.3")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "english"


@functools.lru_cache(maxsize=1)
def _chatterbot() -> datasets.Dataset:
    """Consecutive turns of every English chatterbot conversation; class = the corpus file."""
    import yaml  # PyYAML, a dependency of datasets

    files = sorted(chatterbot_dir().glob("*.yml"))
    if not files:
        raise DataError(f"no chatterbot-corpus files in {chatterbot_dir()}: reinstall chatterbot-corpus")
    prompts: list[str] = []
    responses: list[str] = []
    labels: list[int] = []
    for label, path in enumerate(files):
        for conversation in yaml.safe_load(path.read_text(encoding="utf-8")).get("conversations") or []:
            turns = [str(turn).strip() for turn in conversation]
            for prompt, response in itertools.pairwise(turns):
                if prompt and response:
                    prompts.append(prompt)
                    responses.append(response)
                    labels.append(label)
    return datasets.Dataset.from_dict(
        {"prompt": prompts, "response": responses, "label": labels},
        features=instruction_features([path.stem for path in files]),
    )


# ---------------------------------------------------------------- both task types


def _mixed(seed: int) -> datasets.Dataset:
    """Chatterbot pairs (class 'chat') and as many WordNet definitions (class 'define', a seeded sample)."""
    chat = _chatterbot()
    define = _wordnet_definitions()
    chosen = np.sort(np.random.default_rng(seed).choice(len(define), size=min(len(chat), len(define)), replace=False))
    define = define.select(chosen)
    return datasets.Dataset.from_dict(
        {
            "prompt": define["prompt"][:] + chat["prompt"][:],
            "response": define["response"][:] + chat["response"][:],
            "label": [0] * len(define) + [1] * len(chat),
        },
        features=instruction_features(["define", "chat"]),
    )
