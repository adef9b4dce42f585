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
  ``metrics`` (:data:`EVALUATE_METRICS`).
- A SuperNode's node config (``flower-supernode --node-config``, or the simulation engine's) holds
  :data:`NODE_CONFIG_KEYS` and ``budget-<name>`` entries (:data:`NODE_BUDGET_PREFIX`).
- ``aggregate_train`` / ``aggregate_evaluate`` and the ServerApp's ``evaluate_fn`` return
  :data:`ROUND_METRICS` to Flower's loop.

Payload keys (the names of the arrays in ``arrays``: ``<module>::A``, ``head::<name>``) are the
LoRA codec's, ``fedlora.lora`` (:mod:`fedlora.lora.peft_keys` maps them to peft's). results.json
keeps its own field names (``fedlora.results``); its per-client entries are reply metrics.

This module imports nothing of fedlora's: every layer may use it.
"""

from __future__ import annotations

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
WORKER_ENTRIES: Final = frozenset({WORKER_HOST, WORKER_RAY_NODE})

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
# fedlora's own message config keys: a config given to ``configure_*`` (Flower's ``train_config`` /
# ``evaluate_config``) travels next to them, without these keys
MESSAGE_KEYS: Final = frozenset({SERVER_ROUND, EXPERIMENT, RANK, CHECKPOINT_DIR, RESUME_ROUND, STATE_ON_DISK,
                                 EVAL_RECEIVED, EVAL_GLOBAL, SAVE_ADAPTER_DIR})

# a method's own message config (its strategy's ``client_config``, read by its trainer)
# centralized, train: the clients a federated round samples (the step budget)
CENTRALIZED_CLIENTS: Final = "centralized-clients"
FEDHERA_R_TOT: Final = "fedhera-r-tot"  # FedHera: JSON {module: r_tot} (a train metric too: their sum)
FEDHERA_R_MAIN: Final = "fedhera-r-main"  # FedHera: JSON {module: r_main} (a train metric too: their sum)
FEDHERA_LAMBDA: Final = "fedhera-lambda"  # FedHera: the tail warm-up lambda_k (1.0 in evaluation messages)
METHOD_CONFIG_KEYS: Final = frozenset({CENTRALIZED_CLIENTS, FEDHERA_R_TOT, FEDHERA_R_MAIN, FEDHERA_LAMBDA})

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
# both replies
NUM_EXAMPLES: Final = "num-examples"  # train: training examples; evaluate: local test examples
PARTITION_ID: Final = "partition-id"  # the partition the reply speaks for (checked against its sender)
# a reply's start-up cost (fedlora/clients/app.py; results.json per_client / per_client_train): message
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
TRAIN_METRICS: Final = frozenset({
    NUM_EXAMPLES, PARTITION_ID, TRAIN_LOSS, TRAIN_STEPS, TRAIN_SECONDS, TRAIN_EXAMPLES, *STARTUP_METRICS,
    RECEIVED_ACCURACY, RECEIVED_EXAMPLES, RECEIVED_TOKEN_ACCURACY, RECEIVED_LOSS, RECEIVED_TOKENS,
    DP_EPSILON, DP_NOISE_MULTIPLIER, DP_SAMPLE_RATE, HETLORA_UPLOAD_RANK, HETLORA_TAIL_NORM, FEDHERA_R_TOT,
    FEDHERA_R_MAIN,
})
# train metric names a method builds under its prefix (the entries after it are the method's own)
FEDTREELORA_LAM_PREFIX: Final = "fedtreelora-lam-"  # FedTreeLoRA: fedtreelora-lam-<block> = the client's lam
FEDDR_NOISE_PREFIX: Final = "noise-"  # FedDR-LoRA: noise-precision, noise-recall, noise-flagged, ...
METRIC_PREFIXES: Final = (FEDTREELORA_LAM_PREFIX, FEDDR_NOISE_PREFIX)

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
EVALUATE_METRICS: Final = frozenset({
    NUM_EXAMPLES, PARTITION_ID, *STARTUP_METRICS, ACCURACY, LOSS, VAL_ACCURACY, VAL_EXAMPLES, GLOBAL_ACCURACY,
    ROUGE_L, ROUGE_EXAMPLES, PERPLEXITY, TOKENS, VAL_LOSS, VAL_TOKENS, GLOBAL_ROUGE_L, GLOBAL_LOSS,
    GLOBAL_TOKENS, FEDDPA_MEAN_WEIGHT,
})

# ------------------------------------------------------------------ round metrics (strategy -> Flower's loop)
CLIENTS: Final = "clients"  # aggregate_train: the valid uploads aggregated
PERSONALIZED_ACCURACY: Final = "personalized-accuracy"  # aggregate_evaluate, a classifier
PERSONALIZED_ROUGE_L: Final = "personalized-rouge-l"  # aggregate_evaluate, a causal LM
ROUND_METRICS: Final = frozenset({TRAIN_LOSS, CLIENTS, PERSONALIZED_ACCURACY, PERSONALIZED_ROUGE_L,
                                  GLOBAL_ACCURACY})

# every key above that names a config entry or a metric (the records' own names apart)
WIRE_KEYS: Final = (MESSAGE_KEYS | METHOD_CONFIG_KEYS | NODE_CONFIG_KEYS | WORKER_ENTRIES | TRAIN_METRICS
                    | EVALUATE_METRICS | ROUND_METRICS | {PROFILE_JSON})
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
