"""A Flower user's own ServerApp: a fedlora strategy run by Flower's ``Strategy.start`` loop,
with fedlora's ClientApp (``fedlora.clients.app:app``) on the SuperNodes.

The strategy is built from keywords (no fedlora experiment file): the method's options (here
HetLoRA's ``weighting``), Flower's sampling settings, and the experiment sections the clients
read from every message (model, data, local training, per-client ranks). ``start`` returns
Flower's ``Result``: ``result.arrays`` is the final global model (HetLoRA's rank-r_max LoRA
factors and head), the metrics are the clients' training loss and personalised accuracy.

Run it with ``flwr run`` on a local simulation federation of 3 SuperNodes (docs/flower.md)::

    export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1   # this environment: fedlora installed
    flwr run examples/flower_serverapp --stream --federation-config "num-supernodes=3" \
      --run-config "num-server-rounds=2 out-dir=\"$PWD/runs/flower\""
"""

from __future__ import annotations

from logging import INFO, getLogger
from pathlib import Path

from flwr.app import ArrayRecord, Context, UserConfig
from flwr.serverapp import Grid, ServerApp
from safetensors.torch import save_file

from fedlora.strategies.hetlora import HetLoRA

log = getLogger("flwr").log  # Flower's logger, by its name: what `flwr log` and the run log show

app = ServerApp()


def build_strategy(cfg: UserConfig) -> HetLoRA:
    """HetLoRA from keywords and this app's run config (``[tool.flwr.app.config]``)."""
    return HetLoRA(
        weighting="norm",  # HetLoRA's own option (fedlora/methods/hetlora.py)
        fraction_train=float(cfg["fraction-train"]),
        fraction_evaluate=float(cfg["fraction-evaluate"]),
        min_train_nodes=int(cfg["min-train-nodes"]),
        min_available_nodes=int(cfg["num-clients"]),
        model={"path": str(cfg["model"]), "lora_rank": 4, "lora_alpha": 8},
        data={"source": "wordnet", "task": "noun8", "num_clients": int(cfg["num-clients"]),
              "max_examples": 600, "global_test_size": 100},
        train={"max_steps": 5, "batch_size": 16, "lr": 1e-3, "max_length": 32},
        clients={"ranks": [2, 4, 8]},  # each client's LoRA rank (a silo's node config may override it)
    )


@app.main()
def main(grid: Grid, context: Context) -> None:
    cfg = context.run_config
    strategy = build_strategy(cfg)
    # An empty ArrayRecord starts from the common seeded initial adapter (its rank r_max is the
    # largest client rank, which the strategy learns from the clients' profiles in round 1).
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(), num_rounds=int(cfg["num-server-rounds"]))

    out = str(cfg.get("out-dir", ""))
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        # safetensors, not torch.save: a pickle-free file anyone can load safely
        save_file(result.arrays.to_torch_state_dict(), str(Path(out) / "final_model.safetensors"))
        log(INFO, "saved the final global model (%d arrays) to %s", len(result.arrays),
            Path(out) / "final_model.safetensors")
