"""Idle clients cost nothing but their partition index (issue 19, 1,000 simulated clients).

Properties, not timings (speed and memory are measured by ``benchmarks/scale.py``): building the
federation builds no client's data, a run builds only the clients it samples, and between messages
a simulated client's kept state is in its checkpoint file, not in the engine's memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import RecordDict

from fedlora.checkpoint import CLIENTS_DIR, checkpoint_dir, restore_client_state
from fedlora.clients.trainers.base import LOCAL_STATE_KEY
from fedlora.config import DataConfig, load_config
from fedlora.data import build_federated_data
from fedlora.lora import from_array_record

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"


def test_building_the_federation_builds_no_client_and_a_client_builds_only_itself() -> None:
    # Prepare: 40 clients (a data seed no other test uses: a fresh federation in this process)
    cfg = DataConfig(max_examples=2000, global_test_size=100, num_clients=40, partition="dirichlet", seed=4242)

    # Execute
    data = build_federated_data(cfg)
    counts = [data.num_train_examples(k) for k in range(40)]
    built_before = set(data.built)
    client = data.client(17)

    # Assert: the index answers sizes without building anything; asking for 17 builds 17 alone
    assert built_before == set()
    assert data.built == {17}
    assert len(client.train) == counts[17]
    assert sum(counts) == sum(len(c.train) for c in data.clients)  # .clients builds every client
    assert data.built == set(range(40))


def test_a_client_is_the_same_whichever_clients_were_built_before() -> None:
    # Prepare
    from fedlora.data import federated

    cfg = DataConfig(max_examples=1500, global_test_size=100, num_clients=12, label_noise="symmetric",
                     noise_rate=0.3, seed=4243)
    alone = build_federated_data(cfg).client(5)
    federated._build_cached.cache_clear()

    # Execute: the same client after every other one
    data = build_federated_data(cfg)
    after_others = [data.client(k) for k in range(12)][5]

    # Assert
    assert after_others is not alone
    for split in ("train", "val", "test"):
        assert getattr(after_others, split).to_dict() == getattr(alone, split).to_dict()


@pytest.fixture(scope="module")
def sampled_run(tmp_path_factory: pytest.TempPathFactory):
    """fedsa_lora (B stays on the clients) on 12 clients, 3 sampled per round, 2 rounds, in process."""
    from fedlora.app.server import run_server
    from fedlora.clients.app import app as client_app
    from fedlora.simulations.inprocess import InProcessGrid, node_configs

    out = tmp_path_factory.mktemp("sampled")
    config = load_config(SMOKE, [
        "strategy.name=fedsa_lora", "data.num_clients=12", "data.max_examples=900", "data.seed=4244",
        "clients.ranks=[]", "train.rounds=2", "train.max_steps=2", "federation.fraction_train=0.25",
        "federation.fraction_evaluate=0.25", "output.save_adapters=false", "output.tensorboard=false",
    ])
    grid = InProcessGrid(client_app, node_configs(config.data.num_clients))
    writer = run_server(grid, config, out)
    return config, grid, writer, out


@pytest.mark.e2e
def test_a_run_builds_only_the_clients_it_samples(sampled_run) -> None:
    # Prepare
    config, _, writer, _ = sampled_run
    trained = {int(k) for r in writer.rounds for k in r.per_client_train}
    evaluated = {int(k) for r in writer.rounds for k in r.per_client}

    # Execute
    built = build_federated_data(config.data).built

    # Assert: the query asked all 12 for their profile, yet only the sampled ones were built
    assert all(r.failures == 0 for r in writer.rounds)
    assert built == trained | evaluated
    assert len(built) < config.data.num_clients


@pytest.mark.e2e
def test_kept_state_is_on_disk_not_in_the_engine_between_messages(sampled_run) -> None:
    # Prepare
    _, grid, writer, out = sampled_run
    trained = sorted({int(k) for r in writer.rounds for k in r.per_client_train})

    # Execute
    states = {}
    for partition in trained:
        states[partition] = RecordDict()
        restore_client_state(checkpoint_dir(out) / CLIENTS_DIR, partition, writer.rounds[-1].round, states[partition])

    # Assert: every node's context.state is empty; each client that trained has its B in its file
    assert all(len(context.state) == 0 for context in grid.contexts.values())
    assert sorted(int(p.name) for p in (checkpoint_dir(out) / CLIENTS_DIR).iterdir()) == trained
    for partition, state in states.items():
        kept = from_array_record(state[LOCAL_STATE_KEY])
        assert any(key.endswith("::B") and abs(value).max() > 0 for key, value in kept.items()), partition


def test_the_tokenised_split_cache_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # Prepare
    from fedlora import training
    from fedlora.backbones import load_tokenizer

    monkeypatch.setattr(training, "TOKENIZED_CACHE_SIZE", 2)
    monkeypatch.setattr(training, "_TOKENIZED", type(training._TOKENIZED)())
    data = build_federated_data(DataConfig(max_examples=600, global_test_size=100, num_clients=4, seed=4245))
    tokenizer = load_tokenizer("tiny-bert")

    # Execute: four clients' training splits through the cache
    for k in range(4):
        training.make_loader(data.client(k).train, tokenizer, 8, 16, shuffle=False, cache_key=f"client-{k}")

    # Assert: only the two most recent stay
    assert list(training._TOKENIZED) == ["client-2", "client-3"]


@pytest.mark.e2e
def test_the_engine_sweeps_only_the_nodes_with_a_message_waiting() -> None:
    """fedlora's stand-in for Flower's ``add_messages_to_queue`` (simulations/polling.py) queues the
    same messages in the same order as Flower's loop, asking only the nodes that have one waiting."""
    import threading
    from queue import Queue
    from types import SimpleNamespace

    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState

    from fedlora.simulations.polling import add_messages_to_queue, polling_pending_nodes

    class Store(InMemoryLinkState):
        """An in-memory LinkState holding only messages (Flower's ``get_message_ins`` rule)."""

        def __init__(self, waiting: list[int]) -> None:  # no base init: no federation needed
            self.lock = threading.RLock()
            self.asked: list[int] = []
            self.message_ins_store = {f"m{i}": SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node, delivered_at=""))
                                      for i, node in enumerate(waiting)}

        def get_message_ins(self, node_id: int, limit: int | None, *, run_id: int | None = None) -> list:
            self.asked.append(node_id)
            found = [m for m in self.message_ins_store.values()
                     if m.metadata.dst_node_id == node_id and m.metadata.delivered_at == ""][:limit]
            for message in found:
                message.metadata.delivered_at = "now"
            return found

        def store_message_ins(self, message: object) -> None:
            with self.lock:
                self.message_ins_store[f"m{len(self.message_ins_store)}"] = message

    class OneSweep(threading.Event):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def is_set(self) -> bool:
            self.calls += 1
            return self.calls > 1

        def wait(self, timeout: float | None = None) -> bool:
            return True

    # Prepare: 1,000 nodes, messages waiting for nodes 907, 3 and 3 (a second one for node 3)
    nodes = {node: node for node in range(1000)}
    ours, flowers = Store([907, 3, 3]), Store([907, 3, 3])
    queue_ours, queue_flower = Queue(), Queue()
    # Execute: one sweep of each loop
    with polling_pending_nodes():
        assert vce_api.add_messages_to_queue is add_messages_to_queue
        add_messages_to_queue(ours, queue_ours, nodes, OneSweep())
    assert vce_api.add_messages_to_queue is not add_messages_to_queue  # Flower's loop is back
    vce_api.add_messages_to_queue(flowers, queue_flower, nodes, OneSweep())
    # Assert: the same messages (one per node and sweep, node order), 2 calls instead of 1,000
    delivered = [[m.metadata.dst_node_id for m in list(q.queue)] for q in (queue_ours, queue_flower)]
    assert delivered[0] == delivered[1] == [3, 907]
    assert ours.asked == [3, 907] and len(flowers.asked) == 1000
    assert "store_message_ins" not in vars(ours)  # the state's own method again once the loop ends

    # a message stored while the loop waits is swept at once, not at the next poll (here 1 hour away)
    later = Store([])
    stop, swept = threading.Event(), Queue()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("fedlora.simulations.polling.POLL_SECONDS", 3600.0)
        loop = threading.Thread(target=add_messages_to_queue, args=(later, swept, nodes, stop), daemon=True)
        loop.start()
        later.store_message_ins(message=SimpleNamespace(metadata=SimpleNamespace(dst_node_id=42, delivered_at="")))
        assert swept.get(timeout=30).metadata.dst_node_id == 42
        stop.set()
        later.store_message_ins(message=SimpleNamespace(metadata=SimpleNamespace(dst_node_id=7, delivered_at="")))
        loop.join(timeout=30)
    assert not loop.is_alive()


