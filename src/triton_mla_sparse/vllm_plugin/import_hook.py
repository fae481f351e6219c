"""Run code right after vLLM executes one of its modules: the plugin's way to patch a module
that may not be imported yet, without importing it (``register()`` stays cheap).

One finder per (owner, module name) on ``sys.meta_path``; it removes itself on first use and
hands the import to the real loader, so the module is loaded exactly as without it.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable
from typing import Any


class AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``hook`` once the module ``name`` has been executed."""

    def __init__(self, name: str, hook: Callable[[], None], owner: str) -> None:
        self.name, self.hook, self.owner = name, hook, owner

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once; and find the real spec without us
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, hook = spec.loader, self.hook

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec: Any) -> Any:
                return loader.create_module(spec)

            def exec_module(self, module: Any) -> None:
                loader.exec_module(module)
                module.__loader__ = module.__spec__.loader = loader  # as if never hooked
                hook()

        spec.loader = _Loader()
        return spec


def pending(owner: str, name: str | None = None) -> list[AfterImport]:
    """``owner``'s hooks still waiting (on ``name`` only, if given)."""
    return [
        f
        for f in sys.meta_path
        if isinstance(f, AfterImport) and f.owner == owner and name in (None, f.name)
    ]


def after_import(name: str, hook: Callable[[], None], owner: str) -> None:
    """Run ``hook`` now if ``name`` is imported, else right after it is; one hook per owner and
    module (a second call while one waits changes nothing)."""
    if name in sys.modules:
        hook()
    elif not pending(owner, name):
        sys.meta_path.insert(0, AfterImport(name, hook, owner))


def remove(owner: str) -> None:
    """Drop ``owner``'s waiting hooks (tests, uninstall)."""
    for f in pending(owner):
        sys.meta_path.remove(f)
