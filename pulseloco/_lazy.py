"""Lazy public names for packages whose submodules import torch, transformers or hivemind."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def lazy_attributes(package: str, names: Mapping[str, str]) -> Callable[[str], Any]:
    """A module-level ``__getattr__`` for ``package``: the first access of a name in ``names`` imports the module
    ``names[name]`` and caches the attribute in the package; any other name raises AttributeError (and a failing
    import raises its own error, caching nothing)."""

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(names[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
