"""Runs in a freshly spawned process (see test_vllm_plugin.py). Not a test module."""

from __future__ import annotations

import pickle
from typing import Any


def worker(config: Any, new_member_pickle: bytes, results: Any) -> None:
    # `config` was unpickled by multiprocessing's bootstrap before this line ran, before any
    # plugin loaded: exactly the order of a spawned vLLM worker.
    res: dict[str, str] = {"backend": config.attention_config.backend.name}
    try:
        pickle.loads(new_member_pickle)
        res["new_member"] = "unpickled"
    except Exception as e:
        res["new_member"] = f"{type(e).__name__}: {e}"
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what vLLM's worker does before building the model
    cls = config.attention_config.backend.get_class()
    res["class"] = f"{cls.__module__}.{cls.__qualname__}"
    results.put(res)
