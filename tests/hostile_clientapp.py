"""Test only: a ClientApp that is fedlora's own, except on a node whose node config says
``hostile = true``: that node answers the query honestly (so it is accepted) and then sends a
malformed or adversarial reply to every training and evaluation message, a different one each
round (the ``TRAIN_ATTACKS`` and ``EVALUATE_ATTACKS`` lists). It never trains.

``tests/test_hostile_clients.py`` runs it in process, ``tests/test_deploy_faults.py`` on one SuperNode of
a real TLS deployment (a copy of the app whose ``clientapp`` is this module); the product never
ships it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fedlora.clients import app as fedlora_client

HOSTILE = "hostile"  # node config key: true on the hostile node


def _download(msg: Message) -> dict[str, np.ndarray]:
    """The arrays the server sent (for the strategies of the tests, the shapes it expects back)."""
    return {key: array.numpy() for key, array in msg.content.array_records["arrays"].items()}


def _partition(context: Context) -> int:
    return int(context.node_config.get("partition-id", 0))


def _round(msg: Message) -> int:
    return int(msg.content.config_records["config"]["server-round"])


def text_arrays(msg: Message, context: Context) -> RecordDict:
    """Every array as text (a dtype the server cannot average), honest metrics."""
    arrays = ArrayRecord({k: Array(np.full(v.shape, "x")) for k, v in _download(msg).items()})
    metrics = MetricRecord({"num-examples": 10, "partition-id": _partition(context), "train-loss": 1.0})
    return RecordDict({"arrays": arrays, "metrics": metrics})


def scaled(msg: Message, context: Context) -> RecordDict:
    """The download scaled by 1e30 with an honest example count: a poisoning attempt (norm)."""
    arrays = ArrayRecord({k: Array((v.astype(np.float64) * 1e30).astype(np.float32)) for k, v in _download(msg).items()})
    metrics = MetricRecord({"num-examples": 10, "partition-id": _partition(context), "train-loss": 0.1})
    return RecordDict({"arrays": arrays, "metrics": metrics})


def inflated(msg: Message, context: Context) -> RecordDict:
    """A plausible update with an enormous example count: a poisoning attempt (weight)."""
    arrays = ArrayRecord({k: Array(v) for k, v in _download(msg).items()})
    metrics = MetricRecord({"num-examples": 10**15, "partition-id": _partition(context), "train-loss": 0.1})
    return RecordDict({"arrays": arrays, "metrics": metrics})


def spoofed(msg: Message, context: Context) -> RecordDict:
    """A plausible update that claims to come from another partition."""
    arrays = ArrayRecord({k: Array(v) for k, v in _download(msg).items()})
    metrics = MetricRecord({"num-examples": 10, "partition-id": (_partition(context) + 1) % 2, "train-loss": 1.0})
    return RecordDict({"arrays": arrays, "metrics": metrics})


TRAIN_ATTACKS: list[Callable[[Message, Context], RecordDict]] = [text_arrays, scaled, inflated, spoofed]


def impossible_accuracy(msg: Message, context: Context) -> RecordDict:
    """An accuracy of 7 (outside [0, 1])."""
    return RecordDict({"metrics": MetricRecord({"accuracy": 7.0, "num-examples": 10.0,
                                                "partition-id": float(_partition(context))})})


def other_partition(msg: Message, context: Context) -> RecordDict:
    """A perfect score with a huge weight, claiming to be partition 0."""
    return RecordDict({"metrics": MetricRecord({"accuracy": 1.0, "num-examples": 1e12, "partition-id": 0.0})})


EVALUATE_ATTACKS: list[Callable[[Message, Context], RecordDict]] = [impossible_accuracy, other_partition]


app = ClientApp()


@app.query()
def query(msg: Message, context: Context) -> Message:
    return fedlora_client.query(msg, context)


def _reply(msg: Message, context: Context, honest: Callable[[Message, Context], Message],
           attacks: Sequence[Callable[[Message, Context], RecordDict]]) -> Message:
    """The honest reply on an honest node; on a hostile one, the round's attack (in turn)."""
    if not context.node_config.get(HOSTILE):
        return honest(msg, context)
    attack = attacks[(_round(msg) - 1) % len(attacks)]
    return Message(content=attack(msg, context), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    return _reply(msg, context, fedlora_client.train, TRAIN_ATTACKS)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    return _reply(msg, context, fedlora_client.evaluate, EVALUATE_ATTACKS)
