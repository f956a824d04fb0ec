"""ToMe for torch / diffusers: ``tome_core.torch.patch(pipe, ratio=0.5)`` (or ``patch(pipe, 0.5)``).

Importing this module also gives every diffusers ``DiffusionPipeline`` and ``ModelMixin`` the methods
``apply_tome(ratio=None, **options)`` (the ratio may be positional) and ``remove_tome()``.
"""

from __future__ import annotations

from diffusers import DiffusionPipeline, ModelMixin

from tome_core.adapters.diffusers import patch as _patch, patched_models, remove
from tome_core.dropin import ratio_positional, tomesd_functions

patch = ratio_positional(_patch, "patch", __name__)  # patch(pipe, 0.5) as apply_tome(0.5)
apply_tome = ratio_positional(_patch, "apply_tome", __name__)
remove_tome = remove
apply_patch, remove_patch = tomesd_functions(_patch, remove)


def _remove_tome_method(self):
    return remove(self)


for _cls in (DiffusionPipeline, ModelMixin):
    _cls.apply_tome = apply_tome
    _cls.remove_tome = _remove_tome_method

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "apply_patch", "remove_patch", "patched_models"]


def __dir__():  # the public names only, not the imports
    return list(__all__)
