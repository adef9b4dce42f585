"""What the server sends one client for one round: the method's one value per client and round.

A strategy's :meth:`~fedlora.strategies.base.LoRAStrategy.download` returns a :class:`Download`;
the base turns it into the Flower message and, for a training message, keeps it until the round's
replies are read: each reply is checked against the shapes its download states
(:meth:`Download.expected`), and each valid upload carries the download it answers
(``ClientUpload.download``), so a method's aggregation reads what a client started from there,
never from state another hook had to write first.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedlora.lora import Payload
from fedlora.protocol import Phase

Shapes = Mapping[str, tuple[int, ...]]  # array key -> shape


@dataclass(frozen=True)
class Download:
    """One client's download of one round, and what its reply must hold.

    Parameters
    ----------
    partition : int
        The client (its partition id).
    for_round : int
        The round the model is for: a training message of round t is for t; an evaluation
        message sent after round t is for t + 1 (the model round t + 1 would start from). The
        message states the round it is sent in (``server-round``) beside it.
    phase : {'train', 'evaluate'}
        The message type.
    payload : Payload
        The arrays sent (LoRA factors and head, whatever the method sends).
    config : Mapping[str, bool | int | float | str]
        The method's own config entries (its wire keys in ``fedlora/protocol.py``), read by its
        trainer.
    upload : Mapping[str, tuple[int, ...]]
        Key -> shape of the arrays a training reply must upload (empty: nothing; evaluation
        replies carry no arrays).
    choice : str
        A reply metric that selects one of ``alternatives`` ('' for none): HetLoRA's self-pruned
        rank, ``upload-rank``.
    alternatives : Mapping[float, Mapping[str, tuple[int, ...]]]
        The other uploads a reply may choose by the value of its ``choice`` metric; any other
        value (or none) means ``upload``.
    context : Any
        The method's own record of what it sent (FedHera's push, FLoRA's stacks), read back
        with the upload; never sent.
    """

    partition: int
    for_round: int
    phase: Phase
    payload: Payload
    config: Mapping[str, bool | int | float | str] = field(default_factory=dict)
    upload: Shapes = field(default_factory=dict)
    choice: str = ""
    alternatives: Mapping[float, Shapes] = field(default_factory=dict)
    context: Any = None

    def expected(self, metrics: Mapping[str, float] | None = None) -> Shapes:
        """The shapes the reply with these metrics must upload (:attr:`upload`, or the
        alternative its :attr:`choice` metric names)."""
        value = (metrics or {}).get(self.choice) if self.choice else None
        return self.alternatives.get(value, self.upload) if value is not None else self.upload
