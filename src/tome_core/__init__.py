"""Token Merging for Stable Diffusion, written once for numpy, torch, paddle and jax.

The core (this package) imports no framework. Framework entry points: :mod:`tome_core.torch`,
:mod:`tome_core.paddle`, :mod:`tome_core.jax`.
"""

from .algorithm.backend import get_ops, load_backend
from .algorithm.match import Match, bipartite_match, cell_match
from .algorithm.merge import merge, unmerge
from .config import ToMeConfig
from .hooks.state import ToMeState

__all__ = ["ToMeConfig", "ToMeState", "Match", "bipartite_match", "cell_match", "merge", "unmerge", "get_ops", "load_backend"]
__version__ = "0.1.0"
