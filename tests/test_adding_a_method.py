"""Adding a method is writing its files: one declaration (``fedlora.methods.Method``) pairs its
options, strategy and client trainer, announced by an entry point or ``fedlora.methods.register``,
and the method runs end to end with no edit of fedlora (docs/development.md, "Adding a method")."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from fedlora import methods

ROOT = Path(__file__).resolve().parents[1]

# The whole method: its declaration, its Flower strategy, and (by default) fedlora's A-and-B trainer.
UNIFORM = '''
"""Uniform FedAvg-LoRA: FedIT with every sampled client weighted equally, whatever its data size."""

from typing import Any

import numpy as np

from fedlora.lora import Payload, padded_average, truncate_payload
from fedlora.methods import Capabilities, Method, NoOptions
from fedlora.protocol import Phase
from fedlora.strategies.base import ClientUpload, LoRAStrategy
from fedlora.strategies.download import Download

METHOD = Method(
    name="uniform_fedavg",
    options=NoOptions,
    capabilities=Capabilities(personalized=False, uploads="A, B, head", downloads="A, B, head", mixed_ranks=True,
                              paper="a toy: FedIT with equal client weights"),
    strategy="uniform_fedavg:UniformFedAvg",
)


class UniformFedAvg(LoRAStrategy[NoOptions]):
    """FedIT's protocol with p_k = 1 / K over the K uploads of a round."""

    method = METHOD  # the older style, still honoured: the declaration naming this class is enough
    STATE = (*LoRAStrategy.STATE, "global_adapter", "max_rank", "last_weights")  # what a checkpoint saves

    def setup(self) -> None:
        self.max_rank = max(p.rank for p in self.roster.profiles.values())
        self.global_adapter: Payload = self.initial_adapter(self.max_rank)
        self.last_weights: list[float] = []

    def download(self, partition: int, for_round: int, phase: Phase) -> Download:
        payload = truncate_payload(self.global_adapter, self.rank_of(partition))
        return self.lora_download(partition, for_round, phase, payload)  # A, B and head come back

    def aggregate(self, server_round: int, uploads: list[ClientUpload]) -> None:
        weights = np.full(len(uploads), 1.0 / len(uploads))
        self.last_weights = weights.tolist()
        self.global_adapter = padded_average([u.payload for u in uploads], weights, self.max_rank, self.combine)

    def load_arrays(self, payload: Payload) -> None:
        self.global_adapter = dict(payload)

    def global_payload(self) -> Payload:
        return self.global_adapter

    def round_extra(self, server_round: int) -> dict[str, Any]:
        return {"uniform_weights": self.last_weights}
