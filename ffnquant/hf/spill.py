"""What the engine keeps between decoder layers, and how the process's memory behaves around them: one stream's
tensors by batch, in memory or a file each (`Store`), in the scratch folder hidden states spill to (`spill_folder`);
glibc's allocator policy for a resident or a streamed model (`set_allocator`) and the heap handed back between
layers (`trim`). Used by `hf.stream`'s engine."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch

from ..infra.atomic import ScratchFolder

__all__ = ["Store", "spill_folder", "set_allocator", "trim"]


class Store:
    """One stream's tensors by key (a batch's hidden states [batch, seq, d_model], a layer's inputs), in memory or
    a file per key."""

    def __init__(self, folder: Path | None, name: str, items: Mapping[int, Any] | None = None) -> None:
        self.folder, self.name, self.items = folder, name, dict(items or {})
        # by key: the last layer's second output where the model hands it to the next layer (`forward.find_carried`)
        self.carried: dict[int, Any] = {}
        # by key: the call the model's forward hands the next layer, recorded as it is replayed (`hf.replay`: its
        # other arguments computed from the outputs so far, Inkling 2's block states)
        self.calls: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.items)

    def get(self, key: int) -> torch.Tensor:
        item = self.items[key]
        return torch.load(item, weights_only=True) if isinstance(item, Path) else item

    def put(self, key: int, x: torch.Tensor) -> None:
        if self.folder is not None:
            path = self.folder / f"{self.name}.{key}.pt"
            torch.save(x, path)
            x = path
        self.items[key] = x

    def pop(self, key: int) -> None:
        """The tensor of `key` dropped (its file deleted)."""
        item = self.items.pop(key)
        self.carried.pop(key, None)
        self.calls.pop(key, None)
        if isinstance(item, Path):
            item.unlink()

    def clear(self) -> None:
        for key in list(self.items):
            self.pop(key)

    def copy(self, name: str, keys: Sequence[int] | None = None) -> "Store":
        """A new stream starting from these tensors (those of `keys`, default all): shared until replaced in
        memory, files copied on disk."""
        keys = list(self.items) if keys is None else list(keys)
        if self.folder is None:
            out = Store(None, name, {k: self.items[k] for k in keys})
        else:
            out = Store(self.folder, name)
            for k in keys:
                out.put(k, self.get(k))
        out.carried = {k: self.carried[k] for k in keys if k in self.carried}
        out.calls = {k: self.calls[k] for k in keys if k in self.calls}
        return out


def _glibc(call: str, *args: int) -> None:
    """glibc's malloc `call(*args)`; elsewhere nothing: that allocator's own policy stands."""
    try:
        import ctypes

        getattr(ctypes.CDLL("libc.so.6"), call)(*args)
    except (OSError, AttributeError):
        pass


def trim() -> None:
    """Freed heap memory handed back: each layer's tensors read and converted would leave some behind."""
    _glibc("malloc_trim", 0)


# glibc's mmap threshold once a model streams (M_MMAP_THRESHOLD, fixed: it also stops the trim threshold growing):
# blocks from it up are mapped on their own and unmapped when freed. Left to glibc, the threshold rises to 32 MB as
# large blocks are freed; the many 4-32 MB tensors of a layer's work (activations, observer chunks, chunks read)
# are then carved from the heap, where what they leave stays resident: 0.1-0.2 GB more at the peak, varying from
# run to run (benchmarks/scale.py --trace).
_MMAP_THRESHOLD = 4 * 2**20

# glibc's policy while a model is resident (it fits, with room to spare): freed blocks are kept for the next ones.
# A tensor of up to 32 MB (the largest M_MMAP_THRESHOLD glibc takes) comes from the heap, and what is freed at the
# heap's top is handed back only beyond 1 GB (M_TRIM_THRESHOLD). On this project's 2-core VM a page the process
# touches for the first time costs 0.5-2 s of kernel time per GB; a plan of Gemma 3 270M, whose layers' work
# allocates and frees its 4-32 MB tensors thousands of times, faulted 7.5 M pages in (54 s of system time, 20% of
# its CPU time) with glibc's defaults and its per-layer trims (`benchmarks/plan_cost.py`).
_RESIDENT_MMAP_THRESHOLD = 32 * 2**20
_RESIDENT_TRIM_THRESHOLD = 2**30
_TRIM_THRESHOLD = 128 * 2**10  # glibc's default, which a streamed model restores after a resident one in the process
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def set_allocator(resident: bool) -> None:
    """glibc's policy for the rest of the process: a resident model keeps freed blocks for the next layer's work, a
    streamed one maps large blocks on their own and keeps glibc's default trim threshold."""
    if resident:
        _glibc("mallopt", _M_MMAP_THRESHOLD, _RESIDENT_MMAP_THRESHOLD)
        _glibc("mallopt", _M_TRIM_THRESHOLD, _RESIDENT_TRIM_THRESHOLD)
    else:
        _glibc("mallopt", _M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
        _glibc("mallopt", _M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


@contextlib.contextmanager
def spill_folder(spill: bool, spill_dir: str | os.PathLike | None):
    """While active, the scratch folder a run's hidden states spill to (removed after), or None in memory."""
    with ScratchFolder("stream", dir=spill_dir) if spill else \
            contextlib.nullcontext() as folder:
        yield Path(folder) if folder else None
