#!/usr/bin/env bash
# GPU checks of issue 9, sections 3-4 and 7 (tests/test_contract.py and the tests they touch), on
# the device machine from the repository root:  bash benchmarks/contract_gpu.sh
# Logs under $OUT; the summary table last.
set -u
export PYTHONPATH=$PWD/src
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
XDIST=$(python -c "import xdist" 2>/dev/null && echo "-n 4")
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/env.txt"
run() {  # name, timeout, pytest args...
  local name=$1 limit=$2
  shift 2
  timeout "$limit" python -m pytest -q -p no:cacheprovider -rfE "$@" > "$OUT/$name.txt" 2>&1
  echo "$name $?" >> "$OUT/summary.txt"
}
: > "$OUT/summary.txt"
# graph replay with new inputs, no host sync, 64-bit workspaces and caches, wrap guard, strides
run contract 420 $XDIST tests/test_contract.py -k "not head_major"
# validation (bf16 q accepted on the GPU), block tables without idx-ahead, 129/136 heads
run touched 300 $XDIST tests/test_validation.py tests/test_sparse_mla.py \
  -k "not test_sparse_mla or block_table or more_than_128"
# head-major q / out views past 2^31 elements: alone and last, since a wrapped address may
# fault the CUDA context (fails until kernels.py forms head offsets in int64)
run head_major 180 tests/test_contract.py -k head_major
# GB10 (cuda 121) and every other target with this Triton
run compile 420 tests/test_compile.py  # its fixture spreads the compiles itself
for f in contract touched head_major compile; do
  echo "== $f"; grep -E "passed|failed|error" "$OUT/$f.txt" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/$f.txt" | head -20
done
echo "== summary (name, pytest exit status)"
cat "$OUT/summary.txt"
