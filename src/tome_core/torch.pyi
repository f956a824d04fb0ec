# Written by `python -m tome_tools.stubs` from tome_core/torch.py: edit it, then rerun it.
# Editors and type checkers read this stub (the entry points' parameters: _signatures.pyi); at
# runtime inspect.signature shows the same parameters.

from typing import Any

from tome_core._signatures import PatchFunction, TomesdApplyPatch
from tome_core.adapters.diffusers import patched_models as patched_models, remove as remove

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "apply_patch", "remove_patch", "patched_models"]

patch: PatchFunction
"""Every option of tome_core.ToMeConfig, the ratio also positional; help(tome_core.torch.patch) describes
each."""

apply_tome: PatchFunction
"""Every option of tome_core.ToMeConfig, the ratio also positional; help(tome_core.torch.apply_tome) describes
each."""

remove_tome = remove

apply_patch: TomesdApplyPatch
"""Drop-in for ``tomesd.apply_patch``: the same signature, defaults and arithmetic (``max_downsample=1``,
``proportional_attn=False``)."""

def remove_patch(model: Any) -> Any:
    """Drop-in for ``tomesd.remove_patch``."""
