"""Backend selection: the :class:`~tome_core.algorithm.ops.ArrayOps` for an array, chosen from its type.

Lazy: a backend module is imported only when an array of its framework is seen (such an array cannot exist
unless the framework was imported), so ``import tome_core`` imports no framework.
"""

from __future__ import annotations

import importlib
from typing import Any, Dict

from .ops import ArrayOps

BACKENDS = ("numpy", "torch", "paddle", "jax")
_MODULE_BACKENDS = {**{name: name for name in BACKENDS}, "jaxlib": "jax"}  # an array type's top-level module
_cache: Dict[type, ArrayOps] = {}


def load_backend(name: str) -> ArrayOps:
    """The backend named ``name`` (one of :data:`BACKENDS`); imports its framework."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return importlib.import_module(f"tome_core.backends.{name}_ops").OPS


def get_ops(x: Any) -> ArrayOps:
    """The backend for array ``x``, cached per array type."""
    cls = type(x)
    ops = _cache.get(cls)
    if ops is None:
        root = cls.__module__.split(".")[0]
        if root not in _MODULE_BACKENDS:
            raise TypeError(
                f"no tome_core backend for arrays of type {cls.__module__}.{cls.__qualname__}; "
                f"supported: {', '.join(BACKENDS)}"
            )
        ops = _cache[cls] = load_backend(_MODULE_BACKENDS[root])
    return ops
