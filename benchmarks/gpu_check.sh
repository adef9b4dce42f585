#!/usr/bin/env bash
# GPU check: a 2-client quickstart on a CUDA machine (bf16 autocast), then samples per second.
# Usage (from the repo root, after `make install`): bash benchmarks/gpu_check.sh [extra --set ...]
# Prints: device name, then `samples_per_second=<x> client_train_seconds=<y> final_global_accuracy=<z>`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
OUT=${OUT_DIR:-runs/gpu_check}
$PY -c "import torch, sys; ok = torch.cuda.is_available(); print('cuda:', torch.cuda.get_device_name(0) if ok else 'none'); sys.exit(0 if ok else 3)" \
  || { echo "error: no CUDA device visible to torch" >&2; exit 3; }
$PY -m fedlora.app.cli run configs/quickstart.toml --out "$OUT" \
  --set train.device=cuda --set data.num_clients=2 --set federation.fraction_train=1.0 \
  --set federation.fraction_evaluate=1.0 --set federation.num_gpus=0.5 --set train.max_steps=50 "$@"
$PY - "$OUT" <<'PYEOF'
import json, sys
results = json.load(open(f"{sys.argv[1]}/results.json"))
examples = sum(r["train_examples"] for r in results["rounds"])
seconds = sum(r["client_train_seconds"] for r in results["rounds"])
print(f"samples_per_second={examples / seconds:.1f} client_train_seconds={seconds:.1f} "
      f"final_global_accuracy={results['final']['global_accuracy']:.4f}")
PYEOF