'''


@pytest.fixture
def installed_toy(tmp_path: Path) -> Path:
    """The toy's module and a distribution's metadata with its entry point, in a folder put on the
    path (what ``pip install`` of a package declaring the entry point leaves in site-packages)."""
    folder = tmp_path / "site"
    (folder / "uniform_fedavg-0.1.dist-info").mkdir(parents=True)
    (folder / "uniform_fedavg.py").write_text(textwrap.dedent(UNIFORM), encoding="utf-8")
    (folder / "uniform_fedavg-0.1.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: uniform-fedavg\nVersion: 0.1\n", encoding="utf-8")
    (folder / "uniform_fedavg-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{methods.ENTRY_POINT_GROUP}]\nuniform_fedavg = uniform_fedavg:METHOD\n", encoding="utf-8")
    sys.path.insert(0, str(folder))
    methods.forget()
    yield folder
    sys.path.remove(str(folder))
    sys.modules.pop("uniform_fedavg", None)
    methods.forget()


@pytest.mark.slow
def test_a_method_declared_outside_fedlora_runs_end_to_end(installed_toy: Path, tmp_path: Path) -> None:
    import fedlora
    from fedlora.clients.trainers import trainer_class
    from fedlora.clients.trainers.base import LocalTrainer
    from fedlora.strategies.registry import strategy_class, strategy_names

    # Prepare: the smoke experiment (3 clients of ranks 2, 4, 8; unequal data) with the toy method
    out = tmp_path / "run"
    # Execute
    results = fedlora.run(ROOT / "configs/smoke.toml", ["strategy.name=uniform_fedavg", "train.rounds=2"], out_dir=out,
                          engine="inprocess")
    # Assert: found by name everywhere a built-in is (registry, trainer, config), and really aggregated by it
    assert "uniform_fedavg" in strategy_names() and strategy_class("uniform_fedavg").__name__ == "UniformFedAvg"
    assert trainer_class("uniform_fedavg") is LocalTrainer
    written = json.loads((out / "results.json").read_text())
    assert written["config"]["strategy"]["name"] == results["config"]["strategy"]["name"] == "uniform_fedavg"
    rounds = written["rounds"]
    assert [r["round"] for r in rounds] == [1, 2] and all(r["clients"] == 3 for r in rounds)
    for r in rounds:
        weights = r["extra"]["uniform_weights"]
        assert weights == pytest.approx([1 / 3] * 3)
    assert all(np.isfinite(r["global_accuracy"]) for r in rounds)


def test_a_declaration_that_is_not_a_method_is_refused_by_name(tmp_path: Path) -> None:
    # Prepare: an entry point naming something that is not a Method
    folder = tmp_path / "site"
    (folder / "broken-0.1.dist-info").mkdir(parents=True)
    (folder / "broken_method.py").write_text("METHOD = 'fedit'\n", encoding="utf-8")
    (folder / "broken-0.1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: broken\nVersion: 0.1\n")
    (folder / "broken-0.1.dist-info" / "entry_points.txt").write_text(
        f"[{methods.ENTRY_POINT_GROUP}]\nbroken = broken_method:METHOD\n")
    sys.path.insert(0, str(folder))
    methods.forget()
    try:
        # Execute / Assert
        with pytest.raises(TypeError, match="entry point broken = broken_method:METHOD: not a fedlora.methods.Method"):
            methods.method_names()
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("broken_method", None)
        methods.forget()
    assert "fedit" in methods.method_names()


# ---------------------------------------------------------------- a toy method with its own client trainer
def b_only_classes() -> tuple[type, type]:
    """A toy method's parts: a client trainer that trains B (and the head) only, A frozen as
    downloaded, and a FedIT strategy that measures, per round, how far the uploads' A and B moved
    from what it sent (the largest absolute entry of upload - download)."""
    from fedlora.clients.trainers.base import LocalTrainer
    from fedlora.lora import A_SUFFIX, B_SUFFIX, truncate_payload
    from fedlora.strategies.fedit import FedIT

    class BOnlyTrainer(LocalTrainer):
        def prepare(self, download):
            model = super().prepare(download)
            for name, parameter in model.named_parameters():
                if ".lora_A." in name:
                    parameter.requires_grad_(False)
            return model

    class BOnlyFedAvg(FedIT):
        STATE = (*FedIT.STATE, "moved")

        def aggregate(self, server_round, uploads):
            moved = {"A": 0.0, "B": 0.0}
            for upload in uploads:
                sent = truncate_payload(self.global_adapter, self.rank_of(upload.partition_id))
                for key, value in upload.payload.items():
                    factor = "A" if key.endswith(A_SUFFIX) else "B" if key.endswith(B_SUFFIX) else None
                    if factor:
                        moved[factor] = max(moved[factor], float(np.max(np.abs(value - sent[key]))))
            self.moved = moved
            super().aggregate(server_round, uploads)

        def round_extra(self, server_round):
            return {"moved_A": self.moved["A"], "moved_B": self.moved["B"]}

    return BOnlyTrainer, BOnlyFedAvg


@pytest.fixture
def toy_registry():
    """Methods registered by the test are forgotten after it (the registry reads its sources anew)."""
    yield methods
    methods.forget()


def test_a_registered_method_runs_its_own_trainer_on_the_clients_and_its_strategy_on_the_server(
        toy_registry, tmp_path: Path) -> None:
    import fedlora
    from fedlora.clients.trainers import trainer_class
    from fedlora.strategies.registry import strategy_class, strategy_names

    # Prepare: one declaration pairs the toy's options, strategy and trainer (the classes themselves)
    trainer, strategy = b_only_classes()
    toy_registry.register(methods.Method(
        name="b_only", options=methods.NoOptions, strategy=strategy, trainer=trainer,
        capabilities=methods.Capabilities(personalized=False, uploads="A, B, head", downloads="A, B, head",
                                          paper="a toy: FedIT whose clients train B only"),
    ))
    # Execute: two clients of rank 4, one round of 3 steps, in process (tiny random BERT)
    results = fedlora.run(ROOT / "configs/smoke.toml", [
        "strategy.name=b_only", "train.rounds=1", "train.max_steps=3", "data.num_clients=2", "clients.ranks=[4, 4]",
        "data.max_examples=200", "data.global_test_size=20", "federation.fraction_evaluate=0"],
        out_dir=tmp_path / "run", engine="inprocess")
    # Assert: the strategy's own round facts are written (the server ran it), and the clients' A came
    # back exactly as sent while B trained (the clients ran its trainer; fedlora's default moves A too)
    (round_1,) = results["rounds"]
    assert round_1["clients"] == 2
    assert round_1["extra"]["moved_A"] == 0.0
    assert round_1["extra"]["moved_B"] > 1e-4
    # Assert: found by name like a built-in
    assert "b_only" in strategy_names() and strategy_class("b_only") is strategy and trainer_class("b_only") is trainer
    assert strategy.name == "b_only" and strategy.method is methods.method("b_only")


def test_a_strategy_finds_its_declaration_by_lookup_and_a_name_is_declared_once(toy_registry) -> None:
    from fedlora.strategies.base import LoRAStrategy
    from fedlora.strategies.fedit import FedIT

    # Prepare
    trainer, strategy = b_only_classes()
    caps = methods.Capabilities(personalized=False, uploads="", downloads="")
    # Execute / Assert: a built-in strategy names no declaration itself, the registry's lookup finds it;
    # a subclass no declaration names runs its base's method, until a declaration names it
    assert "method" not in vars(FedIT) and FedIT.method is methods.method("fedit") and FedIT.name == "fedit"
    assert strategy.name == "fedit"
    declared = toy_registry.register(methods.Method(name="toy", options=methods.NoOptions, capabilities=caps,
                                                    strategy=strategy, trainer=trainer))
    assert strategy.method is declared and strategy.capabilities is caps and FedIT.name == "fedit"
    with pytest.raises(RuntimeError, match="method name 'toy' declared twice"):
        toy_registry.register(methods.Method(name="toy", options=methods.NoOptions, capabilities=caps, strategy=FedIT))
    with pytest.raises(TypeError, match="not a fedlora.methods.Method"):
        toy_registry.register("toy")
    with pytest.raises(AttributeError, match="LoRAStrategy is the strategy of no declared method"):
        LoRAStrategy.name  # noqa: B018
