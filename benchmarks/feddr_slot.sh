#!/usr/bin/env bash
# The README comparison in one lock slot (run as: flock /tmp/fedlora-cpu.lock bash benchmarks/feddr_slot.sh).
cd "$(dirname "$0")/.." || exit 1
. .venv/bin/activate
( time python benchmarks/compare_feddr.py --seeds 0 ) > /tmp/feddr_cmp.log 2>&1
