"""Run a function right after a module has executed, before anyone uses it, without importing it first.

verl's processes import its modules lazily, and importing one early costs start-up time or imports vLLM where no
engine runs. ``after_import(name, callback)`` calls ``callback(module)`` at once if the module is imported already,
else the moment its import finishes (a ``sys.meta_path`` finder that wraps the module's loader and fires once).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from collections.abc import Callable


def after_import(name: str, callback: Callable) -> None:
    """``callback(module)`` once module ``name`` has executed (now, if it has)."""
    if name in sys.modules:
        callback(sys.modules[name])
        return
    sys.meta_path.insert(0, _AfterImport(name, callback))


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, callback: Callable) -> None:
        self.name, self.callback = name, callback

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # find the real spec without us, and fire once
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        loader, callback = spec.loader, self.callback

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                callback(module)

        spec.loader = _Loader()
        return spec


__all__ = ["after_import"]
