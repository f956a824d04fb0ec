"""Token Merging for Stable Diffusion, written once for numpy, torch, paddle and jax.

The core (this package) imports no framework. Framework entry points: :mod:`tome_core.torch`,
:mod:`tome_core.paddle`, :mod:`tome_core.jax`.
"""

import os as _os

# In the repository, backends/ and adapters/ sit beside this folder (an install puts them inside it): when
# Python imports this folder straight from a checkout (e.g. `python -m tome_core.bench` run from its root),
# the subpackages are found there too.
_checkout = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "adapters")) and _os.path.isdir(_os.path.join(_checkout, "adapters")):
    __path__.append(_checkout)

from .backend import get_ops, load_backend
from .config import ToMeConfig
from .match import Match, bipartite_match, cell_match
from .merge import merge, unmerge
from .state import ToMeState

__all__ = ["ToMeConfig", "ToMeState", "Match", "bipartite_match", "cell_match", "merge", "unmerge", "get_ops", "load_backend"]
__version__ = "0.1.0"
