"""The client side of secure aggregation: Flower's ``secaggplus_mod``, unchanged, around fedlora's
training handler (docs/secure-aggregation.md).

Two mods of ``@app.train(mods=[secure_when_asked, masked_update, clipping_when_asked])``:

- :func:`secure_when_asked` (outermost) runs Flower's ``secaggplus_mod`` on a training message that
  carries Flower's SecAgg+ record (``secaggplus_configs``): the setup, share-keys and unmask stages
  are answered by the mod alone (keys, encrypted shares, shares), the masking stage calls the rest
  of the chain and masks its result. Any other message passes through. After the unmask stage it
  drops the mod's state (private keys, seeds, shares) from the node's state.
- :func:`masked_update` (inside the mod) runs fedlora's handler and turns its reply into the
  legacy ``FitRes`` records the mod reads: the update (upload minus download, A and B zero-padded
  to the round's largest rank, clipped to ``secagg-clip``, refused beyond ``secagg-range``) as one
  vector, weighed with the weight the server chose (``secagg-weight``). The mod then masks the
  vector and empties every array record of the reply, fedlora's upload included: the server
  receives the metrics and the masked integers, never the upload.

Nothing here is cryptography of fedlora's: keys, shares, encryption, masks and quantisation are
Flower's (``flwr.client.mod.secaggplus_mod`` and ``flwr.common.secure_aggregation``).
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.app import Context, Message, MessageType
from flwr.client.mod import secaggplus_mod
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.common.secure_aggregation.secaggplus_constants import (
    RECORD_KEY_CONFIGS,
    RECORD_KEY_STATE,
    Key,
    Stage,
)
from flwr.compat.common.recorddict_compat import fitres_to_recorddict

from fedlora import protocol

CallNext = Callable[[Message, Context], Message]


def secure_when_asked(msg: Message, context: Context, call_next: CallNext) -> Message:
    """Flower's ``secaggplus_mod`` when the message carries its record, else nothing (the mod
    alone would answer a training message without it with an error); after the unmask stage the
    mod's state leaves the node's state (it holds private keys and shares, and a non-empty state
    would keep a client's kept state from being restored from its checkpoint)."""
    configs = msg.content.config_records.get(RECORD_KEY_CONFIGS)
    if msg.metadata.message_type != MessageType.TRAIN or configs is None:
        return call_next(msg, context)
    stage = configs.get(Key.STAGE)
    reply = secaggplus_mod(msg, context, call_next)
    if stage == Stage.UNMASK:
        context.state.config_records.pop(RECORD_KEY_STATE, None)
    return reply


def masked_update(msg: Message, context: Context, call_next: CallNext) -> Message:
    """fedlora's training handler, its reply in the form Flower's mod masks (module docstring).

    Before the handler: Flower's record leaves the message (Flower's ``fixedclipping_mod`` refuses a
    message with more than one config record) and the mod's state leaves the node's state (kept out
    of the handler and of the client's checkpoint; the mod saves it again after). A reply whose
    update cannot be masked (:func:`fedlora.secagg.update_vector`: arrays that do not match the
    download, NaN, an entry beyond the clipping range) raises: an error reply, a dropout of the
    round that the protocol absorbs."""
    if msg.content.config_records.get(RECORD_KEY_CONFIGS) is None:
        return call_next(msg, context)
    from fedlora.lora import from_array_record
    from fedlora.secagg import update_vector

    del msg.content.config_records[RECORD_KEY_CONFIGS]
    context.state.config_records.pop(RECORD_KEY_STATE, None)
    reply = call_next(msg, context)
    if reply.has_error():
        return reply
    config = msg.content.config_records[protocol.CONFIG_RECORD]
    vector = update_vector(from_array_record(reply.content.array_records[protocol.ARRAYS_RECORD]),
                           from_array_record(msg.content.array_records[protocol.ARRAYS_RECORD]),
                           int(protocol.number(config[protocol.SECAGG_PAD_RANK])),
                           protocol.number(config[protocol.SECAGG_CLIP]),
                           protocol.number(config[protocol.SECAGG_RANGE]))
    weight = protocol.number(config[protocol.SECAGG_WEIGHT])
    fitres = FitRes(Status(Code.OK, "ok"), ndarrays_to_parameters([vector]), weight, {})  # type: ignore[arg-type]
    legacy = fitres_to_recorddict(fitres, keep_input=False)
    for name, arrays in legacy.array_records.items():
        reply.content.array_records[name] = arrays
    for name, metrics in legacy.metric_records.items():
        reply.content.metric_records[name] = metrics
    for name, entries in legacy.config_records.items():
        reply.content.config_records[name] = entries
    return reply
