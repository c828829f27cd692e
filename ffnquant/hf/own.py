"""The model's own functions an FFN computes with where no activation ffnquant names reproduces its module (`hf.probe`
finds them; `model.FFN` computes with them, `hf.checkpoint` fills each layer's copy from its checkpoint):

- an elementwise activation module of the MLP, learned parameters and all (Apertus' xIELU): `Activation.OWN`;
- an experts module's gate function of gate and up (`_apply_gate`: MiniMax-M3's clamped, Inkling 2's soft-capped
  SwiGLU): `OwnGate`, `Activation.OWN_GATE`;
- everything a dense MLP module computes between its Linears (BitNet's and Dory's norm of the hidden, Dory's
  learned gate and up scales): the module itself run with its Linears replaced by slices of its input (`OwnMiddle`),
  a function of gate and up (`OWN_GATE`) or of up alone (`OWN`);
- the same where it also reads the FFN's input beside its Linears (Zamba 2's shared MLP adds each calling layer's
  own low-rank adapter of its input to gate and up): the module run on the FFN's input, its first Linears
  answering the products they are given (`OwnMiddle.reads_input`), with the calling layer's index where its forward
  takes one (`OwnMiddle.layer_idx`, set per layer by `hf.checkpoint`).

Each is a module whose `stored` (where it has one) is the model's module that holds its state, under the names
the checkpoint keeps them by."""

from __future__ import annotations

import copy
import threading
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from .ffn_candidates import FoundFFN

__all__ = ["Handed", "OwnGate", "OwnMiddle", "own_activations", "own_gate", "own_middle", "elementwise", "gate_interleaved",
           "rowwise"]


