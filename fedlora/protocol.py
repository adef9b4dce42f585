"""The message contract between fedlora's ServerApp (strategies) and its ClientApp (clients).

Every key that travels between them is declared here, once, and used from here (strategies,
clients, the engines and the app never spell one out): the records a message carries, the
config a message carries (fedlora's own keys and each method's), the node config a SuperNode
gives its ClientApp, the metrics a reply carries, and the metrics a strategy hands back to
Flower's loop. ``tests/test_wire_contract.py`` holds the code to it.

- A **query** message carries ``config`` (:data:`CONFIG_RECORD`) with the experiment
  (:data:`EXPERIMENT`); its reply carries the client's profile (:data:`PROFILE_RECORD`, one
  :data:`PROFILE_JSON` entry).
- A **train** or **evaluate** message carries ``arrays`` (:data:`ARRAYS_RECORD`, the download)
  and ``config`` (:data:`CONFIG_RECORD`): :data:`MESSAGE_KEYS` plus the method's own
  (:data:`METHOD_CONFIG_KEYS`). A config given to ``configure_*`` (Flower's ``train_config`` /
  ``evaluate_config``) travels next to them, without fedlora's own keys; Flower's fixed-clipping
  DP wrapper adds its clipping norm (``flwr``'s ``KEY_CLIPPING_NORM``, Flower's key, not ours).
- A **train** reply carries ``arrays`` (the upload), ``metrics`` (:data:`METRICS_RECORD`:
  :data:`TRAIN_METRICS`, and names under :data:`METRIC_PREFIXES`) and ``worker``
  (:data:`WORKER_RECORD`: where it ran, :data:`WORKER_ENTRIES`); an **evaluate** reply carries
  ``metrics`` (:data:`EVALUATE_METRICS`). Every reply metric has a contract, declared once here
  beside its name: its :class:`MetricRule` (a number, its range, NaN or not, whole or not, the
  keys it needs beside it) in :data:`TRAIN_RULES` / :data:`EVALUATE_RULES`, the names a method
  builds under its prefix in :data:`TRAIN_PATTERNS`, the keys a reply must carry
  (:data:`TRAIN_REQUIRED`, :data:`EVALUATE_REQUIRED`) and the size of a metrics record
  (:data:`MAX_METRIC_KEYS`, :data:`MAX_METRIC_KEY_LENGTH`, :data:`MAX_METRIC_BYTES`). The server
  refuses a reply that breaks it (``strategies/replies.py``).
- A SuperNode's node config (``flower-supernode --node-config``, or the simulation engine's) holds
  :data:`NODE_CONFIG_KEYS` and ``budget-<name>`` entries (:data:`NODE_BUDGET_PREFIX`).
- ``aggregate_train`` / ``aggregate_evaluate`` and the ServerApp's ``evaluate_fn`` (``RoundDriver.after_round``) return
  :data:`ROUND_METRICS` to Flower's loop.

Payload keys (the names of the arrays in ``arrays``: ``<module>::A``, ``head::<name>``) are the
LoRA codec's, ``fedlora.lora`` (:mod:`fedlora.lora.peft_keys` maps them to peft's). results.json
keeps its own field names (``fedlora.results``); its per-client entries are reply metrics.

This module imports nothing of fedlora's: every layer may use it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, Literal

if TYPE_CHECKING:
    from flwr.app import Message

Phase = Literal["train", "evaluate"]  # which message a hook is building

# ------------------------------------------------------------------ records of a message's content
ARRAYS_RECORD: Final = "arrays"  # ArrayRecord: the download (train / evaluate) or the upload (train reply)
CONFIG_RECORD: Final = "config"  # ConfigRecord: the message config (query, train, evaluate)
METRICS_RECORD: Final = "metrics"  # MetricRecord: a train or evaluate reply's metrics
PROFILE_RECORD: Final = "profile"  # ConfigRecord: a query reply's client profile
PROFILE_JSON: Final = "json"  # its one entry: the ClientProfile as JSON
WORKER_RECORD: Final = "worker"  # ConfigRecord of a train reply: where the message ran
RECORDS: Final = frozenset({ARRAYS_RECORD, CONFIG_RECORD, METRICS_RECORD, PROFILE_RECORD, WORKER_RECORD})

# entries of the worker record
WORKER_HOST: Final = "host"  # the host name
WORKER_RAY_NODE: Final = "ray-node"  # the Ray node id, when the simulation engine runs on Ray
WORKER_THREADS: Final = "torch-threads"  # torch's intra-op threads the client trained with
WORKER_PRECISION: Final = "train-precision"  # train.precision as the client resolved it: "fp32" / "bf16"
WORKER_ENTRIES: Final = frozenset({WORKER_HOST, WORKER_RAY_NODE, WORKER_THREADS, WORKER_PRECISION})

# ------------------------------------------------------------------ message config (server -> client)
SERVER_ROUND: Final = "server-round"
EXPERIMENT: Final = "experiment"  # the resolved experiment config, JSON (query messages too)
RANK: Final = "lora-rank"  # the rank this client trains / evaluates at this round (the one rank decision)
CHECKPOINT_DIR: Final = "checkpoint-dir"  # where the client keeps its state (simulation: in the run folder)
RESUME_ROUND: Final = "resume-round"  # a resumed run: restore the client state of this round
STATE_ON_DISK: Final = "state-on-disk"  # simulation: between messages the state lives in its checkpoint file
EVAL_RECEIVED: Final = "eval-received"  # train: evaluate the received model before local training
EVAL_GLOBAL: Final = "eval-global"  # evaluate: also evaluate on the global test set (no global model)
SAVE_ADAPTER_DIR: Final = "save-adapter-dir"  # evaluate, last round: save the client's adapter there
LABEL_NAMES: Final = "label-names"  # the server's class names (a silo with its own data encodes its labels with them)
# secure aggregation (SecAgg+, docs/secure-aggregation.md): the train message of its masking stage, which also
# carries the SecAgg+ record (``secaggplus_configs``, Flower's keys and fedlora's below); read by clients/secure.py
SECAGG_CLIP: Final = "secagg-clip"  # scale the update down to this L2 norm before masking (0: no clipping)
SECAGG_RANGE: Final = "secagg-range"  # c: refuse to mask an update with an entry beyond [-c, c]
SECAGG_PAD_RANK: Final = "secagg-pad-rank"  # zero-pad A rows / B columns to this rank before masking (0: none)
SECAGG_KEYS: Final = frozenset({SECAGG_CLIP, SECAGG_RANGE, SECAGG_PAD_RANK})
# fedlora's entries of the SecAgg+ record (next to Flower's ``Key`` entries, docs/secure-aggregation.md)
# setup stage, server -> client: the round's public parameters beyond Flower's (all of them in the transcript)
SECAGG_GENERATOR: Final = "secagg-generator"  # the mask generator of the round (fedlora.secagg.MASK_GENERATOR)
SECAGG_SERVER_KEY: Final = "secagg-server-key"  # the server's one-round public key (proofs of possession)
SECAGG_NODES: Final = "secagg-nodes"  # the sampled clients' node ids ...
SECAGG_COUNTS: Final = "secagg-counts"  # ... and the example counts they declared when they joined
SECAGG_MAX_SHARE: Final = "secagg-max-share"  # faults.max_client_share: the share rule's bound
SECAGG_SIZE_CUT: Final = "secagg-size-cut"  # the share rule's entitlement cut (fedlora.shares.size_cut; 0: none)
SECAGG_WEIGHTING: Final = "secagg-weighting"  # 'examples' (the share rule on the counts) or 'uniform'
SECAGG_LOW_THRESHOLD: Final = "secagg-low-threshold"  # the operator allowed a threshold at most half the shares
# setup stage, client -> server
SECAGG_PROOF: Final = "secagg-proof"  # the client's proof that it holds its two private keys
# share-keys stage, client -> server: commitments to its shares (to each holder, itself included) and its seed
SECAGG_HOLDERS: Final = "secagg-holders"  # node ids, aligned with ...
SECAGG_COMMITMENTS: Final = "secagg-commitments"  # ... seed-share commitment + key-share commitment (64 bytes)
SECAGG_SEED_COMMITMENT: Final = "secagg-seed-commitment"  # commitment to the private mask seed (32 bytes)
# masking stage, server -> client: the sources' commitments for this client (aligned with Flower's sources) and
# the weight the server chose; client -> server: the sources whose shares it could not use
SECAGG_WEIGHT: Final = "secagg-weight"  # the aggregation weight the server chose for this client (at most W)
SECAGG_COMPLAINTS: Final = "secagg-complaints"  # node ids whose encrypted shares were not theirs to this client
# unmask stage: dropped nodes whose key too few neighbours hold valid shares of (server -> client), and the
# client's pairwise mask key with each of them, in that order (client -> server)
SECAGG_REVEAL: Final = "secagg-reveal"
SECAGG_REVEALED: Final = "secagg-revealed"
SECAGG_RECORD_KEYS: Final = frozenset({
    SECAGG_GENERATOR, SECAGG_SERVER_KEY, SECAGG_NODES, SECAGG_COUNTS, SECAGG_MAX_SHARE, SECAGG_SIZE_CUT, SECAGG_WEIGHTING,
    SECAGG_LOW_THRESHOLD, SECAGG_PROOF, SECAGG_HOLDERS, SECAGG_COMMITMENTS, SECAGG_SEED_COMMITMENT, SECAGG_WEIGHT,
    SECAGG_COMPLAINTS, SECAGG_REVEAL, SECAGG_REVEALED})
# fedlora's own message config keys: a config given to ``configure_*`` (Flower's ``train_config`` /
# ``evaluate_config``) travels next to them, without these keys
MESSAGE_KEYS: Final = frozenset({SERVER_ROUND, EXPERIMENT, RANK, CHECKPOINT_DIR, RESUME_ROUND, STATE_ON_DISK,
                                 EVAL_RECEIVED, EVAL_GLOBAL, SAVE_ADAPTER_DIR, LABEL_NAMES, *SECAGG_KEYS})

# a method's own message config (its strategy's ``Download.config``, read by its trainer)
# centralized, train: the clients a federated round samples (the step budget)
CENTRALIZED_CLIENTS: Final = "centralized-clients"
FEDHERA_R_TOT: Final = "fedhera-r-tot"  # FedHera: JSON {module: r_tot} (a train metric too: their sum)
FEDHERA_R_MAIN: Final = "fedhera-r-main"  # FedHera: JSON {module: r_main} (a train metric too: their sum)
FEDHERA_LAMBDA: Final = "fedhera-lambda"  # FedHera: the tail warm-up lambda_k (1.0 in evaluation messages)
METHOD_CONFIG_KEYS: Final = frozenset({CENTRALIZED_CLIENTS, FEDHERA_R_TOT, FEDHERA_R_MAIN, FEDHERA_LAMBDA})

# ------------------------------------------------------------------ capabilities a ClientApp declares (its profile)
SECURE_AGGREGATION: Final = "secure-aggregation"  # masks its update with Flower's SecAgg+ mod (clients/secure.py)
CAPABILITIES: Final = frozenset({SECURE_AGGREGATION})

# ------------------------------------------------------------------ node config (SuperNode -> ClientApp)
NODE_PARTITION_ID: Final = "partition-id"  # the client's partition (simulation: Flower's engine sets it)
NODE_NUM_PARTITIONS: Final = "num-partitions"
NODE_RANK: Final = "rank"  # the LoRA rank the silo declares (default: the experiment's [clients])
NODE_DATA_PATH: Final = "data-path"  # a silo's own data file
NODE_CHECKPOINT_DIR: Final = CHECKPOINT_DIR  # a silo's own state folder (before the server's)
NODE_CACHE_DIR: Final = "cache-dir"  # a silo's folder for derived model files (default $FEDLORA_CACHE)
NODE_BUDGET_PREFIX: Final = "budget-"  # budget-<name> = a budget the silo declares (budget-time, ...)
NODE_CONFIG_KEYS: Final = frozenset({NODE_PARTITION_ID, NODE_NUM_PARTITIONS, NODE_RANK, NODE_DATA_PATH,
                                     NODE_CHECKPOINT_DIR, NODE_CACHE_DIR})

# ------------------------------------------------------------------ reply metrics (client -> server)
@dataclass(frozen=True)
class MetricRule:
    """The contract of one reply metric: a number in [low, high], integer-valued or not, NaN
    allowed or not (a value the client could not measure); +-inf only where ``high`` / ``low`` is
    infinite and ``infinite`` allows it. ``needs``: the keys the reply must carry beside it;
    ``at_most``: metrics of the same reply it cannot exceed (those the reply carries)."""

    low: float = -math.inf
    high: float = math.inf
    integer: bool = False
    nan: bool = False
    infinite: bool = False
    needs: tuple[str, ...] = ()
    at_most: tuple[str, ...] = ()

    def problem(self, value: float) -> str:
        """Why ``value`` is not allowed ('' if it is)."""
        if math.isnan(value):
            return "" if self.nan else "is NaN"
        if math.isinf(value) and not self.infinite:
            return "is infinite"
        if not self.low <= value <= self.high:
            return f"is outside [{self.low:g}, {self.high:g}]"
        if self.integer and not float(value).is_integer():
            return "is not a whole number"
        return ""


@dataclass(frozen=True)
class MetricPattern:
    """Metric names a method builds under its ``prefix`` (the whole name matches ``pattern``), all
    with one ``rule``; any other name under the prefix is undeclared."""

    prefix: str
    pattern: re.Pattern[str]
    rule: MetricRule


# Bounds a client's numbers cannot pass: no honest value comes near them, and a sum over any number
# of clients a round can hold stays finite (so no sum or mean over clients overflows)
MAX_COUNT: Final = 1e12  # examples, tokens, steps, samples
MAX_SECONDS: Final = 1e7  # a duration (about 116 days)
MAX_LOSS: Final = 1e6  # a cross-entropy loss (per example or per token)
MAX_RANK: Final = 65536.0  # a LoRA rank
# The size of a reply's metrics record (an honest reply carries about 20 metrics, FedTreeLoRA one per
# block more): more keys, a longer key, or more bytes (keys' UTF-8 + 8 per value) refuse the reply
MAX_METRIC_KEYS: Final = 128
MAX_METRIC_KEY_LENGTH: Final = 64
MAX_METRIC_BYTES: Final = 8192

COUNT: Final = MetricRule(low=0.0, high=MAX_COUNT, integer=True)
POSITIVE_COUNT: Final = MetricRule(low=1.0, high=MAX_COUNT, integer=True)
FRACTION: Final = MetricRule(low=0.0, high=1.0)  # an accuracy, ROUGE-L, a rate (an empty split: 0, never NaN)
LOSS_VALUE: Final = MetricRule(low=0.0, high=MAX_LOSS)
SECONDS: Final = MetricRule(low=0.0, high=MAX_SECONDS)
STARTUP_SECONDS: Final = MetricRule(low=0.0, high=MAX_SECONDS, nan=True)  # NaN: the client cannot tell

# both replies
NUM_EXAMPLES: Final = "num-examples"  # train: training examples; evaluate: local test examples
PARTITION_ID: Final = "partition-id"  # the partition the reply speaks for (checked against its sender)
# a reply's start-up cost (clients/app.py; results.json per_client / per_client_train): message
# arrival (process start, or the warm SuperExec's hand-over) -> ClientApp module imported, the setup
# phases, -> local work starts, -> the first training step (the last two: a process's first message)
IMPORT_SECONDS: Final = "import-seconds"  # arrival -> the ClientApp module imported (FAB install included)
SETUP_SECONDS: Final = "setup-seconds"  # heavy imports, config and data of this message
SETUP_LIBRARIES_SECONDS: Final = "setup-libraries-seconds"  # torch, transformers, peft, datasets, trainers
SETUP_DATA_SECONDS: Final = "setup-data-seconds"  # config, profile, the federated data and this split
SETUP_MODEL_SECONDS: Final = "setup-model-seconds"  # backbone and tokenizer loaded (once per process)
SETUP_ADAPTER_SECONDS: Final = "setup-adapter-seconds"  # the model with its adapter, the download loaded
START_SECONDS: Final = "start-seconds"  # a process's first message: arrival -> local work starts
FIRST_STEP_SECONDS: Final = "first-step-seconds"  # a process's first message: arrival -> first optimiser step
STARTUP_METRICS: Final = frozenset({IMPORT_SECONDS, SETUP_SECONDS, SETUP_LIBRARIES_SECONDS, SETUP_DATA_SECONDS,
                                    SETUP_MODEL_SECONDS, SETUP_ADAPTER_SECONDS, START_SECONDS, FIRST_STEP_SECONDS})

# train reply
TRAIN_LOSS: Final = "train-loss"  # mean local training loss (NaN: no optimiser step)
TRAIN_STEPS: Final = "train-steps"
TRAIN_SECONDS: Final = "train-seconds"
TRAIN_EXAMPLES: Final = "train-examples"  # examples seen in local training (over all epochs)
RECEIVED_ACCURACY: Final = "received-accuracy"  # the received model on the local test split (eval rounds)
RECEIVED_EXAMPLES: Final = "received-examples"
RECEIVED_TOKEN_ACCURACY: Final = "received-token-accuracy"  # causal LM: teacher-forced next-token accuracy
RECEIVED_LOSS: Final = "received-loss"  # causal LM: NLL per response token
RECEIVED_TOKENS: Final = "received-tokens"  # causal LM: response tokens scored (the weights of both)
DP_EPSILON: Final = "dp-epsilon"  # privacy.dp: the client's epsilon over all its rounds so far
DP_NOISE_MULTIPLIER: Final = "dp-noise-multiplier"
DP_SAMPLE_RATE: Final = "dp-sample-rate"
HETLORA_UPLOAD_RANK: Final = "upload-rank"  # HetLoRA: the rank of a self-pruning client's upload
HETLORA_TAIL_NORM: Final = "tail-norm"  # HetLoRA: the tail norm a pruning client measured
# train metric names a method builds under its prefix (the entries after it are the method's own)
FEDTREELORA_LAM_PREFIX: Final = "fedtreelora-lam-"  # FedTreeLoRA: fedtreelora-lam-<block> = the client's lam
FEDDR_NOISE_PREFIX: Final = "noise-"  # FedDR-LoRA: noise-precision, noise-recall, noise-flagged, ...
METRIC_PREFIXES: Final = (FEDTREELORA_LAM_PREFIX, FEDDR_NOISE_PREFIX)
# FedDR-LoRA's split (fedlora/methods/feddr_lora.py): groups of trained samples whose robust-CE weights
# a client sums (truly noisy / clean by the injected noise, flagged / unflagged by the split) ...
FEDDR_WEIGHT_GROUPS: Final = ("noisy", "clean", "flagged", "unflagged")
FEDDR_WEIGHT_SUM: Final = FEDDR_NOISE_PREFIX + "weight-sum-"  # + group: the weights' sum (each in [0, 1])
FEDDR_WEIGHT_N: Final = FEDDR_NOISE_PREFIX + "weight-n-"  # + group: the samples summed
# ... and the split's counts against the injected noise, and its quality
FEDDR_FLAGGED: Final = FEDDR_NOISE_PREFIX + "flagged"
FEDDR_TRUE_POSITIVES: Final = FEDDR_NOISE_PREFIX + "true-positives"
FEDDR_NOISY: Final = FEDDR_NOISE_PREFIX + "noisy"
FEDDR_SAMPLES: Final = FEDDR_NOISE_PREFIX + "samples"
FEDDR_PRECISION: Final = FEDDR_NOISE_PREFIX + "precision"
FEDDR_RECALL: Final = FEDDR_NOISE_PREFIX + "recall"
FEDDR_FLAGGED_FRACTION: Final = FEDDR_NOISE_PREFIX + "flagged-fraction"

_RECEIVED_LM = (RECEIVED_TOKEN_ACCURACY, RECEIVED_LOSS, RECEIVED_TOKENS)  # a causal LM's received metrics go together
TRAIN_RULES: Final[Mapping[str, MetricRule]] = MappingProxyType({
    NUM_EXAMPLES: POSITIVE_COUNT,
    PARTITION_ID: COUNT,
    **dict.fromkeys(STARTUP_METRICS, STARTUP_SECONDS),
    TRAIN_LOSS: MetricRule(low=0.0, high=MAX_LOSS, nan=True),  # NaN: no optimiser step was taken
    TRAIN_STEPS: COUNT,
    TRAIN_SECONDS: SECONDS,
    TRAIN_EXAMPLES: COUNT,
    RECEIVED_ACCURACY: MetricRule(low=0.0, high=1.0, needs=(RECEIVED_EXAMPLES,)),
    RECEIVED_EXAMPLES: COUNT,
    RECEIVED_TOKEN_ACCURACY: MetricRule(low=0.0, high=1.0, needs=_RECEIVED_LM),
    RECEIVED_LOSS: MetricRule(low=0.0, high=MAX_LOSS, needs=_RECEIVED_LM),
    RECEIVED_TOKENS: MetricRule(low=1.0, high=MAX_COUNT, integer=True, needs=_RECEIVED_LM),  # their weights: >= 1
    DP_EPSILON: MetricRule(low=0.0, infinite=True),  # epsilon is infinite without noise
    DP_NOISE_MULTIPLIER: MetricRule(low=0.0, high=1e6),
    DP_SAMPLE_RATE: FRACTION,
    HETLORA_UPLOAD_RANK: MetricRule(low=1.0, high=MAX_RANK, integer=True),
    HETLORA_TAIL_NORM: MetricRule(low=0.0, high=1e9),  # a norm of the tail factors
    FEDHERA_R_TOT: COUNT,  # the sum over modules of r_tot
    FEDHERA_R_MAIN: MetricRule(low=0.0, high=MAX_COUNT, integer=True, at_most=(FEDHERA_R_TOT,)),
    **{FEDDR_WEIGHT_N + group: COUNT for group in FEDDR_WEIGHT_GROUPS},
    **{FEDDR_WEIGHT_SUM + group: MetricRule(low=0.0, high=MAX_COUNT, at_most=(FEDDR_WEIGHT_N + group,))
       for group in FEDDR_WEIGHT_GROUPS},
    FEDDR_SAMPLES: COUNT,
    FEDDR_FLAGGED: MetricRule(low=0.0, high=MAX_COUNT, integer=True, at_most=(FEDDR_SAMPLES,)),
    FEDDR_NOISY: MetricRule(low=0.0, high=MAX_COUNT, integer=True, at_most=(FEDDR_SAMPLES,)),
    FEDDR_TRUE_POSITIVES: MetricRule(low=0.0, high=MAX_COUNT, integer=True, at_most=(FEDDR_FLAGGED, FEDDR_NOISY)),
    FEDDR_PRECISION: FRACTION, FEDDR_RECALL: FRACTION, FEDDR_FLAGGED_FRACTION: FRACTION,
})
TRAIN_METRICS: Final = frozenset(TRAIN_RULES)
TRAIN_PATTERNS: Final = (
    # FedTreeLoRA: lam = sigmoid(theta) of block <block> (a block index, at most 4 digits)
    MetricPattern(FEDTREELORA_LAM_PREFIX, re.compile(re.escape(FEDTREELORA_LAM_PREFIX) + r"(0|[1-9][0-9]{0,3})"),
                  FRACTION),
)
TRAIN_REQUIRED: Final = (NUM_EXAMPLES, PARTITION_ID)

# evaluate reply: a classifier
ACCURACY: Final = "accuracy"  # local test split
LOSS: Final = "loss"  # local test split (a causal LM: NLL per response token)
VAL_ACCURACY: Final = "val-accuracy"  # local validation split
VAL_EXAMPLES: Final = "val-examples"
GLOBAL_ACCURACY: Final = "global-accuracy"  # the global test set (asked by EVAL_GLOBAL)
# evaluate reply: a causal LM
ROUGE_L: Final = "rouge-l"  # greedy generations on the local test split
ROUGE_EXAMPLES: Final = "rouge-examples"  # examples generated for it
PERPLEXITY: Final = "perplexity"
TOKENS: Final = "tokens"  # response tokens the loss is over
VAL_LOSS: Final = "val-loss"
VAL_TOKENS: Final = "val-tokens"
GLOBAL_ROUGE_L: Final = "global-rouge-l"
GLOBAL_LOSS: Final = "global-loss"
GLOBAL_TOKENS: Final = "global-tokens"
# evaluate reply: a method's own
FEDDPA_MEAN_WEIGHT: Final = "dpa-mean-weight"  # FedDPA, instance weighting: the mean w(x) over the inputs
_GLOBAL_LM = (GLOBAL_ROUGE_L, GLOBAL_LOSS, GLOBAL_TOKENS)  # a causal LM's global-test metrics go together
EVALUATE_RULES: Final[Mapping[str, MetricRule]] = MappingProxyType({
    NUM_EXAMPLES: COUNT,  # 0: an empty local test split (it counts in no accuracy)
    PARTITION_ID: COUNT,
    **dict.fromkeys(STARTUP_METRICS, STARTUP_SECONDS),
    ACCURACY: FRACTION,
    LOSS: LOSS_VALUE,
    VAL_ACCURACY: MetricRule(low=0.0, high=1.0, needs=(VAL_EXAMPLES,)),
    VAL_EXAMPLES: COUNT,
    GLOBAL_ACCURACY: FRACTION,
    ROUGE_L: FRACTION,
    ROUGE_EXAMPLES: COUNT,
    PERPLEXITY: MetricRule(low=0.0),  # exp(loss): any finite number (the server computes its own)
    TOKENS: COUNT,
    VAL_LOSS: MetricRule(low=0.0, high=MAX_LOSS, needs=(VAL_TOKENS,)),
    VAL_TOKENS: COUNT,
    GLOBAL_ROUGE_L: MetricRule(low=0.0, high=1.0, needs=_GLOBAL_LM),
    GLOBAL_LOSS: MetricRule(low=0.0, high=MAX_LOSS, needs=_GLOBAL_LM),
    GLOBAL_TOKENS: MetricRule(low=0.0, high=MAX_COUNT, integer=True, needs=_GLOBAL_LM),
    FEDDPA_MEAN_WEIGHT: FRACTION,  # w(x) is in [0, strategy.weight_max], weight_max <= 1
})
EVALUATE_METRICS: Final = frozenset(EVALUATE_RULES)
EVALUATE_REQUIRED: Final[Mapping[str, tuple[str, ...]]] = MappingProxyType({  # by model.kind: what the server reads
    "classification": (PARTITION_ID, NUM_EXAMPLES, ACCURACY),
    "causal_lm": (PARTITION_ID, NUM_EXAMPLES, ROUGE_L, LOSS),
})

# ------------------------------------------------------------------ round metrics (strategy -> Flower's loop)
CLIENTS: Final = "clients"  # aggregate_train: the valid uploads aggregated
PERSONALIZED_ACCURACY: Final = "personalized-accuracy"  # aggregate_evaluate, a classifier
PERSONALIZED_ROUGE_L: Final = "personalized-rouge-l"  # aggregate_evaluate, a causal LM
ROUND_METRICS: Final = frozenset({TRAIN_LOSS, CLIENTS, PERSONALIZED_ACCURACY, PERSONALIZED_ROUGE_L,
                                  GLOBAL_ACCURACY})

# every key above that names a config entry or a metric (the records' own names apart)
WIRE_KEYS: Final = (MESSAGE_KEYS | METHOD_CONFIG_KEYS | NODE_CONFIG_KEYS | WORKER_ENTRIES | TRAIN_METRICS
                    | EVALUATE_METRICS | ROUND_METRICS | SECAGG_RECORD_KEYS | {PROFILE_JSON})
WIRE_PREFIXES: Final = (*METRIC_PREFIXES, NODE_BUDGET_PREFIX)


def declared(key: str) -> bool:
    """Whether ``key`` is a config entry or metric name of the contract (or under a declared prefix)."""
    return key in WIRE_KEYS or any(key.startswith(prefix) and key != prefix for prefix in WIRE_PREFIXES)


def wire_size(message: Message) -> int:
    """Bytes of ``message`` as Flower serialises it (its protobuf: content, config, metrics and
    metadata; what gRPC carries apart from its own framing)."""
    from flwr.common.serde import message_to_proto

    return int(message_to_proto(message).ByteSize())


def number(value: object) -> float:
    """A config or metric value that must be a number (Flower's records hold several value types)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"expected a number, got {value!r}")
    return float(value)
