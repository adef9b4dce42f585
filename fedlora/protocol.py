"""The message contract between fedlora's ServerApp (strategies) and its ClientApp (clients).

A training or evaluation message carries ``arrays`` (the download, an ArrayRecord) and ``config``:
the keys below plus a method's own (declared in its home, ``fedlora/methods/<name>.py``). A reply
carries ``arrays`` (the upload) and ``metrics``. A query message carries only the experiment; its
reply is the client's profile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from flwr.app import Message

Phase = Literal["train", "evaluate"]  # which message a hook is building

# message config (server -> client)
SERVER_ROUND = "server-round"
EXPERIMENT = "experiment"  # the resolved experiment config, JSON
RANK = "lora-rank"  # the LoRA rank this client trains / evaluates at this round (the one rank decision)
CHECKPOINT_DIR = "checkpoint-dir"  # where the client keeps its state (simulation: under the run folder)
RESUME_ROUND = "resume-round"  # a resumed run: restore the client state of this round
STATE_ON_DISK = "state-on-disk"  # simulation: the client's state lives in its checkpoint file between messages
EVAL_RECEIVED = "eval-received"  # train: evaluate the received model before local training
EVAL_GLOBAL = "eval-global"  # evaluate: also evaluate on the global test set (no global model)
SAVE_ADAPTER_DIR = "save-adapter-dir"  # evaluate, last round: save the client's adapter there
# fedlora's own message config keys: a config given to ``configure_*`` (Flower's ``train_config`` /
# ``evaluate_config``) travels next to them, without these keys
MESSAGE_KEYS = frozenset({SERVER_ROUND, EXPERIMENT, RANK, CHECKPOINT_DIR, RESUME_ROUND, STATE_ON_DISK, EVAL_RECEIVED,
                          EVAL_GLOBAL, SAVE_ADAPTER_DIR})

# reply records (client -> server)
WORKER = "worker"  # train reply ConfigRecord: where the message ran (host, Ray node)

# reply metrics (client -> server)
NUM_EXAMPLES = "num-examples"
PARTITION_ID = "partition-id"
TRAIN_LOSS = "train-loss"
TRAIN_SECONDS = "train-seconds"
TRAIN_EXAMPLES = "train-examples"
RECEIVED_ACCURACY = "received-accuracy"
RECEIVED_EXAMPLES = "received-examples"
RECEIVED_TOKEN_ACCURACY = "received-token-accuracy"  # causal LM: teacher-forced next-token accuracy
RECEIVED_LOSS = "received-loss"  # causal LM: NLL per response token
RECEIVED_TOKENS = "received-tokens"  # causal LM: response tokens scored (the weights of both)
# What a reply's start-up cost was (clients/app.py; results.json per_client / per_client_train):
# message arrival -> ClientApp module imported, the setup phases, -> training / evaluation starts,
# -> the first training step (the last two only in a process's first message).
STARTUP_METRICS = ("import-seconds", "setup-seconds", "setup-libraries-seconds", "setup-data-seconds",
                   "setup-model-seconds", "setup-adapter-seconds", "start-seconds", "first-step-seconds")


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
