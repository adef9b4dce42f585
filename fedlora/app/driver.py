"""One fedlora run's rounds, read top-down: :class:`RoundDriver`.

The driver runs the one round loop (:func:`fedlora.strategies.loop.run_rounds`, Flower's
``Strategy.start`` loop, resumable) and gives it, as Flower's ``evaluate_fn``, its after-round
step: a round's work is the strategy's (Flower's hooks), what follows it is the driver's, in
named steps::

    run(grid)
      round 0 (a new run):    zero_shot            a causal LM's base model, the reference
      rounds first..last:     the strategy's hooks (configure / send / aggregate, train and evaluate)
        after_round(t):       finish_round -> evaluate -> record -> checkpoint -> track -> report
      then:                   finish               adapters, profiles, plot, model cards

A resumed run's ``first`` is k + 1 after the checkpoint of round k. Everything the driver uses
is built complete before it (:func:`fedlora.app.server.run_server`): the strategy with the run's
paths, the evaluator with the method's LoRA init, the results writer with its precision and
labels, the tracker and the round progress.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp import Grid

from fedlora import protocol
from fedlora.app.progress import RoundProgress
from fedlora.app.tracking import Tracker
from fedlora.config import ExperimentConfig
from fedlora.evaluation import GlobalEvaluator
from fedlora.results import ResultsWriter, RoundRecord

if TYPE_CHECKING:  # the strategies take a while to import; the caller has built one
    from fedlora.strategies.base import LoRAStrategy

# results.json strategy_info: who measured the round's global accuracy (ROUGE-L): "server" (the
# strategy's global model on the global test set) or "clients" (a method without a global model:
# each client's own model on it, as the clients reported it; the server cannot check that number)
GLOBAL_ACCURACY_FROM = "global_accuracy_from"


class RoundDriver:
    """Rounds ``first``..``config.train.rounds`` of ``strategy`` and what follows each (see the
    module docstring). ``first``: 1, or k + 1 for a run resumed after round k."""

    def __init__(self, config: ExperimentConfig, out_dir: Path, strategy: LoRAStrategy[Any], evaluator: GlobalEvaluator,
                 writer: ResultsWriter, tracker: Tracker, progress: RoundProgress, first: int = 1) -> None:
        self.config = config
        self.out_dir = out_dir
        self.strategy = strategy
        self.evaluator = evaluator
        self.writer = writer
        self.tracker = tracker
        self.progress = progress
        self.first = first
        self.causal = config.model.kind == "causal_lm"

    def run(self, grid: Grid) -> None:
        """The rounds (the loop calls :meth:`after_round` after each, and for round 0 before round 1
        of a new run), then :meth:`finish`; the progress closes and the tracker ends either way
        (Ctrl-C included)."""
        from fedlora.simulations.polling import send_and_receive  # the grid's, replies seen as they arrive
        from fedlora.strategies.loop import run_rounds

        ok = False
        try:
            run_rounds(self.strategy, grid, self.first, self.config.train.rounds,
                       timeout=self.config.federation.round_timeout, evaluate_fn=self.after_round,
                       exchange=send_and_receive, level=logging.DEBUG)
            self.progress.close()
            self.finish()
            ok = True
        finally:
            self.progress.close()
            self.tracker.finish(ok)

    def after_round(self, server_round: int, _arrays: ArrayRecord) -> MetricRecord | None:
        """Flower's ``evaluate_fn``: round 0 is :meth:`zero_shot`; after round t the round's record
        is finished, evaluated, recorded, checkpointed, tracked and reported, in that order."""
        if server_round == 0:
            self.zero_shot()
            return None
        record = self.strategy.finish_round(server_round)
        by_clients = self.evaluate(server_round, record)
        self.record(record)
        self.checkpoint(server_round)
        self.track(record)
        self.report(record, by_clients)
        return MetricRecord({protocol.GLOBAL_ACCURACY: record.global_accuracy})

    def zero_shot(self) -> None:
        """A causal LM's round 0: the initial adapter (B = 0) is the base model, scored as the
        reference the rounds improve on (a classifier's untrained head has nothing to say)."""
        if not self.causal:
            return
        record = RoundRecord(round=0)
        started, cpu_started = time.perf_counter(), time.process_time()
        self.evaluator.evaluate_into(self.strategy.initial_adapter(self.config.model.lora_rank), record, self.out_dir)
        record.seconds = time.perf_counter() - started
        record.cpu_seconds = time.process_time() - cpu_started
        self.writer.add(record)
        self.track(record)
        self.report(record, by_clients=False)

    def evaluate(self, server_round: int, record: RoundRecord) -> bool:
        """On an evaluation round, the global model on the global test set, into ``record``.
        Returns whether the global score is the clients' (a method without a global model)."""
        payload = self.strategy.global_payload()
        if self.strategy.evaluates(server_round):
            self.writer.strategy_info[GLOBAL_ACCURACY_FROM] = "server" if payload is not None else "clients"
            if payload is not None:
                self.evaluator.evaluate_into(payload, record, self.out_dir)
        return payload is None

    def record(self, record: RoundRecord) -> None:
        """The round into results.json (rewritten), with the privacy spent so far."""
        self.writer.privacy = self.strategy.privacy_report()
        self.writer.add(record)

    def checkpoint(self, server_round: int) -> None:
        """The server's checkpoint after ``server_round`` (fedlora.checkpoint): what a resume continues."""
        from fedlora import checkpoint

        checkpoint.save_server(self.out_dir, server_round, self.config, self.strategy.state_dict(),
                               self.writer.rounds, self.writer.privacy, partitions=self.strategy.roster.partitions)

    def track(self, record: RoundRecord) -> None:
        """The round to TensorBoard (and MLflow when configured)."""
        self.tracker.round(record)

    def report(self, record: RoundRecord, by_clients: bool) -> None:
        """The round's line (its time is what benchmarks/overhead.py reads from run.log)."""
        self.progress.round_done(record.round, progress_line(record, self.config.train.rounds, self.causal,
                                                             by_clients=by_clients))

    def finish(self) -> None:
        """Save the global adapter (peft format), the profiles, the accuracy plot, and every
        adapter's model card and fedlora.json (:func:`fedlora.app.adapters.write_cards`)."""
        from fedlora.app.adapters import write_cards
        from fedlora.app.plotting import plot_accuracy
        from fedlora.models import save_adapter

        payload, writer, roster = self.strategy.global_payload(), self.writer, self.strategy.roster
        if payload is not None and self.config.output.save_adapters:
            labels = None if self.causal else self.evaluator.federated.label_names
            save_adapter(self.evaluator.model_for(payload), self.out_dir / "adapters" / "global", labels)
        writer.strategy_info["clients"] = {str(p): profile.model_dump() for p, profile in sorted(roster.profiles.items())}
        writer.strategy_info["refused"] = list(roster.refused.values())
        writer.strategy_info.update(self.strategy.save_artifacts(self.out_dir))
        writer.write()
        results = writer.to_dict()
        plot_accuracy(results, self.out_dir / "accuracy_vs_round.png")
        write_cards(self.out_dir, results)


def progress_line(record: RoundRecord, rounds: int, causal: bool = False, by_clients: bool = False) -> str:
    """One round's line; ``by_clients``: the global score is the clients' report (no global model),
    shown as ``global (clients)``."""

    def pct(x: float) -> str:
        return "  -  " if math.isnan(x) else f"{x:.3f}"

    label = "global (clients)" if by_clients else "global"

    def beside(mean: float, worst: float) -> str:  # so that one client's weight cannot set the figure alone
        return "" if math.isnan(mean) else f" (mean {pct(mean)}, worst {pct(worst)})"

    if causal:
        return (
            f"round {record.round:>3}/{rounds}  {label} ROUGE-L {pct(record.global_rouge_l)}  "
            f"ppl {pct(record.global_perplexity)}  personalised ROUGE-L {pct(record.personalized_rouge_l)}"
            f"{beside(record.personalized_rouge_l_unweighted, record.personalized_rouge_l_worst)}  "
            f"loss {pct(record.train_loss)}  up {record.bytes_up / 1e6:.2f} MB  down {record.bytes_down / 1e6:.2f} MB  "
            f"clients {record.clients} failures {record.failures}  {record.seconds:.1f}s"
        )
    return (
        f"round {record.round:>3}/{rounds}  {label} {pct(record.global_accuracy)}  "
        f"personalised {pct(record.personalized_accuracy)}"
        f"{beside(record.personalized_accuracy_unweighted, record.personalized_accuracy_worst)}  "
        f"received {pct(record.received_accuracy)}  loss {pct(record.train_loss)}  "
        f"up {record.bytes_up / 1e6:.2f} MB  down {record.bytes_down / 1e6:.2f} MB  "
        f"clients {record.clients} failures {record.failures}  {record.seconds:.1f}s"
    )
