"""FFN modules: one class for the whole family, variant chosen by registry key.

Every tensor site (`spec.SITES`) passes through a named `SiteTap` (an identity module),
so observers and fake-quantizers attach with ordinary forward hooks and the float math
is unchanged. Two further identity slots, `input_transform` and `hidden_transform`, are
where outlier remedies put an explicit per-channel scale or a rotation; they are
identities in a plain FFN and vanish from the exported graph.
"""

from __future__ import annotations

import copy
import math
import os
from pathlib import Path
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from .infra.atomic import atomic_path
from .errors import FFNQuantError
from .infra.resources import check_memory, regular_file
from .spec import Activation, FFNSpec

__all__ = ["ACTIVATIONS", "OWN_ACTIVATIONS", "SiteTap", "UnloadedActivation", "FFN", "build", "check_fits", "save_weights", "load_weights"]


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


def _relu2(x: torch.Tensor) -> torch.Tensor:
    # transformers' ReLUSquaredActivation, operation for operation: relu, then square (bit for bit the same)
    return torch.square(F.relu(x))


ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    Activation.RELU: F.relu,
    Activation.GELU: F.gelu,
    Activation.GELU_TANH: _gelu_tanh,
    Activation.SILU: F.silu,
    Activation.SIGMOID: torch.sigmoid,
    Activation.IDENTITY: _identity,
    Activation.RELU2: _relu2,
}


# computed by the model's own module, which an FFN loaded from the model is given (`FFN(..., activation=)`)
OWN_ACTIVATIONS = frozenset({Activation.OWN, Activation.OWN_GATE})


class UnloadedActivation(nn.Module):
    """Stands for a model's own activation (`OWN_ACTIVATIONS`) in an FFN built without it: running it refuses."""

    def forward(self, *x: torch.Tensor) -> torch.Tensor:
        raise FFNQuantError("this FFN computes its model's own activation module (activation 'own'), which it was "
                            "built without: load the layer from its model (hf.load_ffn_layers) or pass activation=")


class SiteTap(nn.Identity):
    """An identity marking a named tensor site; hooks on it observe or replace the tensor."""

    def __init__(self, site: str) -> None:
        super().__init__()
        self.site = site

    def extra_repr(self) -> str:
        return self.site


class FFN(nn.Module):
    """Position-wise FFN: dense `down(act(up(x)))` or gated `down(act(gate(x)) * up(x))`; with a model's own gate
    function (`Activation.OWN_GATE`), `down(fn(gate(x), up(x)))`."""

    def __init__(self, spec: FFNSpec, dtype: torch.dtype = torch.float32, activation: nn.Module | None = None) -> None:
        """`activation`: the model's own activation module, for a spec whose activation is `Activation.OWN` (a
        submodule, so its learned parameters move, copy and cast with the FFN's)."""
        super().__init__()
        if activation is not None and spec.activation not in OWN_ACTIVATIONS:
            raise FFNQuantError(f"an FFN takes an activation module only where its spec's activation is 'own' or "
                                f"'own_gate' (this one's is {spec.activation.value!r})")
        if spec.activation is Activation.OWN_GATE and not spec.gated:
            raise FFNQuantError("activation 'own_gate' is a function of gate and up: a gated FFN's only")
        check_fits(spec, spec.n_params * _itemsize(dtype))
        self.spec = spec
        d, f, bias = spec.d_model, spec.d_ff, bool(spec.bias)
        self.w_up = nn.Linear(d, f, bias=bias, dtype=dtype)
        self.w_gate = nn.Linear(d, f, bias=bias, dtype=dtype) if spec.gated else None
        self.w_down = nn.Linear(f, d, bias=bias, dtype=dtype)
        self.activation: Callable[[torch.Tensor], torch.Tensor] = (
            activation if activation is not None
            else UnloadedActivation() if spec.activation in OWN_ACTIVATIONS else ACTIVATIONS[spec.activation])
        self.input_transform: nn.Module = nn.Identity()
        self.hidden_transform: nn.Module = nn.Identity()
        self.taps = nn.ModuleDict({s: SiteTap(s) for s in spec.sites})

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., d_model)
        # a model's own middle that reads the FFN's input beside its Linears (Zamba 2's adapters) reads it as the
        # model's module does: unquantized, before any input scale (deployment refuses to fold one there)
        own_input = {"x": x} if getattr(self.activation, "reads_input", False) else {}
        x = self.taps["input"](self.input_transform(x))  # (..., d)
        up = self.taps["up"](self.w_up(x))  # (..., f)
        if self.w_gate is not None:
            gate_pre = self.taps["gate_pre"](self.w_gate(x))  # (..., f)
            if self.spec.activation is Activation.OWN_GATE:  # the model's own function of both (`OWN_GATE`)
                hidden = act = self.taps["act"](self.activation(gate_pre, up, **own_input))  # (..., f)
            else:
                act = self.taps["act"](self.activation(gate_pre))  # (..., f)
                hidden = act * up  # (..., f)
        else:
            act = self.taps["act"](self.activation(up, **own_input))  # (..., f)
            hidden = act
        hidden = self.taps["hidden"](self.hidden_transform(hidden))  # (..., f)
        return self.taps["output"](self.w_down(hidden))  # (..., d)

    @classmethod
    def from_state(cls, spec: FFNSpec, state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                   activation: nn.Module | None = None) -> "FFN":
        """The FFN of `spec` holding `state`'s tensors themselves (every parameter, as `state_dict` names them), on
        their device: no random initialisation of weights about to be replaced (~1 s a layer at 8B shapes).
        `activation` (`Activation.OWN`): the model's own module, its tensors as they are (not in `state`)."""
        with torch.device("meta"):
            ffn = cls(spec, dtype=dtype)
        ffn.load_state_dict(dict(state), strict=True, assign=True)
        if activation is not None:
            ffn.activation = activation
        return ffn

    def own_activation(self) -> nn.Module | None:
        """A copy of the model's own activation module this FFN computes (`Activation.OWN`), else None: what a new
        FFN made from this one's spec and weights is given (`FFN.from_state(..., activation=)`)."""
        return copy.deepcopy(self.activation) if self.spec.activation in OWN_ACTIVATIONS else None

    def weights(self) -> dict[str, torch.Tensor]:
        """The weight matrices by site name (w_up, [w_gate,] w_down), [out, in] layout."""
        return {name: getattr(self, name).weight for name in self.spec.weight_names}

    def extra_repr(self) -> str:
        return f"variant={self.spec.variant.value}, d_model={self.spec.d_model}, d_ff={self.spec.d_ff}"


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def check_fits(spec: FFNSpec, n_bytes: int) -> None:
    """Refuse, before allocating, an FFN whose weights (`n_bytes` with what building them needs) do not fit in memory.

    Every FFN is made through `FFN(...)` (and `build`), so this one check covers each command that makes one.
    """
    check_memory(
        n_bytes,
        f"{spec.variant.value} at d_model {spec.d_model} (d_ff {spec.d_ff})",
        "choose a smaller d_model (or d_ff)",
        "for its weights",
    )


