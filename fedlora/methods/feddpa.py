"""FedDPA: dual-personalising adapters, a federated global LoRA g plus a private local LoRA l.

Yang, Long, Shen, Jiang, Blumenstein, "Dual-Personalizing Adapter for Federated Foundation
Models", NeurIPS 2024 (arXiv:2403.19211). The server averages g (FedAvg, A and B separately);
l never leaves the client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import Field

from fedlora.compatibility import Capabilities
from fedlora.errors import ConfigError
from fedlora.methods.base import Method, MethodOptions

if TYPE_CHECKING:
    from fedlora.schema import ExperimentConfig


class FedDPAOptions(MethodOptions):
    global_rank: int = Field(
        0,
        ge=0,
        description="Rank of the global LoRA g on every client (FedAvg needs one shape); "
        "0 = model.lora_rank. [RECON for mixed ranks, the paper has one rank] The local LoRA l "
        "uses each client's own declared rank, so heterogeneous ranks only change the private branch.",
    )
    instance_weighting: bool = Field(
        False,
        description="FedDPA's test-time instance-wise weighting of the branches (official code, "
        "get_weight): W0 + 2(1-w(x)) dW_g + 2 w(x) dW_l, w(x) = weight_max * mean_j cos(e(x), e(x_j)) "
        "over reference_examples local training inputs x_j, e = the mean-pooled last hidden state of "
        "the client's model; w = 1/2 is exactly the trained model. Off = every evaluation is the "
        "plain sum [RECON: training uses the plain sum].",
    )
    weight_max: float = Field(0.5, gt=0.0, le=1.0, description="Upper bound of w(x) (the official code's 0.5 / 1.0 'half' switch).")
    reference_examples: int = Field(
        5, ge=1, description="Local training inputs x_j (a seeded sample) the instance weight compares against."
    )

    def rank_of_g(self, lora_rank: int) -> int:
        """Rank of the global LoRA g: ``global_rank``, or ``model.lora_rank`` when 0."""
        return self.global_rank or lora_rank


def check(experiment: ExperimentConfig, options: FedDPAOptions) -> None:
    """The instance-wise weighting wraps the classifier's forward; a causal LM generates through
    ``generate``, which the wrapper does not provide."""
    if options.instance_weighting and experiment.model.kind == "causal_lm":
        raise ConfigError("strategy.instance_weighting = true is for classification (it wraps the classifier's "
                          "forward, not generate); set strategy.instance_weighting = false with model.kind = 'causal_lm'")


METHOD = Method(
    name="feddpa",
    options=FedDPAOptions,
    check=check,
    capabilities=Capabilities(
        personalized=True,
        uploads="global LoRA g (A, B), head",
        downloads="global LoRA g (A, B), head",
        mixed_ranks=True,
        dp_compatible=False,  # two active peft adapters in one model: not verified with Opacus
        paper="Yang et al., NeurIPS 2024 (arXiv:2403.19211)",
        robust_aggregation=True,
        flower_dp=True,  # the weighted mean of g (l never leaves the client)
        secure_aggregation=True,  # the weighted mean of g, one rank r_g for every client
        server_optimizer=True,  # the mean of g and the head
        proximal=True,
    ),
    strategy="fedlora.strategies.feddpa:FedDPA",
    trainer="fedlora.clients.trainers.feddpa:FedDPATrainer",
)
