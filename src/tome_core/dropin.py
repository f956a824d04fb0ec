"""tomesd's function names and defaults on top of any framework's ``patch``/``remove`` (framework-free)."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Tuple

from .config import option_parameters


# tomesd.apply_patch's parameters after the model, in its order, with its defaults (their types are its types).
TOMESD_DEFAULTS = {
    "ratio": 0.5, "max_downsample": 1, "sx": 2, "sy": 2, "use_rand": True, "merge_attn": True,
    "merge_crossattn": False, "merge_mlp": False,
}


def tomesd_functions(patch: Callable[..., Any], remove: Callable[[Any], Any]) -> Tuple[Callable[..., Any], Callable[[Any], Any]]:
    """``(apply_patch, remove_patch)`` with ``tomesd``'s signature and defaults (``max_downsample=1``)."""
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    options = inspect.Signature([
        inspect.Parameter(name, positional, default=value, annotation=type(value))
        for name, value in TOMESD_DEFAULTS.items()
    ])

    def apply_patch(model: Any, *args: Any, **given: Any) -> Any:
        """Drop-in for ``tomesd.apply_patch``: the same signature, defaults and arithmetic (``max_downsample=1``,
        ``proportional_attn=False``)."""
        unknown = sorted(set(given) - set(TOMESD_DEFAULTS))
        if unknown:
            raise TypeError(
                f"apply_patch got unknown option(s) {', '.join(unknown)}; tomesd's apply_patch takes "
                f"{', '.join(TOMESD_DEFAULTS)} (patch() takes the options beyond tomesd's)"
            )
        bound = options.bind(*args, **given)  # tomesd's positional order; a value given twice raises TypeError
        bound.apply_defaults()
        return patch(model, **bound.arguments, proportional_attn=False)  # tomesd's arithmetic

    # what inspect.signature, help() and the type stubs show: tomesd's parameters
    apply_patch.__signature__ = options.replace(
        parameters=[inspect.Parameter("model", positional, annotation=Any), *options.parameters.values()],
        return_annotation=Any,
    )

    def remove_patch(model: Any) -> Any:
        """Drop-in for ``tomesd.remove_patch``."""
        return remove(model)

    return apply_patch, remove_patch


def ratio_positional(patch: Callable[..., Any], name: str, module: str) -> Callable[..., Any]:
    """An entry point ``name(model, ratio=None, **options)``: :func:`patch` that also takes the ratio
    positionally, as ppdiffusers' and tomesd's users write it (``pipe.apply_tome(0.5)``, ``patch(pipe, 0.5)``);
    every other option by keyword. ``module``: the entry point's module (shown by ``help``, and how tests tell
    ``apply_tome`` from ppdiffusers')."""

    def entry(model: Any, *ratio: Any, **options: Any) -> Any:
        if len(ratio) > 1:
            raise TypeError(
                f"{name} takes the ratio as its only positional argument, got {len(ratio)} positional values "
                f"{ratio!r}; pass every other option by keyword, e.g. {name}(model, 0.5, max_downsample=2)"
            )
        if ratio:
            if "ratio" in options:
                raise TypeError(f"{name} got the ratio twice: positionally and as ratio=")
            options["ratio"] = ratio[0]
        return patch(model, **options)

    entry.__doc__ = (
        f"{name}(model, ratio=None, *, max_downsample=None, ...): the ratio positional or by keyword, every other "
        "option by keyword.\n\n" + (patch.__doc__ or "")
    )
    # what inspect.signature, help() and interactive completion show: every option with the default that acts
    positional = inspect.Parameter.POSITIONAL_OR_KEYWORD
    options = [p for p in option_parameters() if p.name != "ratio"]
    entry.__signature__ = inspect.Signature(
        [inspect.Parameter("model", positional), inspect.Parameter("ratio", positional, default=None, annotation=Optional[float]), *options],
        return_annotation=Any,
    )
    entry.__wrapped__ = patch
    entry.__name__ = entry.__qualname__ = name
    entry.__module__ = module
    return entry
