"""The classes a patch gives the sub-layers it hooks (:func:`patched_class`), and :class:`Patch`, what one
patched model holds: its state, its hooks' handles, the classes it changed. Framework-free."""

from __future__ import annotations

import copyreg
import itertools
import weakref
from typing import Any, List, Optional, Tuple

from .state import ToMeState


_PATCHED_CLASSES: "weakref.WeakValueDictionary[Tuple[type, int], type]" = weakref.WeakValueDictionary()
_GENERATIONS = itertools.count()
SHARED_MARK = "_tome_block_of"  # on a hooked block: the Patch that hooks it (copied and pickled with the model)


def other_patch(block: Any, model: Any) -> Optional["Patch"]:
    """The patch of another model than ``model`` that hooks ``block`` (two models that share blocks), or None."""
    patch = block.__dict__.get(SHARED_MARK)
    return patch if patch is not None and patch is not model.__dict__.get("_tome_patch") else None


def patched_class(cls: type, generation: int) -> type:
    """The class patch number ``generation`` gives the modules of class ``cls`` it hooks: a subclass of the same
    names that overrides nothing, pickled as a call of this function (copies of a patched model stay patched)."""
    key = (cls, generation)
    made = _PATCHED_CLASSES.get(key)
    if made is None:

        def __reduce_ex__(self, protocol):
            function, arguments, *rest = cls.__reduce_ex__(self, protocol)
            if function is copyreg.__newobj__ and arguments[0] is type(self):
                return (_new_patched, (cls, generation) + tuple(arguments[1:]), *rest)
            return (function, arguments, *rest)

        names = {"__module__": cls.__module__, "__qualname__": cls.__qualname__, "__reduce_ex__": __reduce_ex__}
        made = _PATCHED_CLASSES[key] = type(cls.__name__, (cls,), names)
    return made


def _new_patched(cls: type, generation: int, *arguments: Any) -> Any:
    made = patched_class(cls, generation)
    return made.__new__(made, *arguments)


def detach(model: Any) -> None:
    """Take the patch of ``model`` off (its hooks and the classes it gave), if it has one."""
    patch = model.__dict__.pop("_tome_patch", None)
    if patch is not None:
        patch.remove()


class Patch:
    """Everything one patched model holds: its state, the handles of its hooks, and the classes it changed.

    Every sub-layer that merges gets this patch's :func:`patched_class` of its class for the life of the patch:
    compilers guard on modules' classes but not on their hooks (torch.compile's ``skip_nnmodule_hook_guards``), so
    code compiled before this patch compiles again, hooks included; :meth:`remove` puts the classes back. Models and
    blocks keep their classes (diffusers' ``from_pipe`` and caching hooks match classes exactly)."""

    def __init__(self, state: ToMeState):
        self.state = state
        self.handles: List[Any] = []
        self.generation = next(_GENERATIONS)
        self.retyped: List[Tuple[Any, type]] = []  # (module, the class it had)
        self.targets: List[Any] = []  # the sub-layers that merge
        self.blocks: List[Any] = []  # the blocks it hooks, each marked as this patch's (SHARED_MARK)

    def mark(self, block: Any) -> None:
        """Mark ``block`` as hooked by this patch (:func:`other_patch` finds it)."""
        block.__dict__[SHARED_MARK] = self
        self.blocks.append(block)

    def retype(self, module: Any) -> None:
        """Give ``module`` this patch's class (once)."""
        if any(done is module for done, _ in self.retyped):
            return
        self.retyped.append((module, type(module)))
        module.__class__ = patched_class(type(module), self.generation)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for block in self.blocks:
            if block.__dict__.get(SHARED_MARK) is self:
                del block.__dict__[SHARED_MARK]
        self.blocks.clear()
        for module, cls in self.retyped:
            if type(module) is patched_class(cls, self.generation):  # not when something else changed it since
                module.__class__ = cls
        self.retyped.clear()
