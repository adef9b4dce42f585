"""Local training only: nothing crosses the wire (``fedlora/methods/local.py``)."""

from __future__ import annotations

from fedlora.methods.base import NoOptions
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download


class LocalOnly(LoRAStrategy[NoOptions]):
    """Local-only training: no aggregation, no communication of parameters.

    Paper: none (the standard no-federation baseline of personalised FL; e.g. the "Local"
    rows of FedSA-LoRA, ICLR 2025, and FedDPA, NeurIPS 2024).

    Parameters
    ----------
    (none beyond the experiment config)

    Each client trains at its own declared rank; mixed ranks need nothing special.
    The head is always local, whatever ``model.head`` says.

    Upload: nothing (an empty record: 0 bytes). The reply still carries the metrics (examples,
    training loss) so the round is accounted for.

    Aggregation: none; the server keeps no model.

    Download: nothing (0 bytes). Every client starts from the same seeded initial adapter at
    its rank and continues from its own state each round. Personalised accuracy is each
    client's model on its local test split; the global-test accuracy reported is the
    example-weighted mean of the clients' own models on the global test set.

    Arrays (Flower's ``start`` loop): there is no server state; ``aggregate_train`` returns an
    empty ArrayRecord and ``configure_*`` read nothing (non-empty arrays are refused).
    """

    STATE = LoRAStrategy.STATE  # checkpointed: nothing of its own

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        return Download(partition, for_round, phase, {})  # nothing goes down, nothing comes up

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        """Nothing to aggregate: the uploads are empty."""

    def global_payload(self) -> None:
        """None: there is no global model; clients evaluate their own on the global test set."""
