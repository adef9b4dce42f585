"""fedlora's Flower ClientApp: ``query`` (profile), ``train`` and ``evaluate``.

Heavy libraries (torch, transformers, peft, datasets) are imported inside the handlers: in a
deployment every message starts a fresh ClientApp process, so the module itself must stay
cheap. Within one process (a simulation actor) data, tokenisation and the backbone are cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from logging import DEBUG, WARNING, getLogger

from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from fedlora import protocol
from fedlora.clients.secure import masked_update, secure_when_asked

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show


TASK_STARTED_ENV = "FEDLORA_TASK_STARTED"  # epoch seconds a prestarted process was handed its message


def _process_age() -> float:
    """Seconds since this process got its message: since a prestarted worker was handed it
    (``FEDLORA_TASK_STARTED``, set by fedlora's warm SuperExec), else since the process started
    (the OS start time; nan where psutil cannot tell)."""
    try:
        import os

        handed = os.environ.get(TASK_STARTED_ENV)
        if handed:
            return time.time() - float(handed)
        import psutil

        return time.time() - psutil.Process().create_time()
    except Exception:  # noqa: BLE001 - a timing metric must never fail a message
        return float("nan")


app = ClientApp()
# What this ClientApp can do beyond training, declared in its profile (fedlora.profile): its train
# handler runs Flower's SecAgg+ mod when the server asks (clients/secure.py)
CAPABILITIES = (protocol.SECURE_AGGREGATION,)


def _flower_version() -> str:
    from importlib.metadata import version

    return version("flwr")


# Process start -> this module imported (interpreter, flwr and this module): the cold-start cost of
# every message in a deployment, where each message gets a fresh ClientApp process.
IMPORT_SECONDS = _process_age()
_FIRST_MESSAGE = [True]


PHASE_METRICS = {"libraries": protocol.SETUP_LIBRARIES_SECONDS, "data": protocol.SETUP_DATA_SECONDS,
                 "model": protocol.SETUP_MODEL_SECONDS, "adapter": protocol.SETUP_ADAPTER_SECONDS}


class Phases:
    """Where a message's setup time goes: ``setup-<phase>-seconds`` per phase (libraries: the heavy
    imports; data: config, profile and the client's data; model: loading the backbone and
    tokenizer, once per process; adapter: the rest of building the model with its adapter)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + now - self._last
        self._last = now

    def model(self, load_seconds: float, phase: str = "adapter") -> None:
        """Lap ``phase`` with the backbone loading of ``load_seconds`` moved to ``model``."""
        self.lap(phase)
        self.seconds[phase] -= load_seconds
        self.seconds["model"] = self.seconds.get("model", 0.0) + load_seconds

    def metrics(self) -> dict[str, float]:
        return {PHASE_METRICS[phase]: seconds for phase, seconds in self.seconds.items()}


def _startup_metrics(setup_seconds: float, phases: Phases) -> dict[str, float]:
    """``import-seconds``, ``setup-seconds``, ``setup-<phase>-seconds`` and, for a process's first
    message, ``start-seconds`` (process start -> local training / evaluation starts; in a
    deployment: message arrival)."""
    metrics = {protocol.IMPORT_SECONDS: IMPORT_SECONDS, protocol.SETUP_SECONDS: setup_seconds, **phases.metrics()}
    if _FIRST_MESSAGE[0]:
        metrics[protocol.START_SECONDS] = _process_age()
    return metrics


def _first_step_metrics(stats) -> dict[str, float]:
    """``first-step-seconds`` for a process's first message: message arrival -> its first training
    step (imports, data, model, adapter, tokenisation)."""
    if not _FIRST_MESSAGE[0]:
        return {}
    _FIRST_MESSAGE[0] = False
    return {protocol.FIRST_STEP_SECONDS: _process_age() - (time.perf_counter() - stats.first_step_at)}


def _setup(msg: Message, context: Context):
    """Config, profile and the federation's data index for this message (heavy imports happen here)."""
    from fedlora.data import build_federated_data
    from fedlora.profile import resolve_profile
    from fedlora.schema import config_from_json

    message_config = dict(msg.content.config_records[protocol.CONFIG_RECORD])
    if context.node_config.get(protocol.NODE_CACHE_DIR):  # the silo's own cache folder (derived model files)
        import os

        os.environ["FEDLORA_CACHE"] = str(context.node_config[protocol.NODE_CACHE_DIR])
    config = config_from_json(str(message_config[protocol.EXPERIMENT]))
    _limit_threads(config.federation.num_cpus)
    profile = resolve_profile(config, context.node_config)
    if protocol.RANK in message_config:  # the server's one rank decision for this client and round
        profile.rank = int(protocol.number(message_config[protocol.RANK]))
    labels = message_config.get(protocol.LABEL_NAMES)
    if profile.data_path and isinstance(labels, list) and labels:  # a silo with its own data and the server's
        from fedlora.data.silo import SiloFederation  # labels: [data].source is not read (nor WordNet)

        return config, profile, SiloFederation(config.data, [str(label) for label in labels]), message_config
    return config, profile, build_federated_data(config.data), message_config


