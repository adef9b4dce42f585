"""The reply pipeline (strategies/pipeline.py): a round's training replies go through parse,
validate, screen, weigh, account and select in the order its docstring states; the record accounts
for every valid upload and a Byzantine selection chooses among them on copies; the strategy's
aggregation step receives the pipeline's result.

Rounds of fedit on the smoke experiment with profile-only clients (tests/test_hostile_clients.py's
``connected``), replies built by hand (tests/test_poisoning.py's honest changes).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Message
from test_hostile_clients import connected, partition, reply
from test_poisoning import honest_change

from fedlora.strategies.download import Download
from fedlora.strategies.pipeline import ReplyPipeline, RoundReplies
from fedlora.strategies.replies import ClientUpload

SEVEN = ("data.num_clients=7", "clients.ranks=[4, 4, 4, 4, 4, 4, 4]", "federation.min_clients=2")


class StepLog(ReplyPipeline):
    """The pipeline, each step's name logged as it is called."""

    steps: ClassVar[list[str]] = []

    def read(self, replies: Iterable[Message], downloads: Mapping[int, Download]) -> list[ClientUpload]:
        self.steps.append("read")
        return super().read(replies, downloads)

    def screen(self, uploads: list[ClientUpload]) -> list[ClientUpload]:
        self.steps.append("screen")
        return super().screen(uploads)

    def weigh(self, uploads: list[ClientUpload]) -> np.ndarray:
        self.steps.append("weigh")
        return super().weigh(uploads)

    def account(self, uploads: list[ClientUpload], weights: np.ndarray) -> None:
        self.steps.append("account")
        super().account(uploads, weights)

    def enough(self, uploads: list[ClientUpload]) -> bool:
        self.steps.append("enough")
        return super().enough(uploads)

    def select(self, uploads: list[ClientUpload]) -> list[ClientUpload]:
        self.steps.append("select")
        return super().select(uploads)


def round_replies(strategy: Any, grid: Any, server_round: int, scale: Mapping[int, float] | None = None) -> list[Message]:
    """The round's train messages answered: each client's download plus its honest change (x ``scale``)."""
    messages = list(strategy.configure_train(server_round, ArrayRecord(), ConfigRecord(), grid))
    replies = []
    for msg in messages:
        k = partition(msg)
        download = {key: array.numpy() for key, array in msg.content.array_records["arrays"].items()}
        change = honest_change(download, k, server_round)
        upload = {key: (value + (scale or {}).get(k, 1.0) * change[key]).astype(np.float32)
                  for key, value in download.items()}
        replies.append(reply(msg, upload, {"num-examples": 100 + 10 * k, "partition-id": k, "train-loss": 1.0 + k}))
    return replies


def test_the_steps_run_in_the_documented_order_and_a_round_with_too_few_uploads_selects_nothing() -> None:
    # Prepare: three clients; a second strategy needs more valid uploads than its round can give
    strategy, grid = connected("fedit")
    starved, starved_grid = connected("fedit", ("faults.max_failed_rounds=5",))
    replies, starved_replies = round_replies(strategy, grid, 1), round_replies(starved, starved_grid, 1)[:0]
    # Execute
    StepLog.steps = []
    result = StepLog(strategy, 1).run(replies)
    order, StepLog.steps = StepLog.steps, []
    failed = StepLog(starved, 1).run(starved_replies)
    # Assert: parse and validate (read), screen, weigh, account, the failure policy, select
    assert order == ["read", "screen", "weigh", "account", "enough", "select"]
    assert result.enough and [u.partition_id for u in result.selected] == [0, 1, 2] == [
        u.partition_id for u in result.uploads]
    assert result.record is strategy.record(1) and result.record.clients == 3
    assert np.allclose(result.weights, np.array([100, 110, 120]) / 330)
    assert StepLog.steps == ["read", "screen", "weigh", "account", "enough"]
    assert not failed.enough and failed.selected == [] and starved.failed_rounds == 1


def test_the_record_accounts_every_valid_upload_and_a_byzantine_selection_chooses_among_copies() -> None:
    # Prepare: seven fedit clients under MultiKrum (f = 1); client 1 scales its change by 5
    nodes = [{"partition-id": k, "rank": 4, "declared": 100 + 10 * k} for k in range(7)]
    strategy, grid = connected("fedit", (*SEVEN, "faults.aggregation=multikrum"), nodes)
    replies = round_replies(strategy, grid, 1, {1: 5.0})
    # Execute
    result = ReplyPipeline(strategy, 1).run(replies)
    # Assert: the record counts all seven, with their loss weighted over all seven
    record = result.record
    assert record.clients == 7 == len(result.uploads)
    assert record.train_loss == pytest.approx(np.average([1.0 + k for k in range(7)], weights=[100 + 10 * k for k in range(7)]))
    # Assert: MultiKrum keeps six, not client 1; the kept ones are copies, the accounted uploads untouched
    assert [u.partition_id for u in result.selected] == [0, 2, 3, 4, 5, 6] and result.clients == 6
    assert all(s is not u for s in result.selected for u in result.uploads)
    assert [u.weight for u in result.uploads] == [100.0 + 10 * k for k in range(7)]
    assert record.per_client_train["1"]["byzantine_kept"] is False


def test_the_aggregation_step_receives_the_pipelines_result() -> None:
    # Prepare: fedit at one rank, whose aggregate is the weighted mean of its uploads
    strategy, grid = connected("fedit", ("clients.ranks=[4, 4, 4]",), [{"partition-id": k, "rank": 4} for k in range(3)])
    replies = round_replies(strategy, grid, 1)
    received: list[RoundReplies] = []
    aggregate_round = strategy.aggregate_round

    def spy(result: RoundReplies) -> Any:
        received.append(result)
        return aggregate_round(result)

    strategy.aggregate_round = spy  # type: ignore[method-assign]
    # Execute
    arrays, metrics = strategy.aggregate_train(1, replies)
    # Assert: one result, its selected uploads' weighted mean is the new global adapter
    (result,) = received
    weights = np.array([u.weight for u in result.selected]) / sum(u.weight for u in result.selected)
    mean = {key: sum(w * u.payload[key].astype(np.float64) for w, u in zip(weights, result.selected))
            for key in result.selected[0].payload}
    assert arrays is not None and metrics is not None and metrics["clients"] == 3
    for key, value in strategy.global_arrays().items():
        np.testing.assert_allclose(value, mean[key], rtol=1e-5, atol=1e-6)
