#!/usr/bin/env bash
# One lock slot: the FedDR-LoRA Ray smoke run (diagnosis, 240 s cap), then the README comparison.
cd "$(dirname "$0")/.." || exit 1
. .venv/bin/activate
rm -rf /tmp/feddr_ray_run
( time timeout 240 fedlora run configs/smoke.toml --out /tmp/feddr_ray_run --set strategy.name=feddr_lora \
    --set data.label_noise=symmetric --set data.noise_rate=0.4 --set "clients.ranks=[4, 4, 4]" ) > /tmp/feddr_ray_run.log 2>&1
echo "ray rc=$?" >> /tmp/feddr_ray_run.log
rm -rf runs/feddr_lora/compare
( time python benchmarks/compare_feddr.py --seeds 0 ) > /tmp/feddr_cmp.log 2>&1
