# Written by `python -m tome_tools.stubs` from tome_core/jax.py: edit it, then rerun it.
# Editors and type checkers read this stub (the entry points' parameters: _signatures.pyi); at
# runtime inspect.signature shows the same parameters.

from tome_core._signatures import PatchFunction
from tome_core.adapters.flax import (
    block_paths as block_paths,
    is_patched as is_patched,
    patched_models as patched_models,
    record as record,
    remove as remove,
)

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "patched_models", "is_patched", "record",
    "block_paths"]

patch: PatchFunction
"""Every option of tome_core.ToMeConfig, the ratio also positional; help(tome_core.jax.patch) describes
each."""

apply_tome: PatchFunction
"""Every option of tome_core.ToMeConfig, the ratio also positional; help(tome_core.jax.apply_tome) describes
each."""

remove_tome = remove
