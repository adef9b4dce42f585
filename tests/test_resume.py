"""Checkpoint / resume: kill -9 mid-round, resume, same final adapters and metrics."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, RecordDict
from strategy_helpers import renumber_nodes, short_run_overrides
from test_golden import assert_close

from fedlora.checkpoint import (
    checkpoint_dir,
    drop_client_states_after,
    load_server,
    restore_client_state,
    save_client_state,
    save_server,
)
from fedlora.config import ConfigError, load_config
from fedlora.results import ResultsWriter, RoundRecord

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "configs" / "smoke.toml"
ROUNDS = 3


def _cmd(out: Path, strategy: str, *extra: str, engine: str = "inprocess") -> list[str]:
    return [sys.executable, "-m", "fedlora.app.cli", "run", str(SMOKE), "--engine", engine, "--out", str(out),
            "--set", f"train.rounds={ROUNDS}", "--set", f"strategy.name={strategy}", *extra]


def _adapters(out: Path) -> dict[str, dict[str, np.ndarray]]:
    from safetensors.numpy import load_file

    return {str(p.relative_to(out)): load_file(p) for p in sorted((out / "adapters").rglob("*.safetensors"))}


# Serialised message sizes differ by a few bytes between an uninterrupted and a resumed run:
# replies carry the client's timings as metrics (a worker's start-up time only in its first
# reply), and the first resumed round tells each client which checkpointed round to restore.
_BYTES_PER_MESSAGE = 32
_WIRE = ("wire_bytes_up", "wire_bytes_down", "wire_bytes_eval")
_WHERE = ("host", "ray-node")  # where a client ran (per_client_train): a new Ray start, new node ids


def _rounds(results: dict) -> list[dict]:
    """Every round record, whole, without what measures time (which differs between two runs):
    timings, where clients ran, and the message sizes that include timings (checked by :func:`_assert_wire_close`)."""
    def untimed(value):
        if isinstance(value, dict):
            return {k: untimed(v) for k, v in value.items()
                    if not k.endswith("seconds") and k not in _WIRE and k not in _WHERE}
        return value

    return [untimed(record) for record in results["rounds"]]


def _assert_wire_close(actual: dict, expected: dict) -> None:
    """Message sizes equal up to the timings and restore instructions they carry."""
    for a, e in zip(actual["rounds"], expected["rounds"], strict=True):
        replies = max(1, int(e.get("clients") or 0) + int(e.get("failures") or 0), len(e.get("per_client") or {}))
        for key in _WIRE:
            assert abs(int(a.get(key) or 0) - int(e.get(key) or 0)) <= _BYTES_PER_MESSAGE * 2 * replies, (
                f"round {e['round']} {key}: {a.get(key)} vs {e.get(key)}")


def test_a_resumed_run_counts_the_time_of_its_restored_rounds(tmp_path):
    # Prepare: a writer continuing a run whose two checkpointed rounds took 100 s (60 s of CPU)
    writer = ResultsWriter(load_config(SMOKE), tmp_path)
    writer.restore([RoundRecord(round=1, seconds=40.0, cpu_seconds=25.0),
                    RoundRecord(round=2, seconds=60.0, cpu_seconds=35.0)])

    # Execute
    results = writer.to_dict()

    # Assert: the run's wall and CPU times start from the restored rounds', not from zero
    assert [r["round"] for r in results["rounds"]] == [1, 2]
    assert 100.0 <= results["wall_seconds"] < 110.0
    assert 60.0 <= results["cpu_seconds"] < 70.0


def test_client_state_restores_newest_round_not_after_resume_round(tmp_path):
    # Prepare: a client saved its state after rounds 1, 2 and 3
    for r in (1, 2, 3):
        state = RecordDict({"kept": ArrayRecord([np.full(2, float(r))]), "c": ConfigRecord({"r": r})})
        save_client_state(tmp_path, 5, r, state)
    # Execute: resume after round 2 (round 3 was interrupted)
    restored = RecordDict()
    newest = restore_client_state(tmp_path, 5, 2, restored)
    # Assert: round 2's state, and only the files a resume can still need are kept
    assert newest == 2
    assert restored["c"]["r"] == 2
    assert sorted(p.name for p in (tmp_path / "5").iterdir()) == ["round_2.bin", "round_3.bin"]
    assert restore_client_state(tmp_path, 6, 2, RecordDict()) == 0


def test_a_resumed_run_drops_client_states_of_the_interrupted_round(tmp_path):
    # Prepare: client 1 trained in rounds 1 and 3 (3 was interrupted), client 2 in round 2
    for partition, r in ((1, 1), (1, 3), (2, 2)):
        save_client_state(tmp_path, partition, r, RecordDict({"c": ConfigRecord({"r": r})}))
    # Execute: resume after round 2
    dropped = drop_client_states_after(tmp_path, 2)
    # Assert: round 3's file is gone, so reading "the newest state" can only find completed rounds
    assert dropped == 1
    restored = RecordDict()
    assert restore_client_state(tmp_path, 1, 10, restored) == 1 and restored["c"]["r"] == 1
    assert restore_client_state(tmp_path, 2, 10, RecordDict()) == 2


@pytest.mark.parametrize(
    ("saved", "resumed", "accepted"),
    [
        ([], ["train.rounds=5"], True),  # more rounds: fine
        ([], ["train.lr=0.1"], False),
        (["privacy.dp=true", "privacy.target_epsilon=3"], ["privacy.dp=true", "privacy.target_epsilon=3",
                                                           "train.rounds=5"], False),  # noise planned for 2 rounds
    ],
)
def test_resume_config_must_match_the_checkpoint(tmp_path, saved, resumed, accepted):
    # Prepare: a checkpoint written under one config
    save_server(tmp_path, 1, load_config(SMOKE, saved), {}, [RoundRecord(round=1)])
    # Execute / Assert
    if accepted:
        assert load_server(tmp_path, load_config(SMOKE, resumed))["round"] == 1
    else:
        with pytest.raises(ConfigError, match="differs from the checkpointed run"):
            load_server(tmp_path, load_config(SMOKE, resumed))


def test_resume_without_checkpoint_or_with_other_config_is_one_line(tmp_path):
    # Prepare / Execute / Assert: no checkpoint
    with pytest.raises(ConfigError, match="no checkpoint"):
        load_server(tmp_path, load_config(SMOKE))
    # CLI: one line, exit 2
    proc = subprocess.run(_cmd(tmp_path, "fedit", "--resume", str(tmp_path)), check=False, capture_output=True,
                          text=True, cwd=ROOT)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "no checkpoint" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    ("strategy", "engine"),
    [("fedsa_lora", "inprocess"), ("flora", "inprocess"),  # client-kept state; node-keyed server state
     ("fedsa_lora", "ray")],  # Flower's simulation engine: clients in Ray actors, new node ids on resume
)
def test_kill_9_mid_round_then_resume_matches_uninterrupted(tmp_path, strategy, engine):
    # Prepare: an uninterrupted reference run
    env = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    reference, resumed = tmp_path / "a" / "run", tmp_path / "b" / "run"  # paths of one length: they travel in messages
    subprocess.run(_cmd(reference, strategy, engine=engine), check=True, capture_output=True, cwd=ROOT, env=env)

    # Execute: the same run, SIGKILLed once round 1's checkpoint exists, then resumed
    proc = subprocess.Popen(_cmd(resumed, strategy, engine=engine), cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    server_file = checkpoint_dir(resumed) / "server.json"
    while not server_file.exists() and proc.poll() is None:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole session: the server and, on Ray, its workers
    proc.wait()
    killed_after = load_server(resumed)["round"]
    subprocess.run(_cmd(resumed, strategy, "--resume", str(resumed), engine=engine), check=True, capture_output=True,
                   cwd=ROOT, env=env)

    # Assert: the kill interrupted the run; same adapters (bitwise or 1e-6) and same metrics
    import json

    assert killed_after < ROUNDS
    ref_results = json.loads((reference / "results.json").read_text())
    res_results = json.loads((resumed / "results.json").read_text())
    assert [r["round"] for r in res_results["rounds"]] == list(range(1, ROUNDS + 1))
    assert_close(_rounds(res_results), _rounds(ref_results), "rounds")
    _assert_wire_close(res_results, ref_results)
    # the resumed run's times cover its restored rounds too; every round measured its CPU time
    assert all(r["cpu_seconds"] > 0 for r in res_results["rounds"])
    assert res_results["wall_seconds"] >= sum(r["seconds"] for r in res_results["rounds"])
    assert res_results["cpu_seconds"] >= sum(r["cpu_seconds"] for r in res_results["rounds"])
    ref_adapters, res_adapters = _adapters(reference), _adapters(resumed)
    assert ref_adapters and ref_adapters.keys() == res_adapters.keys()
    for name, tensors in ref_adapters.items():
        assert tensors.keys() == res_adapters[name].keys()
        for key, value in tensors.items():
            np.testing.assert_allclose(res_adapters[name][key], value, atol=1e-6, err_msg=f"{name} {key}")



@pytest.mark.slow
def test_a_finished_run_extended_by_resume_with_a_later_decay_equals_the_longer_run(tmp_path):
    """A complete run resumed with more ``train.rounds`` and a learning-rate decay after its last
    round continues from its last checkpoint: the same rounds, sampled clients and adapters as one
    run of the longer length with that decay, so a scenario that is lengthened (the fidelity
    protocol's fedhera) extends its runs instead of running them again."""
    # Prepare: FedHera (server state, lazy allocations) on half of the clients a round, evaluated
    # every 2 rounds; 4 rounds at a constant rate, 4 rounds with the rate halved from round 3, and
    # 2 rounds at the constant rate
    import json

    env = {**os.environ, "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
    common = ["--set", "strategy.name=fedhera", "--set", "federation.fraction_train=0.5",
              "--set", "federation.evaluate_every=2", "--set", "train.lr=0.01"]
    decay = ["--set", "train.lr_decay_rounds=[3]"]
    constant, decayed, extended = (tmp_path / name / "run" for name in "abc")  # paths of one length

    def cli(out: Path, rounds: int, *extra: str) -> dict:
        subprocess.run([sys.executable, "-m", "fedlora.app.cli", "run", str(SMOKE), "--engine", "inprocess",
                        "--out", str(out), "--set", f"train.rounds={rounds}", *common, *extra],
                       check=True, capture_output=True, cwd=ROOT, env=env)
        return json.loads((out / "results.json").read_text())

    at_constant_rate = cli(constant, 4)
    reference = cli(decayed, 4, *decay)
    first_two = cli(extended, 2)["rounds"]

    # Execute: the finished 2-round run, resumed to 4 rounds with the decay from round 3
    results = cli(extended, 4, "--resume", str(extended), *decay)

    # Assert: rounds 1-2 restored, not run again (their measured times are the 2-round run's);
    # every round as in the 4-round run with the decay (the clients sampled included), the same
    # adapters; and the decay acted (rounds 3-4 differ from the constant rate's, rounds 1-2 not)
    assert [r["round"] for r in results["rounds"]] == [1, 2, 3, 4]
    assert [r["seconds"] for r in results["rounds"][:2]] == [r["seconds"] for r in first_two]
    assert_close(_rounds(results), _rounds(reference), "rounds")
    expected, actual = _adapters(decayed), _adapters(extended)
    assert expected and expected.keys() == actual.keys()
    for name, tensors in expected.items():
        for key, value in tensors.items():
            np.testing.assert_allclose(actual[name][key], value, atol=1e-6, err_msg=f"{name} {key}")
    losses = [[r["train_loss"] for r in run["rounds"]] for run in (results, at_constant_rate)]
    assert losses[0][:2] == pytest.approx(losses[1][:2], abs=1e-9)
    assert all(abs(a - b) > 1e-6 for a, b in zip(losses[0][2:], losses[1][2:], strict=True)), losses


def test_the_learning_rate_decays_from_each_listed_round_and_bad_schedules_are_one_line():
    train = load_config(SMOKE, ["train.lr=0.001", "train.lr_decay_rounds=[3, 5]"]).train
    assert [train.lr_at(r) for r in range(1, 7)] == pytest.approx([1e-3, 1e-3, 5e-4, 5e-4, 2.5e-4, 2.5e-4])
    assert load_config(SMOKE, ["train.lr_decay_factor=0.1", "train.lr_decay_rounds=[2]"]).train.lr_at(2) == \
        pytest.approx(1e-4)  # smoke's lr 1e-3 x 0.1
    for bad in ("[5, 3]", "[0]", "[2, 2]"):
        with pytest.raises(ConfigError, match="lr_decay_rounds"):
            load_config(SMOKE, [f"train.lr_decay_rounds={bad}"])


def test_a_resume_may_add_a_decay_only_after_the_checkpointed_round(tmp_path):
    # Prepare: a checkpoint after round 2 of a run at a constant rate
    save_server(tmp_path, 2, load_config(SMOKE), {}, [RoundRecord(round=1), RoundRecord(round=2)])
    # Execute / Assert: a decay from round 3 on leaves rounds 1-2 as they ran; one from round 2 does not
    assert load_server(tmp_path, load_config(SMOKE, ["train.rounds=4", "train.lr_decay_rounds=[3]"]))["round"] == 2
    with pytest.raises(ConfigError, match="lr_decay_rounds"):
        load_server(tmp_path, load_config(SMOKE, ["train.rounds=4", "train.lr_decay_rounds=[2]"]))

class _Interrupted(Exception):
    """Stands in for a crash of the server process."""


def _grid(config, id_offset: int, crash_round: int = 0):
    """An in-process grid with its own node ids (Flower's are random per run), optionally
    'crashing' when the training messages of ``crash_round`` are sent."""
    from flwr.app import MessageType

    from fedlora.clients.app import app as client_app
    from fedlora.simulations.inprocess import InProcessGrid, node_configs

    class Grid(InProcessGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if crash_round and any(m.metadata.message_type == MessageType.TRAIN
                                   and int(m.content["config"]["server-round"]) == crash_round for m in messages):
                raise _Interrupted(crash_round)
            return super().send_and_receive(messages, timeout=timeout)

    return renumber_nodes(Grid(client_app, node_configs(config.data.num_clients)), id_offset)


def _all_strategies() -> list[str]:
    from fedlora.strategies.registry import strategy_names

    return strategy_names()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", _all_strategies())
def test_every_strategy_resumes_with_new_node_ids(tmp_path, strategy):
    from fedlora.app.server import run_server

    # Prepare: the reference run, and a run that stops when round 3's training is sent
    config = load_config(SMOKE, [f"strategy.name={strategy}", "train.rounds=3", "train.max_steps=2",
                                 *short_run_overrides(strategy)])
    reference, resumed = tmp_path / "a" / "run", tmp_path / "b" / "run"  # paths of one length: they travel in messages
    run_server(_grid(config, 1000), config, reference)
    with pytest.raises(_Interrupted):
        run_server(_grid(config, 2000, crash_round=3), config, resumed)

    # Execute: resume with other node ids and empty client states
    run_server(_grid(config, 7_000_000_000), config, resumed, resume=True)

    # Assert: same metrics, same adapters
    import json

    ref_results = json.loads((reference / "results.json").read_text())
    res_results = json.loads((resumed / "results.json").read_text())
    assert_close(_rounds(res_results), _rounds(ref_results), "rounds")
    _assert_wire_close(res_results, ref_results)
    assert [r["per_client"].keys() for r in res_results["rounds"]] == [r["per_client"].keys() for r in ref_results["rounds"]]
    ref_adapters, res_adapters = _adapters(reference), _adapters(resumed)
    assert ref_adapters.keys() == res_adapters.keys()
    for name, tensors in ref_adapters.items():
        for key, value in tensors.items():
            np.testing.assert_allclose(res_adapters[name][key], value, atol=1e-6, err_msg=f"{name} {key}")


@pytest.mark.slow
def test_dp_run_resumes_with_the_same_epsilon_and_adapters(tmp_path):
    import json

    from fedlora.app.server import run_server

    # Prepare: a DP run (accountant history in the client state) and its interrupted twin; the noise
    # is seeded from the config (research mode) so that the two runs can be compared at all
    config = load_config(SMOKE, ["strategy.name=fedsa_lora", "train.rounds=3", "train.max_steps=2",
                                 "privacy.dp=true", "privacy.target_epsilon=5", "privacy.reproducible_noise=true"])
    reference, resumed = tmp_path / "a" / "run", tmp_path / "b" / "run"  # paths of one length: they travel in messages
    run_server(_grid(config, 1000), config, reference)
    with pytest.raises(_Interrupted):
        run_server(_grid(config, 2000, crash_round=3), config, resumed)

    # Execute
    run_server(_grid(config, 5000), config, resumed, resume=True)

    # Assert: the resumed clients' accountants continued (same epsilon), same adapters
    ref, res = (json.loads((d / "results.json").read_text()) for d in (reference, resumed))
    assert res["privacy"] == ref["privacy"]
    assert res["privacy"]["epsilon"] <= 5.0
    assert [r["extra"] for r in res["rounds"]] == [r["extra"] for r in ref["rounds"]]
    for name, tensors in _adapters(reference).items():
        for key, value in tensors.items():
            np.testing.assert_allclose(_adapters(resumed)[name][key], value, atol=1e-6, err_msg=f"{name} {key}")


# ------------------------------------------------------------------------------ verified checkpoints
TAMPER_ROUNDS = ["train.rounds=2", "train.max_steps=1"]


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run folder: two in-process rounds of the smoke config (server checkpoint of round 2,
    every client's state file); each test copies it."""
    from fedlora.app.runner import run_inprocess

    folder = tmp_path_factory.mktemp("checkpointed") / "run"
    run_inprocess(load_config(SMOKE, TAMPER_ROUNDS), folder)
    return folder


def _copy(run: Path, tmp_path: Path) -> Path:
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` with its bytes (a refusal must leave them as they were)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _blob(run: Path) -> dict:
    import json

    return json.loads((checkpoint_dir(run) / "server.json").read_text())


def _write_signed(run: Path, blob: dict) -> None:
    """Write ``blob`` as server.json with a digest that matches it and a manifest that matches the
    files: a crafted checkpoint, which only the structural checks can refuse."""
    import json

    from fedlora.checkpoint import blob_digest, sha256_file

    folder = checkpoint_dir(run)
    blob["manifest"] = {name: sha256_file(folder / name) for name in blob["manifest"] if (folder / name).is_file()}
    blob["digest"] = blob_digest(json.loads(json.dumps({k: v for k, v in blob.items() if k != "digest"})))
    (folder / "server.json").write_text(json.dumps(blob))


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0x01
    path.write_bytes(bytes(data))


def _nan_arrays(run: Path) -> None:
    from safetensors.numpy import load_file, save_file

    path = checkpoint_dir(run) / _blob(run)["arrays"]
    arrays = load_file(str(path))
    save_file({k: np.full_like(v, np.nan) if v.dtype.kind == "f" else v for k, v in arrays.items()}, str(path))


def _resigned(edit):
    def tamper(run: Path) -> None:
        blob = _blob(run)
        edit(blob)
        _write_signed(run, blob)
    return tamper


def _set_round_field(blob: dict, field: str, value) -> None:
    """Set ``field`` of the first round record in the stored structure."""
    records = blob["state"]["__dict__"]
    rounds = next(v for k, v in records if k == "rounds")
    rounds[0]["fields"][field] = value


def _strategy_entries(blob: dict) -> list:
    return next(v for k, v in blob["state"]["__dict__"] if k == "strategy")["__dict__"]


def _deep(depth: int):
    value: object = 0
    for _ in range(depth):
        value = [value]
    return value


def _nan_client_state(run: Path) -> None:
    from flwr.app import Array, ArrayRecord
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict

    path = next((checkpoint_dir(run) / "clients").rglob("round_2.bin"))
    proto = ProtoRecordDict()
    proto.ParseFromString(path.read_bytes())
    state = recorddict_from_proto(proto)
    key = next(iter(state.array_records))
    state[key] = ArrayRecord({name: Array(np.full_like(a.numpy(), np.nan)) for name, a in state[key].items()})
    path.write_bytes(recorddict_to_proto(state).SerializeToString())
    _write_signed(run, _blob(run))


def _claim_round(run: Path, server_round: int) -> None:
    """A checkpoint that says it completed ``server_round`` (its arrays file renamed to match) while
    its round records stop at round 2."""
    folder, blob = checkpoint_dir(run), _blob(run)
    name = f"server-{server_round}.safetensors"
    (folder / blob["arrays"]).rename(folder / name)
    blob["manifest"] = {(name if k == blob["arrays"] else k): v for k, v in blob["manifest"].items()}
    blob.update(round=server_round, arrays=name)
    _write_signed(run, blob)


def _unlisted_client_state(run: Path) -> None:
    """A state file for partition 9 that no checkpoint listed (a resume would restore it)."""
    clients = checkpoint_dir(run) / "clients"
    (clients / "9").mkdir()
    (clients / "9" / "round_1.bin").write_bytes((clients / "0" / "round_2.bin").read_bytes())


# (case, tamper the copied run folder, what the one line must say)
TAMPERS = [
    ("flipped-byte-in-arrays", lambda run: _flip_byte(checkpoint_dir(run) / _blob(run)["arrays"], -5),
     "does not match its sha256 in the manifest"),
    ("flipped-byte-in-json", lambda run: _flip_byte(checkpoint_dir(run) / "server.json", 4000),
     "checkpoint"),
    ("flipped-byte-in-client-state", lambda run: _flip_byte(next((checkpoint_dir(run) / "clients").rglob("*.bin")), -3),
     "does not match its sha256 in the manifest"),
    ("nan-arrays", _nan_arrays, "does not match its sha256"),
    ("nan-arrays-manifest-rehashed", lambda run: (_nan_arrays(run), _write_signed(run, _blob(run))),
     "holds NaN or inf values"),
    ("nan-client-state-manifest-rehashed", _nan_client_state, "is not finite numbers"),
    ("edited-json", lambda run: (checkpoint_dir(run) / "server.json").write_text(
        (checkpoint_dir(run) / "server.json").read_text().replace('"round": 2', '"round": -1', 1)),
     "was changed after it was written"),
    ("negative-round", _resigned(lambda blob: blob.update(round=-1)), "round -1"),
    ("round-records-inconsistent", lambda run: _claim_round(run, 3), "not 1..3"),
    ("round-record-negative-count", _resigned(lambda blob: _set_round_field(blob, "clients", -3)), "not a count >= 0"),
    ("round-record-accuracy-out-of-range", _resigned(lambda blob: _set_round_field(blob, "global_accuracy", 7.5)),
     "outside [0, 1]"),
    ("round-record-string-for-number", _resigned(lambda blob: _set_round_field(blob, "train_loss", "x")),
     "not a finite number"),
    ("partition-that-does-not-exist", _resigned(lambda blob: blob.update(partitions=[0, 1, 2, 7])),
     "names partitions [7]"),
    ("nesting-too-deep", _resigned(lambda blob: _strategy_entries(blob).append(["deep", _deep(200)])),
     "nests deeper than"),
    ("unknown-type", _resigned(lambda blob: _set_round_field(blob, "extra", {"__object__": "os:system", "fields": {}})),
     "unknown type 'os:system'"),
    ("arrays-outside-folder", _resigned(lambda blob: blob.update(arrays="../../x.safetensors")),
     "is not server-2.safetensors"),
    ("pickle-era-format", _resigned(lambda blob: blob.update(format=1)), "format 1, expected 3"),
    ("unlisted-client-state", lambda run: _unlisted_client_state(run), "is not in the checkpoint's manifest"),
]


@pytest.mark.parametrize(("case", "tamper", "message"), TAMPERS, ids=[t[0] for t in TAMPERS])
def test_a_tampered_checkpoint_is_refused_and_left_as_it_was(checkpointed_run: Path, tmp_path: Path, case: str,
                                                             tamper, message: str) -> None:
    # Prepare: a copy of a real two-round checkpoint, tampered with
    run = _copy(checkpointed_run, tmp_path)
    tamper(run)
    before = _tree(run)
    # Execute / Assert: the library refuses with one line, naming what is wrong, and changes nothing
    with pytest.raises(ConfigError) as error:
        load_server(run, load_config(SMOKE, TAMPER_ROUNDS))
    assert message in str(error.value) and "\n" not in str(error.value), str(error.value)
    assert _tree(run) == before


def test_an_intact_checkpoint_verifies_and_lists_every_file_it_restores(checkpointed_run: Path) -> None:
    # Execute
    saved = load_server(checkpointed_run, load_config(SMOKE, TAMPER_ROUNDS))
    blob = _blob(checkpointed_run)
    # Assert: the arrays and every client's newest state are in the manifest, with their sha256
    import hashlib

    folder = checkpoint_dir(checkpointed_run)
    assert saved["round"] == 2 and [r.round for r in saved["rounds"]] == [1, 2]
    assert sorted(blob["manifest"]) == ["clients/0/round_2.bin", "clients/1/round_2.bin", "clients/2/round_2.bin",
                                        "server-2.safetensors"]
    for name, digest in blob["manifest"].items():
        assert hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest


@pytest.mark.parametrize(
    ("case", "tamper", "message"),
    [
        ("flipped-byte-in-arrays", TAMPERS[0][1], "does not match its sha256"),
        ("nan-arrays-manifest-rehashed", TAMPERS[4][1], "holds NaN or inf values"),
        ("edited-json", TAMPERS[6][1], "was changed after it was written"),
        ("negative-round", TAMPERS[7][1], "round -1"),
        # found once the strategy is built: an attribute it does not have, an attribute of another kind
        ("unknown-strategy-attribute", _resigned(lambda blob: _strategy_entries(blob).append(["aggregate", 1])),
         "attributes ['aggregate'] this strategy does not have"),
        ("strategy-attribute-of-another-kind", _resigned(lambda blob: [e.__setitem__(1, "not a generator")
                                                                       for e in _strategy_entries(blob) if e[0] == "rng"]),
         "'rng' is a str"),
    ],
    ids=["flipped-byte-in-arrays", "nan-arrays-manifest-rehashed", "edited-json", "negative-round",
         "unknown-strategy-attribute", "strategy-attribute-of-another-kind"],
)
def test_cli_resume_of_a_tampered_checkpoint_is_one_line_exit_2_and_changes_nothing(
        checkpointed_run: Path, tmp_path: Path, case: str, tamper, message: str) -> None:
    # Prepare
    run = _copy(checkpointed_run, tmp_path)
    tamper(run)
    before = _tree(run)
    # Execute
    proc = subprocess.run(_cmd(run, "fedit", "--resume", str(run), "--set", "train.max_steps=1"),
                          check=False, capture_output=True, text=True, cwd=ROOT)
    # Assert
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and message in lines[0], proc.stderr[-2000:]
    assert _tree(run) == before


def test_checkpoint_files_hold_json_and_safetensors_only(checkpointed_run: Path) -> None:
    # Execute
    folder = checkpoint_dir(checkpointed_run)
    # Assert: no pickle anywhere in the server checkpoint; client states are Flower protobuf
    names = sorted(p.name for p in folder.iterdir() if p.is_file())
    assert names == ["server-2.safetensors", "server.json"]
    assert not any(b"\x80\x04" in p.read_bytes()[:2] for p in folder.rglob("*") if p.is_file())


def test_a_corrupt_or_foreign_checkpoint_is_one_line_and_never_runs_code(checkpointed_run: Path, tmp_path: Path) -> None:
    # Prepare: a crafted checkpoint (consistent digest and manifest) naming a type outside the allow-list
    run = _copy(checkpointed_run, tmp_path)
    _resigned(lambda blob: _set_round_field(blob, "extra", {"__object__": "os:system", "fields": {"command": "x"}}))(run)
    # Execute / Assert: refused before any constructor is looked up by name
    with pytest.raises(ConfigError, match="unknown type 'os:system'"):
        load_server(run, load_config(SMOKE, TAMPER_ROUNDS))


def test_a_checkpoint_with_a_retired_strategy_attribute_resumes_without_it() -> None:
    """A checkpoint written before a method stopped keeping an attribute (FedTreeLoRA's ``pushed_B``,
    now carried by each upload's download) resumes: the retired attribute is dropped, any other
    unknown one is still refused."""
    from fedlora.checkpoint import CheckpointError, check_strategy_state
    from fedlora.strategies.fedtreelora import FedTreeLoRA

    fresh = {"records": {}, "rebuilt": False}
    saved = {"records": {}, "rebuilt": True, "pushed_B": {0: {}}}
    assert check_strategy_state(saved, fresh, "--resume x", FedTreeLoRA.RETIRED_STATE) == {"records": {}, "rebuilt": True}
    with pytest.raises(CheckpointError, match=r"attributes \['pushed_B'\] this strategy does not have"):
        check_strategy_state(saved, fresh, "--resume x")