def _client_data(profile, config, federated):
    """This client's data: its simulated partition (built on first use) or the silo's own file."""
    if profile.data_path:  # the silo's own data (node config data-path), same labels as the server
        from fedlora.data.silo import load_silo_data

        return load_silo_data(profile.data_path, config.data, federated.label_names, profile.partition_id)
    return federated.client(profile.partition_id)


def _job(msg: Message, context: Context, phase: str):
    """Resolve config, profile, data and kept state for this message."""
    started = time.perf_counter()
    phases = Phases()
    import peft  # noqa: F401 - the heavy libraries, imported here to time them (cached after a process's first)
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from fedlora.clients.trainers.base import ClientJob

    phases.lap("libraries")
    config, profile, federated, message_config = _setup(msg, context)
    data = _client_data(profile, config, federated)
    profile.num_train_examples = len(data.train)
    _restore_state(message_config, context, profile.partition_id, phase)
    job = ClientJob(config, profile, data, federated, context.state, message_config)
    phases.lap("data")
    return job, time.perf_counter() - started, phases


def _prepared(job, download, phases: Phases):
    """The trainer and its model (local state overlaid with ``download``), timed into ``phases``."""
    from fedlora.backbones import load_seconds

    loaded = load_seconds()
    trainer = _trainer(job)
    model = trainer.prepare(download)
    phases.model(load_seconds() - loaded)
    return trainer, model


def _checkpoint_root(message_config: dict, context: Context) -> str:
    """Where this client checkpoints its kept state: the node config's ``checkpoint-dir`` (a
    silo's own folder in a deployment), else the folder the server names (simulation)."""
    return str(context.node_config.get(protocol.NODE_CHECKPOINT_DIR, "") or message_config.get(protocol.CHECKPOINT_DIR, ""))


def _state_on_disk(message_config: dict, context: Context) -> bool:
    """Simulation: between messages the client's state lives in its checkpoint file, not in
    ``context.state`` (which the engine holds in memory for every simulated client)."""
    return bool(message_config.get(protocol.STATE_ON_DISK)) and bool(_checkpoint_root(message_config, context))


def _restore_state(message_config: dict, context: Context, partition_id: int, phase: str) -> None:
    """Refill an empty ``context.state`` from the client's checkpoint: on a resumed run (the
    newest state of a round <= the resumed round) and, with the state on disk, before every
    message (the newest state of an earlier round for training, of this round or earlier for
    evaluation)."""
    root = _checkpoint_root(message_config, context)
    if not root or len(context.state):
        return
    upto = int(message_config.get(protocol.RESUME_ROUND, 0))
    if _state_on_disk(message_config, context):
        server_round = int(message_config.get(protocol.SERVER_ROUND, 0))
        upto = max(upto, server_round - 1 if phase == "train" else server_round)
    if upto:
        from fedlora.checkpoint import restore_client_state

        restored = restore_client_state(root, partition_id, upto, context.state)
        log(DEBUG, "client %d: restored state of round %d", partition_id, restored)


def _save_state(job, context: Context) -> bool:
    """Checkpoint the client's state after training; True when it is on disk."""
    root = _checkpoint_root(job.message_config, context)
    if root:
        from fedlora.checkpoint import save_client_state

        try:
            save_client_state(root, job.profile.partition_id, job.server_round, context.state)
            return True
        except OSError as error:  # a checkpoint that cannot be written must not fail the round
            log(WARNING, "client %d: cannot checkpoint its state in %s: %s", job.profile.partition_id, root, error)
    return False


def _release_state(job, context: Context) -> None:
    """With the state on disk, leave ``context.state`` empty between messages."""
    if _state_on_disk(job.message_config, context):
        for key in list(context.state):
            del context.state[key]


def _worker(precision: str) -> ConfigRecord:
    """Where and how this message ran: the host, torch's threads and the precision it trained at, and
    the Ray node when the simulation engine runs it on Ray."""
    import socket
    import sys

    import torch

    where = ConfigRecord({protocol.WORKER_HOST: socket.gethostname(), protocol.WORKER_THREADS: str(torch.get_num_threads()),
                          protocol.WORKER_PRECISION: precision})
    if "ray" in sys.modules:  # inside a Ray actor (never imported otherwise)
        import ray

        if ray.is_initialized():
            where[protocol.WORKER_RAY_NODE] = str(ray.get_runtime_context().get_node_id())
    return where


def _limit_threads(num_cpus: float) -> None:
    import torch

    torch.set_num_threads(max(1, int(num_cpus)))


def _in_received_order(upload: dict, received) -> dict:
    """The upload with the keys it shares with the download first, in the download's order (Flower's
    ``fixedclipping_mod`` pairs a reply's arrays with the received ones by position)."""
    received = [key for key in received if key in upload]
    return {key: upload[key] for key in received} | {key: value for key, value in upload.items() if key not in received}