def build(spec: FFNSpec, seed: int = 0, dtype: torch.dtype = torch.float32) -> FFN:
    """Build an FFN with deterministic weights: N(0, 1/fan_in) weights, U(+-1/sqrt(fan_in)) biases."""
    # The fp32 weights, the one random matrix drawn before it is copied in, and a copy in `dtype`.
    largest = max(r * c for r, c in spec.weight_shapes.values())
    cast = spec.n_params * _itemsize(dtype) if dtype != torch.float32 else 0
    check_fits(spec, (spec.n_params + largest) * 4 + cast)
    model = FFN(spec, dtype=torch.float32)
    gen = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name in spec.weight_names:
            lin: nn.Linear = getattr(model, name)
            fan_in = lin.in_features
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=gen) / math.sqrt(fan_in))
            if lin.bias is not None:
                bound = 1.0 / math.sqrt(fan_in)
                lin.bias.copy_((torch.rand(lin.bias.shape, generator=gen) * 2 - 1) * bound)
    return model.to(dtype).eval()


def _state_for_file(model: FFN) -> dict[str, torch.Tensor]:
    state = {}
    for name in model.spec.weight_names:
        lin: nn.Linear = getattr(model, name)
        state[f"{name}.weight"] = lin.weight.detach().contiguous().cpu()
        if lin.bias is not None:
            state[f"{name}.bias"] = lin.bias.detach().contiguous().cpu()
    return state


def save_weights(model: FFN, path: str | os.PathLike) -> Path:
    """Save weights (and the spec as metadata) to a safetensors file, atomically."""
    from safetensors.torch import save_file
    import json

    meta = {"ffnquant_spec": json.dumps(model.spec.to_dict(), sort_keys=True)}
    with atomic_path(path) as tmp:
        save_file(_state_for_file(model), str(tmp), metadata=meta)
    return Path(path)


def load_weights(path: str | os.PathLike, spec: FFNSpec | None = None) -> FFN:
    """Load an FFN from a safetensors file written by `save_weights` (spec from its metadata unless given)."""
    from safetensors import safe_open
    import json

    path = regular_file(path, "weights file")  # a FIFO would block safe_open forever
    try:
        with safe_open(str(path), framework="pt") as fh:
            meta = fh.metadata() or {}
            tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    except Exception as exc:  # safetensors raises several types for corrupt files
        raise FFNQuantError(f"cannot read safetensors file {str(path)!r}: {exc}") from exc
    if spec is None:
        if "ffnquant_spec" not in meta:
            raise FFNQuantError(f"{str(path)!r} has no ffnquant_spec metadata; pass the spec explicitly")
        spec = FFNSpec.from_dict(json.loads(meta["ffnquant_spec"]))
    model = FFN(spec)
    expected = _state_for_file(model)
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise FFNQuantError(f"{str(path)!r} does not match {spec.key}: missing {missing}, unexpected {extra}")
    for key, ref in expected.items():
        if tuple(tensors[key].shape) != tuple(ref.shape):
            raise FFNQuantError(
                f"{str(path)!r}: tensor {key} has shape {tuple(tensors[key].shape)}, expected {tuple(ref.shape)}"
            )
    model.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
    return model.eval()
