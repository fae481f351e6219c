"""HY V4's DSA indexer on the plugin's DeepGEMM-free path, against the real vLLM 0.33, on CPU.

HY V4 (vllm/models/hy_v4/nvidia/attention.py) imports ``SparseAttnIndexer`` from
``vllm.model_executor.layers.sparse_attn_indexer`` (:42) and never imports DeepSeek-V3.2's
attention module: the logits, the metadata schedule and (SM80/86) the out-of-tree
``SparseAttnIndexer`` must install when ``sparse_attn_indexer`` loads. Each case is a fresh
process, as vLLM's: the plugin is loaded by vLLM's own plugin loader with the device capability
simulated, then HY V4's attention module is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace as NS

import pytest
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

from triton_mla_sparse.vllm_plugin import vllm_signatures as sig  # noqa: E402

LOGITS = set(sig.LOGITS_TARGETS)
OOT_OP = f"{sig.OOT}.{sig.INDEXER_OP}"
ATT_TARGETS = {f"{sig.ATT}.fused_q", f"{sig.ATT}.fused_norm_rope"}

CHILD = """
import logging, sys
log = logging.getLogger("vllm.triton_mla_sparse")
log.setLevel(logging.INFO)
log.addHandler(logging.StreamHandler(sys.stdout))
from triton_mla_sparse.vllm_plugin import indexer_install as inst
inst._device_capability = lambda: {cap!r}  # simulated device
from vllm.plugins import load_general_plugins
load_general_plugins()  # vLLM's loader: the entry point calls register()
import triton_mla_sparse.vllm_plugin as plugin
assert plugin.is_registered()
print("SAI_BEFORE", "{sai}" in sys.modules)
import vllm.models.hy_v4.nvidia.attention as hy
import vllm.model_executor.layers.sparse_attn_indexer as sai
from vllm.model_executor.custom_op import op_registry_oot
print("ATT_LOADED", "{att}" in sys.modules)
print("HY", sorted(inst.installed_targets()))
print("SAME_CLASS", hy.SparseAttnIndexer is sai.SparseAttnIndexer)
oot = op_registry_oot.get("SparseAttnIndexer")
print("OOT_SUBCLASS", oot is not None and issubclass(oot, sai.SparseAttnIndexer))
import vllm.models.deepseek_v32.attention  # DeepSeek-V3.2 afterwards, same process
print("ALL", sorted(inst.installed_targets()))
"""


def _child(cap):
    src = Path(__file__).resolve().parents[2] / "src"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", VLLM_TARGET_DEVICE="cpu")
    env.pop("TRITON_MLA_SPARSE_INDEXER", None)
    env["PYTHONPATH"] = str(src) + os.pathsep + env.get("PYTHONPATH", "")
    code = CHILD.format(cap=cap, sai=sig.SAI, att=sig.ATT)
    r = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = {}
    for line in r.stdout.splitlines():
        key, _, value = line.partition(" ")
        out.setdefault(key, value)
    out["log"] = r.stdout
    return out


@pytest.mark.parametrize(
    "cap,hy_targets,att_targets",
    [
        ((8, 0), LOGITS | {OOT_OP}, ATT_TARGETS),
        ((8, 6), LOGITS | {OOT_OP}, ATT_TARGETS),
        ((8, 9), LOGITS, set()),
        ((9, 0), set(), set()),
    ],
    ids=["sm80", "sm86", "sm89", "sm90"],
)
def test_hy_v4_import_installs_the_shared_targets(cap, hy_targets, att_targets):
    out = _child(cap)
    # The hook path: nothing imported sparse_attn_indexer before the model module did.
    assert out["SAI_BEFORE"] == "False"
    assert out["ATT_LOADED"] == "False"  # HY V4 never imports DeepSeek-V3.2's module
    assert set(eval(out["HY"])) == hy_targets
    # HY V4 binds vLLM's class name; CustomOp.__new__ builds the out-of-tree class from it.
    assert out["SAME_CLASS"] == "True"
    assert out["OOT_SUBCLASS"] == str(OOT_OP in hy_targets)
    # DeepSeek-V3.2 in the same process still gets exactly what it got before.
    assert set(eval(out["ALL"])) == hy_targets | att_targets
    if hy_targets:
        assert "Triton path installed" in out["log"]


def test_out_of_tree_indexer_casts_an_e4m3_query_exactly(monkeypatch):
    """HY V4's index query is e4m3 (vLLM's CUDA per_token_group_quant_fp8, scale folded into the
    weights): on SM80/86 the out-of-tree class hands vLLM's op the same values in the model dtype
    (so the decode path's pack_seq never compiles an fp8 Triton kernel there); a query already in
    the model dtype (DeepSeek-V3.2's, from the plugin's fused_q) is passed through as is."""
    import torch
    import vllm.model_executor.layers.sparse_attn_indexer as sai
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from triton_mla_sparse.vllm_plugin import indexer_install as inst

    seen = []
    monkeypatch.setattr(
        sai.SparseAttnIndexer, "forward_cuda", lambda self, h, q, k, w: seen.append(q) or q
    )
    inst.uninstall()
    assert inst.apply(inst.indexer_plan((8, 0), {}))
    try:
        with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
            op = sai.SparseAttnIndexer(  # as HY V4's Indexer builds it (attention.py:186-197)
                NS(prefix="l0.k_cache"), 128, "ue8m0", 64, 128, 1024, 4096, torch.zeros(4, 64)
            )
        assert type(op) is not sai.SparseAttnIndexer and op.index_q_dtype == torch.bfloat16
        g = torch.Generator().manual_seed(0)
        q8 = (torch.randn(5, 4, 128, generator=g) * 100).to(torch.float8_e4m3fn)
        w = torch.randn(5, 4, generator=g)
        op.forward_cuda(torch.empty(5, 8), q8, None, w)
        assert seen[-1].dtype == torch.bfloat16
        assert torch.equal(seen[-1].float(), q8.float())  # exact: same values
        qb = torch.randn(5, 4, 128, generator=g).bfloat16()
        op.forward_cuda(torch.empty(5, 8), qb, None, w)
        assert seen[-1] is qb
    finally:
        inst.uninstall()
