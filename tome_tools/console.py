"""What the project's own command-line tools and examples print: known harmless notices are left out.

Only the tools call :func:`quiet_known_notices`; importing tome_core changes no logging.
"""

from __future__ import annotations

import logging

# (logger, text): transformers 5 tells, once per class, that its image processors fall back to PIL without
# torchvision; diffusers' pipelines touch two of them on import, and nothing here uses them.
KNOWN_NOTICES = (("transformers.utils.import_utils", "requires torchvision (not installed)"),)


def _drop(text: str):
    return lambda record: text not in record.getMessage()


def quiet_known_notices() -> None:
    """Leave out the :data:`KNOWN_NOTICES` from here on (idempotent)."""
    for name, text in KNOWN_NOTICES:
        logger = logging.getLogger(name)
        if not any(getattr(f, "_tome_notice", None) == text for f in logger.filters):
            drop = _drop(text)
            drop._tome_notice = text
            logger.addFilter(drop)
