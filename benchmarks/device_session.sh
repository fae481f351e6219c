#!/usr/bin/env bash
# The H200 checks of one session, in three device calls (each under the 10-minute call limit):
#
#   bash benchmarks/device_session.sh sanitize   # Triton 3.6: memcheck, initcheck, racecheck, graphs
#   bash benchmarks/device_session.sh t38        # Triton 3.8 (vLLM's pin): fp8 hazard, indexer
#   bash benchmarks/device_session.sh rest       # Triton 3.6: sm80/86/89 by PTX JIT, glue, peers
#
# The complete procedure (docs/RELIABILITY.md), one call each, roughly 90 min of device time
# (three 30-minute session budgets): full memcheck 0|1, full initcheck 0, full racecheck 0..3,
# graph, emulate 80 0|1, emulate 86 0|1, emulate 89 0|1.
#
# Triton 3.8 travels as two ignored parts (.t38/part_aa, .t38/part_ab: its wheel's triton/ less
# cupti, libproton, ptxas-blackwell and the AMD backend, tar.xz, split): the sanitize call carries
# part 1 and copies it to /tmp, the t38 call carries part 2 and unpacks both to /tmp/t38.
# FlashMLA (rest) comes from .fmla/ (vLLM 0.33's _flashmla_C.abi3.so and its interface).
# Both are built here by benchmarks/prepare_device_carry.sh.
# Full logs: one tarball per phase under $OUT; each step's exit status and seconds last.
set -u
PHASE=${1:?usage: device_session.sh sanitize|memcheck|t38|rest|full TOOL K|graph|emulate}
cd "$(dirname "$0")/.." || exit 2
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/out}
L=/tmp/logs/$PHASE${2:+-$2}${3:+-$3}
mkdir -p "$L" "$FINAL"
: > "$L/steps.txt"
export OUT=$L  # every tool's own logs go into this phase's tarball

step() {  # name, seconds, command...: logs to $L/name.txt, one status line
  local name=$1 limit=$2 t0 rc
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" > "$L/$name.txt" 2>&1
  rc=$?
  echo "$name rc=$rc $(($(date +%s) - t0))s" | tee -a "$L/steps.txt"
}

san() {  # tool, seconds, extra reliability.py args...
  local tool=$1 limit=$2
  shift 2
  OUT=$L/$tool step "$tool" "$limit" bash benchmarks/reliability_sanitize.sh "$tool" 16 "$@"
}

# prefix of a command under Triton 3.8 (an env command, so that `timeout` can run it)
T38=(env PYTHONPATH=/tmp/t38:$PWD/src TRITON_BACKENDS_IN_TREE=1 TRITON_CACHE_DIR=/tmp/tcache38)

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$L/env.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$L/env.txt"

