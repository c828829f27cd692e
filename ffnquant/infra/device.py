"""Where the model-level passes compute: `--device cpu|cuda|auto` and `device=` in the Python API.

One engine (`hf.stream.SequentialModel`) runs every causal LM a decoder layer at a time; it reads the device it
computes on from `current_device()`, which a command or an API call sets for its duration with `use_device`. The
decoder layer being run, its inputs and the LM head are put on that device; what is kept between passes (hidden
states, captured FFN inputs, float figures) stays in host memory, so the same code path runs on the CPU, where
every move is a no-op, and on a GPU, where only the layer at hand and a batch are on it.

`auto` is a CUDA device when torch sees one, else the CPU. Asking for `cuda` where torch has no CUDA device is a
one-line error before any model is read, never a silent fall back to the CPU.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import copy
from typing import Any, Iterator

import torch

from ..errors import FFNQuantError

__all__ = ["DEVICES", "resolve_device", "use_device", "current_device", "to_device", "module_copy", "device_free_memory", "describe_device"]

DEVICES = ("auto", "cpu", "cuda")

_CURRENT: contextvars.ContextVar[torch.device] = contextvars.ContextVar("ffnquant_device", default=torch.device("cpu"))


def resolve_device(text: Any) -> torch.device:
    """`auto`, `cpu`, `cuda` or `cuda:N` (or a torch.device) as the device to compute on; FFNQuantError, naming what
    is valid, for anything else or for a CUDA device torch cannot see."""
    if isinstance(text, torch.device):
        text = str(text)
    if not isinstance(text, str) or not text.strip():
        raise FFNQuantError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {text!r}")
    name = text.strip().lower()
    if name == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name == "cuda" or (name.startswith("cuda:") and name[5:].isdigit()):
        if not torch.cuda.is_available():
            why = ("this torch has no CUDA build" if torch.version.cuda is None
                   else "torch sees no CUDA device here")
            raise FFNQuantError(f"device {text!r}: {why}; use --device cpu (or auto, which picks the CPU here)")
        index = int(name[5:]) if ":" in name else 0
        if index >= torch.cuda.device_count():
            raise FFNQuantError(f"device {text!r}: only {torch.cuda.device_count()} CUDA device(s) here "
                                f"(cuda:0..cuda:{torch.cuda.device_count() - 1})")
        return torch.device("cuda", index)
    raise FFNQuantError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), got {text!r}")


def current_device() -> torch.device:
    """The device the engine computes on in this context (the CPU unless `use_device` says otherwise)."""
    return _CURRENT.get()


@contextlib.contextmanager
def use_device(device: Any) -> Iterator[torch.device]:
    """While active, the engine computes on `device` (resolved by `resolve_device`)."""
    resolved = resolve_device(device)
    token = _CURRENT.set(resolved)
    try:
        yield resolved
    finally:
        _CURRENT.reset(token)


def module_copy(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers are copies on `device`, made there in one step (no copy in
    host memory first: an 8B model's FFN is 0.7 GB); `module` is left as it is."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = torch.nn.Parameter(p.detach().to(device, copy=True), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = b.to(device, copy=True)
    return copy.deepcopy(module, memo)


def device_free_memory(device: torch.device) -> int | None:
    """The bytes free on a CUDA `device` (what the memory planner may use there); None for the CPU, whose budget
    is the host's (`infra.resources.memory_limit`)."""
    if device.type != "cuda":
        return None
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def to_device(value: Any, device: torch.device) -> Any:
    """`value` with every tensor in it (nested in tuples, lists, dicts) on `device`; other values as they are."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device)
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(to_device(v, device) for v in value)
    if isinstance(value, list):
        return [to_device(v, device) for v in value]
    if isinstance(value, dict):
        return {k: to_device(v, device) for k, v in value.items()}
    if isinstance(value, collections.UserDict):  # transformers' KVSharingDict (a draft model's target states)
        return type(value)({k: to_device(v, device) for k, v in value.items()})
    return value


def describe_device(device: torch.device) -> str:
    """The device in words for a report: 'cpu', or 'cuda:0 (NVIDIA H200)'."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)
