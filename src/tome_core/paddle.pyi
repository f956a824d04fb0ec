# Written by `python -m tome_tools.stubs` from tome_core/paddle.py: edit it, then rerun it.
# Editors and type checkers read this stub (the entry points' parameters: _signatures.pyi); at
# runtime inspect.signature shows the same parameters.

from typing import Any

from tome_core._signatures import PatchFunction, TomesdApplyPatch
from tome_core.adapters.ppdiffusers import patched_models as patched_models, remove as remove

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "apply_patch", "remove_patch", "patched_models",
    "PPDIFFUSERS_APPLY_TOME", "PPDIFFUSERS_REMOVE_TOME"]

patch: PatchFunction
"""Every option of tome_core.ToMeConfig, the ratio also positional; help(tome_core.paddle.patch) describes
each."""

apply_tome: PatchFunction
"""Every option of tome_core.ToMeConfig, the ratio also positional; help(tome_core.paddle.apply_tome)
describes each."""

remove_tome = remove

apply_patch: TomesdApplyPatch
"""Drop-in for ``tomesd.apply_patch``: the same signature, defaults and arithmetic (``max_downsample=1``,
``proportional_attn=False``)."""

def remove_patch(model: Any) -> Any:
    """Drop-in for ``tomesd.remove_patch``."""

PPDIFFUSERS_APPLY_TOME: Any

PPDIFFUSERS_REMOVE_TOME: Any
