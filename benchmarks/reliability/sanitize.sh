#!/usr/bin/env bash
# The sanitize suite of benchmarks/reliability/reliability.py under one compute-sanitizer tool, in
# parallel shards (docs/RELIABILITY.md). From the repository root on a GPU machine, with the
# package installed:
#
#   bash benchmarks/reliability/sanitize.sh memcheck|racecheck|initcheck|synccheck [SHARDS] [--out DIR] [ARGS...]
#
# 1. compiles every selected variant without the sanitizer (COMPILE_JOBS processes, default 16)
#    into TRITON_CACHE_DIR (default /tmp/triton-reliability-cache), so the sanitized runs only load;
# 2. runs SHARDS (default 8) sanitized processes side by side, each on every SHARDS-th case;
# 3. prints each shard's sanitizer summary, the findings grouped by source line (findings.py)
#    and the combined table of checks.
# ARGS go to reliability.py (e.g. --only fp8 --max-cases 100). Logs in DIR (default
# ./out/sanitize-<tool>): compile.txt, <tool>-<k>.txt (cases), <tool>-<k>.sanitizer.txt (the
# tool's report), <tool>-<k>.json. Exit status 0 only if every shard exits 0 (9: the tool found
# errors; 1: a check failed). A PYTHONPATH set by the caller is kept (e.g. another Triton first).
# PRINT_LIMIT (default 50): the errors each shard's report prints in full.
set -u
TOOL=${1:?usage: sanitize.sh memcheck|racecheck|initcheck|synccheck [SHARDS] [--out DIR] [ARGS...]}
shift
SHARDS=8
if [ $# -gt 0 ] && [[ $1 =~ ^[0-9]+$ ]]; then
  SHARDS=$1
  shift
fi
LOGS=""
ARGS=()
while [ $# -gt 0 ]; do
  case $1 in
    --out) LOGS=${2:?--out needs a directory}; shift 2 ;;
    --out=*) LOGS=${1#--out=}; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
[ -n "$LOGS" ] && mkdir -p "$LOGS" && LOGS=$(cd "$LOGS" && pwd)  # absolute before the cd below
cd "$(dirname "$0")/../.." || exit 2
LOGS=${LOGS:-$PWD/out/sanitize-$TOOL}
mkdir -p "$LOGS"
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-reliability-cache}
PY=${PYTHON:-python}
SCRIPT=benchmarks/reliability/reliability.py
SAN=${COMPUTE_SANITIZER:-$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | tail -1)}
if [ ! -x "$SAN" ]; then
  echo "compute-sanitizer not found: set COMPUTE_SANITIZER=/path/to/compute-sanitizer"
  exit 2
fi
# Only the project's kernels are instrumented, except for initcheck: it must see PyTorch's fills
# and copies initialise the buffers the kernels read. SANITIZER_FILTER="" instruments everything.
KERNELS="--kernel-name kns=sparse_mla"
case $TOOL in
  memcheck) FLAGS=(--tool memcheck --leak-check no) ;;
  racecheck) FLAGS=(--tool racecheck --racecheck-report all) ;;
  initcheck) FLAGS=(--tool initcheck) KERNELS="" ;;
  synccheck) FLAGS=(--tool synccheck) ;;
  *) echo "unknown tool: $TOOL"; exit 2 ;;
esac
FILTER=${SANITIZER_FILTER-$KERNELS}
"$SAN" --version | tail -1
echo "logs: $LOGS"
t0=$(date +%s)
echo "== compile every selected variant (no sanitizer, ${COMPILE_JOBS:-16} processes)"
if ! "$PY" "$SCRIPT" --suite sanitize --compile-only --jobs "${COMPILE_JOBS:-16}" \
    --log "$LOGS/compile.json" ${ARGS[@]+"${ARGS[@]}"} > "$LOGS/compile.txt" 2>&1; then
  tail -40 "$LOGS/compile.txt"
  echo "compile step failed (log $LOGS/compile.txt)"
  exit 1
fi
tail -2 "$LOGS/compile.txt"
echo "compiled in $(( $(date +%s) - t0 ))s"
t1=$(date +%s)
echo "== $TOOL: $SHARDS shards"
rm -f "$LOGS/$TOOL"-*.txt "$LOGS/$TOOL"-*.json  # an earlier run's shards, in the same DIR
pids=()
for k in $(seq 0 $((SHARDS - 1))); do
  # shellcheck disable=SC2086
  "$SAN" "${FLAGS[@]}" $FILTER --error-exitcode 9 --print-limit "${PRINT_LIMIT:-50}" \
    --log-file "$LOGS/$TOOL-$k.sanitizer.txt" \
    "$PY" "$SCRIPT" --suite sanitize --shard "$k/$SHARDS" \
    --log "$LOGS/$TOOL-$k.json" ${ARGS[@]+"${ARGS[@]}"} > "$LOGS/$TOOL-$k.txt" 2>&1 &
  pids+=($!)
done
rc=0
for k in $(seq 0 $((SHARDS - 1))); do
  wait "${pids[$k]}"
  r=$?
  [ "$r" -ne 0 ] && rc=1
  summary=$(grep -h "ERROR SUMMARY\|RACECHECK SUMMARY" "$LOGS/$TOOL-$k.sanitizer.txt" 2>/dev/null | tr '\n' ' ')
  echo "shard $k: exit $r after $(( $(date +%s) - t1 ))s; ${summary:-no sanitizer summary}; $(grep -h '^RESULT' "$LOGS/$TOOL-$k.txt")"
done
reports=("$LOGS/$TOOL"-*.sanitizer.txt)
[ -e "${reports[0]}" ] && "$PY" benchmarks/reliability/findings.py "${reports[@]}"
"$PY" "$SCRIPT" --merge "$LOGS"/"$TOOL"-*.json || rc=1
echo "$TOOL: $SHARDS shards in $(( $(date +%s) - t1 ))s (compile $(( t1 - t0 ))s); exit $rc"
exit $rc
