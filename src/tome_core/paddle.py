"""ToMe for paddle / ppdiffusers: ``tome_core.paddle.patch(pipe, ratio=0.5)``.

Importing this module also makes ``apply_tome(ratio=None, **options)`` (the ratio may be positional) and ``remove_tome()`` of every ppdiffusers
``DiffusionPipeline`` and every ``paddle.nn.Layer`` run this implementation, in place of the port of tomesd
that ppdiffusers installs under those names. ``remove_tome`` undoes either implementation. ppdiffusers' own
functions stay reachable as :data:`PPDIFFUSERS_APPLY_TOME` and :data:`PPDIFFUSERS_REMOVE_TOME`.
"""

from __future__ import annotations

import paddle
import ppdiffusers.patches.tomesd_patch_utils  # noqa: F401  (installs ppdiffusers' methods before ours replace them)
from ppdiffusers import DiffusionPipeline

from tome_core.adapters.ppdiffusers import patch as _patch, patched_models, ppdiffusers_targets, remove
from tome_core.dropin import ratio_positional, tomesd_functions

patch = ratio_positional(_patch, "patch", __name__)  # patch(pipe, 0.5) as apply_tome(0.5)
apply_tome = ratio_positional(_patch, "apply_tome", __name__)
remove_tome = remove
apply_patch, remove_patch = tomesd_functions(_patch, remove)


def _remove_tome_method(self, only_return_self: bool = True):
    # only_return_self=False is how ppdiffusers' own apply_tome asks which layers to patch.
    remove(self)
    return self if only_return_self else (self, ppdiffusers_targets(self))


# ppdiffusers' own implementation (a tomesd port), kept for comparison before ours takes its place
# (a reload of this module keeps the originals it found the first time).
PPDIFFUSERS_APPLY_TOME = globals().get("PPDIFFUSERS_APPLY_TOME") or paddle.nn.Layer.__dict__.get("apply_tome")
PPDIFFUSERS_REMOVE_TOME = globals().get("PPDIFFUSERS_REMOVE_TOME") or paddle.nn.Layer.__dict__.get("remove_tome")

for _cls in (DiffusionPipeline, paddle.nn.Layer):
    _cls.apply_tome = apply_tome
    _cls.remove_tome = _remove_tome_method

__all__ = ["patch", "remove", "apply_tome", "remove_tome", "apply_patch", "remove_patch", "patched_models",
    "PPDIFFUSERS_APPLY_TOME", "PPDIFFUSERS_REMOVE_TOME",
]


def __dir__():  # the public names only, not the imports
    return list(__all__)