def elementwise(fn: Callable[..., torch.Tensor], width: int, gen: torch.Generator, inputs: int = 1,
                per_token: bool = False, widths: Sequence[int] = ()) -> bool:
    """Whether `fn` computes an elementwise function of `inputs` tensors [tokens, width]: its output has their shape
    and changing one element of any input changes that element's output alone (`per_token`: that token's outputs
    alone, a norm of the hidden say). `widths`: further inputs of those widths (the FFN's input beside gate and
    up), each read per token."""
    zs = [torch.randn(5, w, generator=gen) * 2.0 for w in [width] * inputs + list(widths)]
    try:
        with torch.no_grad():
            y = fn(*zs)
            for i, z in enumerate(zs):
                changed = [z.clone() for z in zs]
                changed[i][2, z.shape[1] // 2] += 1.0
                y2 = fn(*changed)
                if not _moved_only(y, y2, zs[0].shape, (2,) if per_token else (2, width // 2)):
                    return False
    except Exception:  # noqa: BLE001 - a module that takes other inputs (a two-input gate): not an activation
        return False
    return True


def _moved_only(y: Any, y2: Any, shape: torch.Size, where: tuple[int, ...]) -> bool:
    """Whether y2 differs from y (both of `shape`) at `where` alone (an element, or a row)."""
    if not (isinstance(y, torch.Tensor) and isinstance(y2, torch.Tensor) and y.shape == shape == y2.shape):
        return False
    moved = y2 != y
    moved[where] = False
    return not bool(moved.any())


class OwnGate(nn.Module):
    """An experts module's own gate function as fn(gate, up) (`Activation.OWN_GATE`): its `_apply_gate(gate_up)`,
    transformers' name for a gate that is not act(gate) * up (clamped, soft-capped), on the two halves put back in
    the order its fused matrix stores them: side by side, or `interleaved` column by column (gpt-oss'). `stored`:
    the module that owns it, without its matrices and their biases (what else it holds, a learned cap say, is read
    from each layer's checkpoint)."""

    def __init__(self, stored: nn.Module, gate_first: bool, interleaved: bool = False) -> None:
        super().__init__()
        self.stored = stored
        self.gate_first, self.interleaved = gate_first, interleaved

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        first, second = (gate, up) if self.gate_first else (up, gate)
        both = (torch.stack([first, second], dim=-1).flatten(-2) if self.interleaved
                else torch.cat([first, second], dim=-1))
        return self.stored._apply_gate(both)

    def extra_repr(self) -> str:
        return f"gate_first={self.gate_first}, interleaved={self.interleaved}"


def own_gate(module: nn.Module, ffn: FoundFFN, roles: Mapping[str, str], interleaved: bool = False) -> OwnGate | None:
    """`module`'s own gate function under a fused gate+up assignment `roles`, without the FFN's matrices; None where
    it has none."""
    fused = next((r for r in roles.values() if "+" in r), "")
    if not fused or not callable(getattr(module, "_apply_gate", None)):
        return None
    stored = copy.deepcopy(module)
    for name in ffn.roles:
        stored._parameters.pop(name, None)
        stored._parameters.pop(f"{name}_bias", None)
    return OwnGate(stored, fused == "w_gate+w_up", interleaved)


def gate_interleaved(small: nn.Module, width: int, gen: torch.Generator) -> bool | None:
    """Whether an experts module's `_apply_gate` reads its two halves interleaved column by column (True: moving
    input column 1 moves output 0) or side by side (False: it moves output 1); None when neither."""
    base = torch.randn(3, 2 * width, generator=gen)
    moved = base.clone()
    moved[:, 1] += 1.0
    try:
        with torch.no_grad():
            changed = (small._apply_gate(moved) != small._apply_gate(base)).any(dim=0).nonzero().flatten().tolist()
    except Exception:  # noqa: BLE001 - not a function of the fused product alone
        return None
    return {(0,): True, (1,): False}.get(tuple(changed))


def own_activations(small: nn.Module, ffn: FoundFFN) -> list[str]:
    """The submodules of a probe's copy other than its matrices that may be the model's own activation (every
    state it holds stored with the model: learned parameters and persistent buffers), nearest first."""
    matrices = set(ffn.roles)
    out = []
    for name, child in small.named_modules():
        if not name or name in matrices or any(name.startswith(m + ".") for m in matrices) or isinstance(
                child, (nn.Dropout, nn.ModuleList, nn.ModuleDict)):
            continue
        stored = set(child.state_dict())
        if all(n in stored for n, _ in child.named_buffers()):
            out.append(name)
    return sorted(out, key=lambda n: n.count("."))


def rowwise(fn: Callable[..., torch.Tensor], width: int, gen: torch.Generator, inputs: int = 1,
            widths: Sequence[int] = ()) -> bool:
    """Whether `fn` computes each token's output from that token's inputs alone (`elementwise` per token)."""
    return elementwise(fn, width, gen, inputs, per_token=True, widths=widths)


class _Parts(nn.Module):
    """Stands for one of an MLP's Linears in `OwnMiddle`: the parts of its input (gate, up, ... side by side) that
    the Linear's output would be, in order."""

    def __init__(self, *parts: int, n: int) -> None:
        super().__init__()
        self.parts, self.n = parts, n

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = x.shape[-1] // self.n
        return torch.cat([x[..., i * width:(i + 1) * width] for i in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"parts={self.parts}, n={self.n}"


class Handed(threading.local):
    """The products an `OwnMiddle` reading the FFN's input hands its module's first Linears for one call, per thread
    (the middles of a shared FFN's calls share one module, and plan scoring may run in threads)."""

    def __init__(self) -> None:
        self.parts: tuple[torch.Tensor, ...] = ()

    def __deepcopy__(self, memo: dict) -> "Handed":  # a copied module gets its own (shared within the copy)
        return Handed()

    def __reduce__(self) -> tuple:  # pickled (a worker's copy of a layer) as an empty one
        return (Handed, ())


class _Given(nn.Module):
    """Stands for one of an MLP's first Linears in an `OwnMiddle` that reads the FFN's input: whatever it is given,
    it answers the parts of the products its middle was handed (gate, up, ...) that its output would be."""

    def __init__(self, *parts: int, given: Handed) -> None:
        super().__init__()
        self.parts, self.given = parts, given

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.given.parts[i] for i in self.parts], dim=-1)

    def extra_repr(self) -> str:
        return f"parts={self.parts}"


class OwnMiddle(nn.Module):
    """What a dense MLP module computes between its Linears, as a function of gate and up (or up alone): the module
    (`stored`, its other parameters and submodules its own) run on gate and up side by side, its first Linears
    replaced by the slices their outputs are and its last by the identity.

    `reads_input`: the module also reads the FFN's input beside its Linears (Zamba 2's per-layer adapters): it runs
    on the input `x`, its first Linears answering the products given; `layer_idx`, the calling layer's index its
    forward is passed (None: none)."""

    def __init__(self, stored: nn.Module, reads_input: bool = False, layer_idx: int | None = None,
                 given: Handed | None = None) -> None:
        super().__init__()
        self.stored, self.reads_input, self.layer_idx = stored, reads_input, layer_idx
        # what the `_Given` stand-ins answer (deepcopy keeps it shared within a copy)
        self.given = given if given is not None else Handed()

    def called_by(self, layer_idx: int) -> "OwnMiddle":
        """The same module (its tensors shared, not copied) as another layer's call computes it: a shared FFN's
        calls differ by the index alone (Zamba 2's: each call picks its own adapter among its block's)."""
        return OwnMiddle(self.stored, self.reads_input, layer_idx, self.given)

    def forward(self, *parts: torch.Tensor, x: torch.Tensor | None = None) -> torch.Tensor:
        if not self.reads_input:
            return self.stored(torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0])
        if x is None:
            raise TypeError("this FFN's middle reads the FFN's input: call it with x=")
        self.given.parts = parts
        try:
            return self.stored(x) if self.layer_idx is None else self.stored(x, layer_idx=self.layer_idx)
        finally:
            self.given.parts = ()

    def extra_repr(self) -> str:
        return f"reads_input=True, layer_idx={self.layer_idx}" if self.reads_input else ""


def own_middle(module: nn.Module, ffn: FoundFFN, roles: Mapping[str, str], reads_input: bool = False,
               layer_idx: int | None = None) -> OwnMiddle | None:
    """`module` (a dense MLP, its Linears modules) as `OwnMiddle` under the assignment `roles`; None for experts.
    `reads_input`, `layer_idx`: see `OwnMiddle`."""
    if any(not isinstance(_get(module, name), nn.Module) for name in roles):
        return None
    n = 2 if ffn.gated else 1
    slices = {"w_gate": (0,), "w_up": (1,) if ffn.gated else (0,), "w_gate+w_up": (0, 1), "w_up+w_gate": (1, 0)}
    stored, given = copy.deepcopy(module), Handed()
    for name, role in roles.items():
        parent, _, attr = name.rpartition(".")
        new = (nn.Identity() if role == "w_down" else _Given(*slices[role], given=given) if reads_input
               else _Parts(*slices[role], n=n))
        setattr(stored.get_submodule(parent) if parent else stored, attr, new)
    return OwnMiddle(stored, reads_input, layer_idx, given)


def _get(module: nn.Module, dotted: str) -> Any:
    try:
        return module.get_submodule(dotted)
    except AttributeError:
        return getattr(module, dotted, None)
