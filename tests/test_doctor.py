"""``triton-mla-sparse doctor`` without vLLM: its arguments, and the kernel path it reads off the
library's launch plan. What it says about vLLM's selection is tested against vLLM's own code in
tests/plugin/test_doctor.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from triton_mla_sparse.cli import doctor
from triton_mla_sparse.cli.doctor import kernel, models
from triton_mla_sparse.cli.main import main
from triton_mla_sparse.ops.sparse_mla.heuristics import TARGETS
from triton_mla_sparse.ops.sparse_mla.plan import make_plan


@pytest.mark.parametrize(
    "text,cap",
    [
        ("8.0", (8, 0)),
        ("80", (8, 0)),
        ("sm80", (8, 0)),
        ("sm_80", (8, 0)),
        ("SM_80", (8, 0)),
        (" 8.6 ", (8, 6)),
        ("89", (8, 9)),
        ("9.0", (9, 0)),
        ("sm_90", (9, 0)),
        ("10.0", (10, 0)),
        ("100", (10, 0)),
        ("12.0", (12, 0)),
        ("12.1", (12, 1)),
        ("121", (12, 1)),
        ("sm_121", (12, 1)),
        ("sm_90a", (9, 0)),
    ],
)
def test_parse_capability(text, cap):
    assert models.parse_capability(text) == cap


@pytest.mark.parametrize(
    "text",
    ["", "8", "8.", ".0", "sm", "sm_", "x86", "8.0.1", "1234", "8,0", "0.0", "sm_8x", "12.10"],
)
def test_parse_capability_refuses(text):
    with pytest.raises(ValueError, match="is not a compute capability"):
        models.parse_capability(text)


@pytest.mark.parametrize(
    "text,label",
    [
        ("glm-5", "GLM-5"),
        ("GLM5", "GLM-5"),
        ("zai-org/GLM-5", "GLM-5"),
        ("deepseek-v3.2", "DeepSeek-V3.2"),
        ("hy-v4", "HY V4"),
        ("HYV4ForCausalLM", "HY V4"),
        ("deepseek-ai/DeepSeek-V3.2", "DeepSeek-V3.2"),
        (" dsv32 ", "DeepSeek-V3.2"),
    ],
)
def test_parse_model(text, label):
    assert models.parse_model(text).label == label


def test_parse_tp():
    glm5 = models.parse_model("glm-5")
    assert [models.parse_tp(t, glm5) for t in ("1", "8", "64")] == [1, 8, 64]
    for bad in ("0", "-8", "3", "x", "128"):
        with pytest.raises(ValueError, match="positive divisor of GLM-5's 64 query heads"):
            models.parse_tp(bad, glm5)


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--capability", "bogus"], "--capability 'bogus' is not a compute capability"),
        (["--model", "llama"], "--model 'llama' is not a model the doctor knows"),
        (["--model", "glm-5", "--tp", "3"], "--tp '3' must be a positive divisor"),
    ],
)
def test_bad_arguments_are_one_line_exit_2(argv, words, capsys):
    assert main(["doctor", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert captured.err.startswith("triton-mla-sparse doctor: error: ") and words in captured.err


def test_bad_cache_dtype_is_argparses_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["doctor", "--kv-cache-dtype", "fp8_e5m2"])
    assert info.value.code == 2
    assert "invalid choice: 'fp8_e5m2'" in capsys.readouterr().err


def test_bad_capability_from_the_command_line():
    # The installed console script runs the same main(); python -m is its in-tree equivalent.
    src = Path(__file__).resolve().parents[1] / "src"
    proc = subprocess.run(
        [sys.executable, "-m", "triton_mla_sparse.cli.main", "doctor", "--capability", "sm_8x"],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(src)},
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "--capability 'sm_8x' is not a compute capability" in proc.stderr


# --- the kernel path: the library's own plan -----------------------------------------------


@pytest.mark.parametrize("arch", [a for a in TARGETS if a.backend == "cuda"], ids=lambda a: a.cc)
@pytest.mark.parametrize("kv", ["auto", "fp8", "fp8_ds_mla"])
def test_kernel_lines_are_the_plan(arch, kv):
    cap = (int(arch.cc) // 10, int(arch.cc) % 10)
    lines = kernel.kernel_lines(cap, 16, {"auto": "bfloat16", "fp8": "fp8_e4m3"}.get(kv, kv))
    assert lines[0].startswith(f"kernel on sm_{arch.cc}: {arch.smem_bytes // 1024} KB")
    assert ("integer e4m3 decode" in lines[0]) == (int(arch.cc) < 89)
    assert ("hardware e4m3 conversion" in lines[0]) == (int(arch.cc) >= 89)
    for (label, tokens), line in zip(kernel.SHAPES, lines[1:]):
        plan = make_plan(
            num_tokens=tokens,
            num_heads=16,
            latent=512,
            rope=64,
            width=2048,
            dtype=torch.bfloat16,
            kv_format=kv,
            arch=arch,
            on_gpu=True,
        )
        c = plan.config
        assert line.startswith(f"  {label} x 16 heads, ")
        assert f"{plan.family} kernel, {c.block_h} heads x {c.block_n} rows per step, " in line
        slots = c.num_stages if c.gluon == "ampere" else 2
        stages = (
            f"Gluon {c.gluon} kernel, {slots} ring slot" if c.gluon else f"{c.num_stages} stage"
        )
        assert f"{c.num_warps} warps, {stages}" in line
        assert f", {c.num_splits} split" in line
        k = plan.constexprs
        if kv == "auto":
            assert "MMAs" not in line
            continue
        assert ("fp16 MMAs" in line) is k["MMA_FP16"]
        folded = bool(k.get("FOLD_FP16")) or (kv == "fp8_ds_mla" and not k["MMA_FP16"])
        assert ("scales folded into the tile" in line) is folded
        assert ("through shared memory" in line) is bool(k.get("STAGE"))


def test_kernel_lines_name_the_mma_form():
    """fp8_ds_mla at 128 heads on sm90: fp16 MMAs with folded scales in staged tiles; on sm80
    at 8 heads the packed integer decode (prefill below 16 heads: decode and wider prefill run
    the mma.sync Gluon kernel); per-tensor fp8 at 128 heads on sm90: bf16 MMAs."""
    ds = kernel.kernel_lines((9, 0), 128, "fp8_ds_mla")
    assert all(
        "fp16 MMAs, scales folded into the tile, tiles dequantized once through shared memory"
        in line
        for line in ds[1:]
    )
    sm80 = kernel.kernel_lines((8, 0), 8, "fp8_ds_mla")
    assert "prefill" in sm80[-1] and "packed integer decode" in sm80[-1]
    assert all("ds_mla_ampere_gluon kernel" in line for line in sm80[1:-1])
    fp8 = kernel.kernel_lines((9, 0), 128, "fp8_e4m3")
    assert all(line.endswith("; bf16 MMAs") for line in fp8[1:])


def test_kernel_lines_edges():
    assert kernel.kernel_lines((7, 5), 16, "auto") == [
        "kernel: not for sm_75 (needs sm_80 or newer)"
    ]
    lines = kernel.kernel_lines((8, 7), 16, "auto")
    assert "sm_87 is not a target the project compiles" in lines[1]
    assert "48 SMs assumed" in kernel.kernel_lines((12, 1), 8, "auto")[0]
    assert "100 SMs;" in kernel.kernel_lines((12, 1), 8, "auto", num_sms=100)[0]


def test_without_vllm(monkeypatch, capsys):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(doctor.metadata, "version", missing)
    assert doctor.doctor_main(["--capability", "8.6", "--model", "glm-5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("vLLM: not installed (")
    assert "selects" not in "\n".join(lines)  # nothing said about what vLLM would do
    assert any(x.startswith("kernel on sm_86: ") and "integer e4m3 decode" in x for x in lines)
    assert any(x.startswith("  decode 1 token x 8 heads, bf16 rows") for x in lines)
