#!/usr/bin/env bash
# Build, on the development machine, the ignored folders benchmarks/device_session.sh carries:
#   .t38/part_aa, .t38/part_ab  Triton 3.8.0 (vLLM 0.33's pin) for the H200's Python 3.12: the
#                               cp312 manylinux wheel's triton/ less cupti, libproton,
#                               ptxas-blackwell and the AMD backend, tar.xz, split under 60 MB
#   .fmla/                      FlashMLA as vLLM 0.33.0 ships it (_flashmla_C.abi3.so and its
#                               interface), from the vllm wheel, with empty package __init__s
# Both folders must be ignored (the script adds them to .git/info/exclude).
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
for d in /.t38/ /.fmla/; do
  grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude
done

python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 -d "$tmp/whl" triton==3.8.0
mkdir -p "$tmp/t38" && (cd "$tmp/t38" && python3 -m zipfile -e "$tmp"/whl/triton-3.8.0*.whl .)
rm -rf "$tmp"/t38/triton/backends/nvidia/lib/cupti* "$tmp/t38/triton/_C/libproton.so" \
  "$tmp/t38/triton/backends/amd"
find "$tmp/t38" -name ptxas-blackwell -delete
rm -rf .t38 && mkdir .t38
tar cJf "$tmp/t38.tar.xz" -C "$tmp/t38" .
split -b 55M "$tmp/t38.tar.xz" .t38/part_
ls -la .t38

python3 -m pip download -q --no-deps -d "$tmp/vllm" vllm==0.33.0
rm -rf .fmla && mkdir -p .fmla/vllm/third_party/flashmla
python3 - "$tmp"/vllm/vllm-0.33.0*.whl <<'PY'
import sys, zipfile
names = ["vllm/_flashmla_C.abi3.so", "vllm/third_party/flashmla/__init__.py",
         "vllm/third_party/flashmla/flash_mla_interface.py"]
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in names:
        z.extract(n, ".fmla")
PY
touch .fmla/vllm/__init__.py .fmla/vllm/third_party/__init__.py
ls -la .fmla/vllm
rm -rf "$tmp"
