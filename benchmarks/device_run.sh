#!/usr/bin/env bash
# One device call: environment, GPU test subset, sweeps. Usage on the device machine:
#   bash benchmarks/device_run.sh "<pytest -k expr or empty>" "<sweeps>"
set -u
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
if [ -n "${1:-}" ]; then
  timeout 300 python -m pytest tests -q -n 8 --ignore=tests/vllm -p no:cacheprovider -k "$1" 2>&1 | tail -15 | tee "$OUT/pytest.txt"
fi
if [ -n "${2:-}" ]; then
  timeout "${SWEEP_TIMEOUT:-420}" python benchmarks/tune.py --out "$OUT/tune.json" --only "$2" > "$OUT/tune.txt" 2>&1
  echo "tune rc=$?"
  grep -v "^ *File\|^Traceback" "$OUT/tune.txt" | tail -60
fi
