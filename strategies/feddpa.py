"""FedDPA: a federated global LoRA g plus a private local LoRA l (``fedlora/methods/feddpa.py``)."""

from __future__ import annotations

from fedlora.errors import ConfigError
from fedlora.lora import Payload, weighted_average, without_head
from fedlora.methods import feddpa
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download


class FedDPA(LoRAStrategy[feddpa.FedDPAOptions]):
    """FedDPA: every client holds a global LoRA g (federated) and a local LoRA l (private) on the
    same modules; the model is W0 + dW_g + dW_l.

    Paper: Yang, Long, Shen, Jiang, Blumenstein, "Dual-Personalizing Adapter for Federated
    Foundation Models", NeurIPS 2024 (arXiv:2403.19211).

    Parameters
    ----------
    global_rank : int >= 0, default 0
        Rank of the global LoRA g on every client (FedAvg needs one shape); 0 = model.lora_rank. [RECON
        for mixed ranks, the paper has one rank] The local LoRA l uses each client's own declared rank, so
        heterogeneous ranks only change the private branch.
    instance_weighting : bool, default False
        FedDPA's test-time instance-wise weighting of the branches (official code, get_weight): W0 +
        2(1-w(x)) dW_g + 2 w(x) dW_l, w(x) = weight_max * mean_j cos(e(x), e(x_j)) over reference_examples
        local training inputs x_j, e = the mean-pooled last hidden state of the client's model; w = 1/2 is
        exactly the trained model. Off = every evaluation is the plain sum [RECON: training uses the plain
        sum].
    weight_max : float in (0, 1], default 0.5
        Upper bound of w(x) (the official code's 0.5 / 1.0 'half' switch).
    reference_examples : int >= 1, default 5
        Local training inputs x_j (a seeded sample) the instance weight compares against.

    Clients train g and l jointly (both peft adapters active and trainable, ``set_adapter(
    ["default", "local"])``), with the plain sum W0 + dW_g + dW_l.

    Upload: g's A (r_g x d_in) and B (d_out x r_g) of every module, and the head when
    ``model.head = global``. l never leaves the client (its state only).

    Aggregation: FedAvg of g, A and B separately: A_g = sum_k p_k A_g,k, B_g = sum_k p_k B_g,k
    (p_k = n_k / sum n); head by FedAvg.

    Download: g and the head; the client keeps its l. Personalised accuracy: W0 + dW_g + dW_l on
    the client's local test split. Global accuracy: the global model W0 + dW_g (+ head), without
    any local branch, on the global test set.

    Arrays (Flower's ``start`` loop): ``aggregate_train`` returns g (A, B at r_g, and the head);
    ``configure_*`` continue from the arrays given (the same keys and shapes) as g. Each
    client's l never leaves it, so no arrays hold it.
    """

    STATE = (*LoRAStrategy.STATE, "global_adapter", "rank_g")  # checkpointed

    def setup(self) -> None:
        self.rank_g = self.options.rank_of_g(self.experiment.model.lora_rank)
        max_rank = min(min(shape) for shape in self.module_shapes.values())
        if self.rank_g > max_rank:
            raise ConfigError(f"strategy.global_rank must be in [1, {max_rank}] for this model, got {self.rank_g}")
        initial = self.initial_adapter(self.rank_g)
        self.global_adapter: Payload = initial if self.sends_head else without_head(initial)

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        return self.lora_download(partition, for_round, phase, self.global_adapter, rank=self.rank_g)

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        self.global_adapter = weighted_average([u.payload for u in uploads], self.weights(uploads), self.combine)

    def load_arrays(self, payload: Payload) -> None:
        self.global_adapter = dict(payload)

    def global_payload(self) -> Payload:
        return self.global_adapter