def test_the_simulation_grid_sees_a_reply_as_soon_as_it_is_stored() -> None:
    """send_and_receive on Flower's simulation grid: pushes the messages, returns once each has a
    reply, checking when a reply is stored (not at the next 0.1 s poll: here 1 hour away), and
    stops at the deadline when a reply never comes; the state's own store method is back after."""
    import threading
    import time
    from types import SimpleNamespace

    from flwr.superlink.grid import InMemoryGrid

    from fedlora.simulations import polling

    class State:
        def __init__(self) -> None:
            self.replies: dict[str, object] = {}

        def store_message_res(self, message: object) -> None:
            self.replies[message.metadata.reply_to_message_id] = message  # type: ignore[attr-defined]

    state = State()
    grid = InMemoryGrid(state_factory=SimpleNamespace(state=lambda: state))  # as run_simulation builds it
    grid.push_messages = lambda messages: [m.metadata.message_id for m in messages]  # type: ignore[method-assign]
    grid.pull_messages = lambda ids: [state.replies.pop(i) for i in list(ids) if i in state.replies]  # type: ignore[method-assign]
    message = SimpleNamespace(metadata=SimpleNamespace(message_id="m1"))
    reply = SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="m1"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(polling, "POLL_SECONDS", 3600.0)
        later = threading.Timer(0.2, lambda: state.store_message_res(reply))
        later.start()
        assert polling.send_and_receive(grid, [message], timeout=None) == [reply]
        started = time.monotonic()
        assert polling.send_and_receive(grid, [message], timeout=0.3) == []  # no reply: the deadline ends it
        assert time.monotonic() - started < 60
    assert "store_message_res" not in vars(state)
