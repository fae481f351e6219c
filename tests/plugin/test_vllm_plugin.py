"""Plugin registration against the real vLLM 0.33: entry point, enum slot, pickling, versions."""

from __future__ import annotations

import logging
import multiprocessing
import pickle
from importlib import metadata

import pytest
from conftest import require_vllm

require_vllm()
pytestmark = pytest.mark.vllm

import triton_mla_sparse.vllm_plugin as plugin  # noqa: E402

BACKEND_QUALNAME = "triton_mla_sparse.vllm_plugin.backend.TritonMLASparseBackend"


def test_import_is_lazy():
    # The entry point module must not drag in vLLM or the kernels: vLLM imports it in every process.
    import subprocess
    import sys

    code = (
        "import sys, triton_mla_sparse.vllm_plugin as p; "
        "print(sorted(m for m in ('vllm', 'triton') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_entry_point_discoverable_and_loads():
    eps = [
        e
        for e in metadata.entry_points(group="vllm.general_plugins")
        if e.name == "triton_mla_sparse"
    ]
    assert len(eps) == 1, "pip install -e . so the entry point is registered"
    assert eps[0].value == "triton_mla_sparse.vllm_plugin:register"
    assert eps[0].load() is plugin.register


def test_register_is_idempotent_and_resolves(caplog):
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    with caplog.at_level(logging.INFO, logger="vllm.triton_mla_sparse"):
        assert plugin.register() is True
        assert plugin.register() is True  # re-entrant: vLLM loads plugins in several places
    assert plugin.is_registered()
    cls = AttentionBackendEnum.CUSTOM.get_class()
    assert f"{cls.__module__}.{cls.__qualname__}" == BACKEND_QUALNAME
    assert cls.get_name() == "TRITON_MLA_SPARSE"
    # The name parses to the CUSTOM member itself (an alias, not a new member).
    assert AttentionBackendEnum["TRITON_MLA_SPARSE"] is AttentionBackendEnum.CUSTOM
    assert "TRITON_MLA_SPARSE" not in AttentionBackendEnum._member_names_
    lines = [r for r in caplog.records if r.name == "vllm.triton_mla_sparse"]
    backend = [r for r in lines if "DSA indexer" not in r.getMessage()]
    assert len(backend) <= 1  # one line per process (none here if an earlier test registered)
    assert len(lines) - len(backend) <= 1  # and one for the DSA indexer path


def test_cli_names_select_it():
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    plugin.register()
    for name in ("CUSTOM", "TRITON_MLA_SPARSE", "triton_mla_sparse"):
        # The validator behind --attention-backend / -ac '{"backend": ...}'.
        assert AttentionConfig(backend=name).backend is AttentionBackendEnum.CUSTOM


def test_unsupported_vllm_version_registers_nothing(monkeypatch, caplog):
    from vllm.v1.attention.backends import registry

    monkeypatch.setattr(plugin, "_state", {"done": False, "registered": False, "reason": ""})
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", {})
    from triton_mla_sparse.vllm_plugin import vllm_signatures

    monkeypatch.setattr(vllm_signatures.metadata, "version", lambda name: "0.35.1")
    with caplog.at_level(logging.INFO, logger="vllm.triton_mla_sparse"):
        assert plugin.register() is False
        assert plugin.register() is False
    assert registry._ATTN_OVERRIDES == {}
    msgs = [r.getMessage() for r in caplog.records if r.name == "vllm.triton_mla_sparse"]
    assert len(msgs) == 1 and "0.35.1 is outside the supported range" in msgs[0]
    assert plugin.vllm_version_supported("0.33.0") == (True, "")
    assert plugin.vllm_version_supported("0.33.2+cu130")[0]
    assert not plugin.vllm_version_supported("0.32.9")[0]


def test_autoselect_flag_parsing():
    for off in ("0", "false", "No", " off "):
        assert not plugin.autoselect_enabled({plugin.AUTOSELECT_ENV: off})
    for on in ("1", "yes", "", "on"):
        assert plugin.autoselect_enabled({plugin.AUTOSELECT_ENV: on})
    assert plugin.autoselect_enabled({})


def test_vllm_own_member_of_that_name_is_reported(monkeypatch, caplog):
    """Should vLLM's enum gain its own TRITON_MLA_SPARSE, the alias would do nothing and the flag
    would select vLLM's backend: registration says so, and names the flag that selects ours."""
    from vllm.config.attention import AttentionConfig
    from vllm.v1.attention.backends import registry

    enum = registry.AttentionBackendEnum
    native = object.__new__(enum)
    native._name_, native._value_ = "TRITON_MLA_SPARSE", "vllm.somewhere.NativeBackend"
    monkeypatch.setitem(enum._member_map_, "TRITON_MLA_SPARSE", native)
    monkeypatch.setattr(plugin, "_state", {"done": False, "registered": False, "reason": ""})
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", {})
    with caplog.at_level(logging.INFO, logger="vllm.triton_mla_sparse"):
        assert plugin.register() is True
    reg = plugin.registration()
    assert reg.registered and reg.flag == "CUSTOM"
    assert "vllm.somewhere.NativeBackend" in reg.conflict and "--attention-backend CUSTOM" in (
        reg.conflict
    )
    assert enum["TRITON_MLA_SPARSE"] is native  # vLLM's member is left alone
    assert AttentionConfig(backend="TRITON_MLA_SPARSE").backend is native  # the consequence
    assert AttentionConfig(backend="CUSTOM").backend.get_class().__name__ == (
        "TritonMLASparseBackend"
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("selects vLLM's backend, not this plugin" in w for w in warnings)
    assert "no alias" in reg.reason


def test_registration_without_conflict():
    reg = plugin.registration()
    assert reg.registered and reg.flag == "TRITON_MLA_SPARSE" and reg.conflict == ""
    assert "alias TRITON_MLA_SPARSE" in reg.reason


def test_custom_slot_held_by_another_plugin_is_left_alone(monkeypatch):
    from vllm.v1.attention.backends import registry

    other = {registry.AttentionBackendEnum.CUSTOM: "someone.else.Backend"}
    monkeypatch.setattr(plugin, "_state", {"done": False, "registered": False, "reason": ""})
    monkeypatch.setattr(registry, "_ATTN_OVERRIDES", other)
    assert plugin.register() is False
    assert registry._ATTN_OVERRIDES == {
        registry.AttentionBackendEnum.CUSTOM: "someone.else.Backend"
    }
    reg = plugin.registration()
    assert not reg.registered and "another plugin" in reg.reason


def test_config_round_trips_into_spawned_worker():
    """A config selecting the backend reaches a spawned process (vLLM's worker start) intact.

    Also shows why the CUSTOM slot is used: a member added with AttentionBackendEnum.register()
    does not unpickle there, because unpickling precedes plugin loading.
    """
    from vllm.config import AttentionConfig, DeviceConfig, VllmConfig
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    from . import _spawn_child

    plugin.register()
    config = VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        attention_config=AttentionConfig(backend="TRITON_MLA_SPARSE"),
    )
    assert config.attention_config.backend is E.CUSTOM
    probe = E.register("TMS_PROBE_NEW_MEMBER", "tms.probe.NewMemberBackend")
    try:
        new_member_pickle = pickle.dumps(probe)
    finally:  # undo the probe member so no other test sees it
        E._member_map_.pop("TMS_PROBE_NEW_MEMBER")
        E._value2member_map_.pop("tms.probe.NewMemberBackend")
        E._member_names_.remove("TMS_PROBE_NEW_MEMBER")
        delattr(E, "TMS_PROBE_NEW_MEMBER")

    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    proc = ctx.Process(target=_spawn_child.worker, args=(config, new_member_pickle, results))
    proc.start()
    try:
        res = results.get(timeout=180)
    finally:
        proc.join(timeout=60)
    assert proc.exitcode == 0
    assert res["backend"] == "CUSTOM"
    assert res["class"] == BACKEND_QUALNAME
    assert res["new_member"].startswith("ValueError"), res["new_member"]