case $PHASE in
  sanitize)
    # the first call of this session; the compile step alone took 232 s of a 240 s limit
    [ -f .t38/part_aa ] && cp .t38/part_aa /tmp/part_aa
    san memcheck 240
    san initcheck 70 --max-cases 300
    san racecheck 70 --max-cases 150
    step graph 100 python benchmarks/reliability.py --suite graph --jobs 8 --log "$L/graph.json"
    for t in memcheck initcheck racecheck; do
      echo "== $t"
      grep -h "SUMMARY" "$L/$t"/*.sanitizer.txt 2>/dev/null | sort | uniq -c
      tail -4 "$L/$t.txt"
    done
    echo "== graph"; tail -6 "$L/graph.txt"
    ;;
  memcheck)
    # memcheck over every sm90 variant: 166-232 s of compiles on 16 cores, then the sanitized
    # runs (790 of 1003 cases fitted in the other 234 s: give it a call of its own next time)
    [ -f .t38/part_aa ] && cp .t38/part_aa /tmp/part_aa
    san memcheck 400
    san initcheck 45 --max-cases 300
    for t in memcheck initcheck; do
      echo "== $t"
      grep -h "SUMMARY" "$L/$t"/*.sanitizer.txt 2>/dev/null | sort | uniq -c
      grep -h "Invalid\|Uninitialized\|error" "$L/$t"/*.sanitizer.txt 2>/dev/null | head -5
      tail -4 "$L/$t.txt"
    done
    ;;
  t38)
    step unpack 90 bash -c 'cat /tmp/part_aa .t38/part_ab > /tmp/t38.tar.xz && mkdir -p /tmp/t38 && tar xJf /tmp/t38.tar.xz -C /tmp/t38'
    "${T38[@]}" python -c "import triton; print('unpacked triton', triton.__version__, triton.__file__)" | tee -a "$L/env.txt"
    step hazard38 75 "${T38[@]}" compute-sanitizer --tool memcheck python benchmarks/fp8_hazard.py --json "$L/hazard38.json"
    OUT=$L/indexer38 step indexer38 180 "${T38[@]}" python benchmarks/indexer_gpu.py --skip-tests
    step emulate80 50 python benchmarks/reliability.py --suite emulate --arch 80 --jobs 16 \
      --max-cases 60 --log "$L/emulate80.json"
    OUT=$L/ixemu step indexer_emulate 60 python benchmarks/indexer_emulate.py
    echo "== hazard (Triton 3.8, memcheck)"; tail -8 "$L/hazard38.txt" | cut -c1-160
    echo "== indexer (Triton 3.8)"; tail -40 "$L/indexer38.txt"
    echo "== emulate sm80 (Triton 3.6)"; tail -6 "$L/emulate80.txt"
    echo "== indexer emulate (Triton 3.6)"; tail -8 "$L/indexer_emulate.txt" | cut -c1-200
    ;;
  rest)
    for cc in 80 86 89; do
      step "emulate$cc" 60 python benchmarks/reliability.py --suite emulate --arch "$cc" --jobs 16 \
        --max-cases 120 --log "$L/emulate$cc.json"
    done
    OUT=$L/ixemu step indexer_emulate 90 python benchmarks/indexer_emulate.py
    step contract 45 python -m pytest -q -p no:cacheprovider tests/test_contract.py -k "head_major or strided"
    step index_q 30 python -m pytest -q -p no:cacheprovider tests/test_index_q.py tests/test_mla_cache.py
    PYTHONPATH=$PWD/src:$PWD/.fmla step flashmla 45 python benchmarks/flashmla_smoke.py --out "$L"
    for f in emulate80 emulate86 emulate89 indexer_emulate contract index_q flashmla; do
      echo "== $f"; tail -5 "$L/$f.txt" | cut -c1-200
    done
    ;;
  full)
    # The whole sanitize suite over device calls, one slice a call: PART K of the 1043 sm90 cases
    # in coverage order (memcheck 0-1 and initcheck 0: ~520 cases each; racecheck 0-3: ~260).
    # Estimated from the last runs (compiles ~200 s on a fresh machine, cached after; memcheck
    # ~2 cases/s, initcheck ~2.3/s, racecheck ~0.65/s on 16 shards): ~60 min of device time for
    # the three tools; graph and emulate (phases of their own) add ~30 min.
    TOOL=${2:?usage: device_session.sh full memcheck|initcheck|racecheck K}
    K=${3:?part index}
    N=$([ "$TOOL" = racecheck ] && echo 261 || echo 522)
    san "$TOOL" 570 --skip-cases $((K * N)) --max-cases "$N"
    echo "== $TOOL part $K (cases $((K * N))-$((K * N + N - 1)))"
    grep -h "SUMMARY" "$L/$TOOL"/*.sanitizer.txt 2>/dev/null | sort | uniq -c
    grep -h "Invalid\|Uninitialized\|Race\|error" "$L/$TOOL"/*.sanitizer.txt 2>/dev/null | head -5
    tail -4 "$L/$TOOL.txt"
    ;;
  graph)
    step graph 570 python benchmarks/reliability.py --suite graph --jobs 8 --log "$L/graph.json"
    tail -8 "$L/graph.txt"
    ;;
  emulate)
    # PTX JIT of one target, a slice of 350 cases a call (sm80: 694 cases, parts 0-1; sm86 and
    # sm89: 380, parts 0-1)
    CC=${2:?usage: device_session.sh emulate 80|86|89 K}
    K=${3:?part index}
    step "emulate$CC" 570 python benchmarks/reliability.py --suite emulate --arch "$CC" --jobs 16 \
      --skip-cases $((K * 350)) --max-cases 350 --log "$L/emulate$CC.json"
    tail -6 "$L/emulate$CC.txt"
    ;;
  *) echo "unknown phase $PHASE"; exit 2 ;;
esac
echo "== steps ($PHASE)"
cat "$L/steps.txt"
tar czf "$FINAL/$(basename "$L").tgz" -C /tmp/logs "$(basename "$L")"
