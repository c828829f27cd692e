"""What ffnquant's Triton kernel modules share: triton imported lazily with a one-line error, and whether Triton's
interpreter (TRITON_INTERPRET=1: CPU tensors, numpy semantics) is on.

Kernel bodies resolve `tl` from their own module's globals, so each kernel module keeps `triton` / `tl` globals
and fills them from `import_triton` on first use; kernels are decorated per mode at first launch (triton.jit
picks compiled or interpreted when it decorates), so the variable may be set any time before that.
"""

from __future__ import annotations

import os

from ..errors import FFNQuantError

__all__ = ["interpreting", "import_triton"]


def interpreting() -> bool:
    """True when Triton runs kernels in its interpreter."""
    try:  # triton >= 3.4 reads the variable through knobs (accepts 1/true/on)
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except Exception:
        return os.environ.get("TRITON_INTERPRET", "") in ("1", "true", "on")


def import_triton(what: str):
    """(triton, triton.language), or an error saying that `what` needs triton and why it fails to import."""
    try:
        import triton
        import triton.language as tl
    except Exception as exc:  # not installed, or broken (missing libraries)
        raise FFNQuantError(f"{what} needs triton, which fails to import: {exc}") from exc
    return triton, tl