def _trainer(job):
    from fedlora.clients.trainers import trainer_class

    return trainer_class(job.config.strategy.name)(job)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with this client's profile (rank, budgets, number of training examples); a simulated
    client counts its training examples from the partition index, without building its data."""
    config, profile, federated, _ = _setup(msg, context)
    profile.flower_version = _flower_version()
    profile.capabilities = list(CAPABILITIES)
    if profile.data_path:
        profile.num_train_examples = len(_client_data(profile, config, federated).train)
    else:
        profile.num_train_examples = federated.num_train_examples(profile.partition_id)
    content = RecordDict({protocol.PROFILE_RECORD: ConfigRecord({protocol.PROFILE_JSON: profile.model_dump_json()})})
    return Message(content=content, reply_to=msg)


def clipping_when_asked(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """Flower's ``fixedclipping_mod`` when the server asks for it, else nothing.

    Flower's ``DifferentialPrivacyClientSideFixedClipping`` wrapper puts its clipping norm in every
    training message's config; the mod then clips this client's update (the reply's arrays minus
    the arrays received) to that L2 norm before the reply leaves. Without the key (every run that is
    not wrapped) the reply passes unchanged: Flower's mod alone would answer such a message with an
    error. Only training messages pass through it (``@app.train(mods=...)``).
    """
    config = msg.content.config_records.get(protocol.CONFIG_RECORD)
    if config is not None and KEY_CLIPPING_NORM in config:
        return fixedclipping_mod(msg, context, call_next)
    return call_next(msg, context)


# SecAgg+ (secure_aggregation.enabled): Flower's secaggplus_mod outermost, the reply masked (clients/secure.py)
@app.train(mods=[secure_when_asked, masked_update, clipping_when_asked])
def train(msg: Message, context: Context) -> Message:
    """Merge the download with local state, train locally, upload what the method uploads."""
    from fedlora.clients.faults import maybe_corrupt, maybe_fail
    from fedlora.lora import from_array_record, to_array_record

    job, setup_seconds, phases = _job(msg, context, "train")
    faults = job.config.faults
    maybe_fail(faults, job.server_round, job.profile.partition_id)  # simulated crash ([faults])
    trainer, model = _prepared(job, from_array_record(msg.content.array_records[protocol.ARRAYS_RECORD]), phases)
    startup = _startup_metrics(setup_seconds, phases)
    received = trainer.received_metrics(model) if job.message_config.get(protocol.EVAL_RECEIVED) else {}
    stats = trainer.fit(model)
    startup |= _first_step_metrics(stats)
    upload, _ = maybe_corrupt(faults, job.server_round, job.profile.partition_id, trainer.upload(model))
    upload = _in_received_order(upload, msg.content.array_records[protocol.ARRAYS_RECORD].keys())
    trainer.save_state(trainer.keep(model))
    if _save_state(job, context):
        _release_state(job, context)
    metrics = {
        protocol.NUM_EXAMPLES: len(job.data.train),
        protocol.PARTITION_ID: job.profile.partition_id,
        protocol.TRAIN_LOSS: stats.loss,
        protocol.TRAIN_STEPS: stats.steps,
        protocol.TRAIN_EXAMPLES: stats.examples,
        protocol.TRAIN_SECONDS: stats.seconds,
        **startup,
        **received,
        **trainer.train_metrics(),
        **trainer.privacy_metrics(),
    }
    log(DEBUG, "client %d round %d: loss %.4f in %.1fs", job.profile.partition_id, job.server_round, stats.loss, stats.seconds)
    content = RecordDict({protocol.ARRAYS_RECORD: to_array_record(upload),
                          protocol.METRICS_RECORD: MetricRecord(metrics), protocol.WORKER_RECORD: _worker(trainer.precision)})
    trainer.release(model)
    return Message(content=content, reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate this client's personalised model on its local test and validation splits."""
    from fedlora.lora import from_array_record
    from fedlora.models import save_adapter

    job, setup_seconds, phases = _job(msg, context, "evaluate")
    trainer, model = _prepared(job, from_array_record(msg.content.array_records[protocol.ARRAYS_RECORD]), phases)
    startup = _startup_metrics(setup_seconds, phases)
    _FIRST_MESSAGE[0] = False
    metrics = trainer.evaluate(model, with_global=bool(job.message_config.get(protocol.EVAL_GLOBAL, False)))
    _release_state(job, context)  # evaluation only reads the state: its file is unchanged
    metrics[protocol.PARTITION_ID] = float(job.profile.partition_id)
    metrics |= startup  # per round and client in results.json (rounds[].per_client)
    save_dir = str(job.message_config.get(protocol.SAVE_ADAPTER_DIR, ""))
    if save_dir:
        labels = None if trainer.causal else job.federated.label_names
        save_adapter(model, f"{save_dir}/client_{job.profile.partition_id}", labels)
    trainer.release(model)
    return Message(content=RecordDict({protocol.METRICS_RECORD: MetricRecord(metrics)}), reply_to=msg)
