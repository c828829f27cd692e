"""`--target-model` and `target_model=`: the model a draft model drafts for, set for a command or an API call.

Like `infra.device`, a setting of the context, read where a model is built (`hf.draft.feed`): a draft model (Gemma 4's
assistants) runs from token ids through this target. Checked when set, before any model is read.
"""

from __future__ import annotations

import contextlib
import contextvars
from pathlib import Path
from typing import Any, Iterator

from ..errors import FFNQuantError

__all__ = ["check_target", "current_target", "use_target"]

_TARGET: contextvars.ContextVar[str | None] = contextvars.ContextVar("ffnquant_target_model", default=None)


def current_target() -> str | None:
    """The folder of the target model draft models are run through in this context (`use_target`), or None."""
    return _TARGET.get()


def check_target(path: Any) -> None:
    """Raises where `path` (not None) is not a model folder: before any model is read."""
    if path is not None and (not isinstance(path, (str, Path)) or not (Path(path) / "config.json").is_file()):
        raise FFNQuantError(f"--target-model {str(path)!r}: not a model folder (no config.json there); give the "
                            "folder of the transformers model the draft model drafts for")


@contextlib.contextmanager
def use_target(path: Any) -> Iterator[str | None]:
    """While active, a draft model is run through the target model at `path` (a model folder; None: the one set
    around this, if any). Checked here (`check_target`), before any model is read."""
    if path is None:
        yield current_target()
        return
    check_target(path)
    token = _TARGET.set(str(path))
    try:
        yield current_target()
    finally:
        _TARGET.reset(token)
