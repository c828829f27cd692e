"""What the loaded model's own graph says, one layer at a time: where an FFN input scale can fold, and whether
ffnquant's FFN reproduces the model's module on the same input (`check_reproduction`).

SmoothQuant and AWQ multiply each FFN's input by a per-channel scale and divide the FFN's first matrices by it;
deployed, the scale must live in the gain of the norm that produces the FFN's input. That is exact only when
the norm's output reaches nothing but that FFN. `fold_sites` finds, by running the model once with hooks:

- the producer: the module whose output tensor is the FFN's input (same storage; an FFN reading a reshaped view
  of it counts), and whether it is a norm with a per-channel gain of the model's width;
- the other readers of that tensor: the attention of a parallel block (Falcon, Phi, Cohere), the router and
  shared experts of a mixture-of-experts block;
- the gain form and exactness, numerically: the gain is multiplied by a random scale c (as `n * g`, then as
  `n * (1 + g)`, Gemma's form), the FFN's first matrices divided by c, and the model's output compared with the
  original. A norm whose output is also the residual (post-LN blocks), or an FFN that reads the residual stream
  itself (OLMo 2, EXAONE 4: the norm comes after the FFN), fails this, whatever the names say.

A layer where the fold is not exact gets the reason; the others fold. Nothing of the model is changed (the
weights touched by the check are restored bit for bit).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from .arch import Install, ModelKind, NormGain
from .capture import _first_input, _model_inputs, _module_for, _residual_input
from .ffn_candidates import input_major
from .routed import call_modules, routed_rows
from .checkpoint import LayerInfo, ModelInfo

__all__ = ["FoldSite", "fold_sites", "check_sites", "first_matrices", "FOLD_RTOL", "check_reproduction", "REPRODUCE_RTOL"]

# A fold is exact to float32 rounding: the check scales by c in [0.5, 2] and compares the output; a legal fold
# moves the logits by rounding only (measured 1e-7..1e-6 of their size on the tiny and 135M models), an illegal
# one by the scale itself (1e-1 and more). The bound sits between, two decades from each.
FOLD_RTOL = 1e-4


@dataclass(frozen=True)
class FoldSite:
    """Where `layer`'s input scale would fold: the producing norm (None when no module produces the FFN's input),
    its gain form, the other modules reading that tensor, and why the fold is refused ('' when it is exact)."""

    label: str
    ffn_module: str
    norm: str | None
    gain: NormGain | None
    readers: tuple[str, ...]
    refusal: str
    check_rel_diff: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"layer": self.label, "ffn": self.ffn_module, "norm": self.norm, "gain": None if self.gain is None
                else str(self.gain), "other_readers": list(self.readers), "refusal": self.refusal or None,
                "check_rel_diff": self.check_rel_diff}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage().data_ptr(), t.storage_offset())


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, Mapping):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def _parameter(module: nn.Module, name: str) -> torch.Tensor | None:
    try:
        return module.get_parameter(name)
    except AttributeError:
        return None


def first_matrices(module: nn.Module, info: ModelInfo, layer: LayerInfo) -> list[tuple[torch.Tensor, int]]:
    """The FFN's matrices that read its input, each with the dimension indexing the input channel."""
    arch = info.arch
    out = []
    if arch.install is Install.EXPERTS:
        for name in arch.fused_expert_roles:
            tensor = _parameter(module, name)
            if arch.roles.get(name, "w_down") != "w_down" and tensor is not None:
                # [experts, out, in], input-major [.., in, out], flat [experts x out, in]
                out.append((tensor, tensor.dim() - (2 if input_major(arch, name) else 1)))
        if not out:  # experts as modules (ModuleList)
            expert = module[layer.expert] if isinstance(module, nn.ModuleList) else getattr(module, str(layer.expert))
            for role, weight in arch.roles.items():
                if weight != "w_down" and hasattr(expert, role.split(".")[0]):
                    out.append((expert.get_submodule(role).weight, 1))
        return out
    firsts = [role for role, weight in arch.roles.items() if weight != "w_down" and role in arch.needed_roles(info.spec.gated)]
    for role in firsts:
        target = module.get_submodule(role)
        out.append((target.weight, 0 if arch.transposed else 1))
    return out


def _output(model: nn.Module, info: ModelInfo, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(**_model_inputs(info, model, ids))
    return out.last_hidden_state if info.kind is ModelKind.ENCODER else out.logits


def _trace(model: nn.Module, info: ModelInfo, layers: Sequence[LayerInfo], forward: Callable[[], torch.Tensor],
           ffns: Mapping[LayerInfo, tuple[str, nn.Module]]) -> dict[LayerInfo, tuple[str | None, tuple[str, ...]]]:
    """(producer, other readers) of each FFN's input, from one `forward` pass with hooks on every module."""
    produced: dict[tuple[int, int], str] = {}
    read: dict[tuple[int, int], list[str]] = {}
    ffn_input: dict[LayerInfo, tuple[int, int]] = {}
    by_module = {id(m): [layer for layer in layers if ffns[layer][1] is m] for _, m in ffns.values()}
    handles = []
    alive: list[torch.Tensor] = []  # every tensor seen stays referenced: no freed storage is reused mid-trace


    def pre(name: str, module: nn.Module):
        def hook(mod, args, kwargs):
            for t in _tensors(args) + _tensors(kwargs):
                alive.append(t)
                read.setdefault(_storage(t), []).append(name)
            for layer in by_module.get(id(module), []):
                if info.arch.install is Install.SPLIT:
                    continue
                ffn_input.setdefault(layer, _storage(_first_input(args, kwargs)))
        return hook

    def post(name: str):
        def hook(mod, args, output):
            for t in _tensors(output)[:1]:
                alive.append(t)
                produced.setdefault(_storage(t), name)
        return hook

    for name, module in model.named_modules():
        if not name:
            continue
        handles.append(module.register_forward_pre_hook(pre(name, module), with_kwargs=True))
        handles.append(module.register_forward_hook(post(name)))
    if info.arch.install is Install.SPLIT:  # the FFN is the block's first Linear: its input
        first = info.arch.split_attrs[0]
        def first_input(layer: LayerInfo):
            def hook(mod, args, kwargs):  # returns None: the call's arguments stay as they are
                ffn_input.setdefault(layer, _storage(_first_input(args, kwargs)))
            return hook

        for layer in layers:
            target = ffns[layer][1].get_submodule(first)
            handles.append(target.register_forward_pre_hook(first_input(layer), with_kwargs=True))
    try:
        with torch.no_grad():
            forward()
    finally:
        for h in handles:
            h.remove()
    out = {}
    for layer in layers:
        key = ffn_input.get(layer)
        name = ffns[layer][0]
        first = f"{name}.{info.arch.split_attrs[0]}" if info.arch.install is Install.SPLIT else name
        if key is None:
            out[layer] = (None, ())
            continue
        producer = produced.get(key)
        within = lambda r: r == first or r.startswith(first + ".") or first.startswith(r + ".")  # noqa: E731
        readers = tuple(dict.fromkeys(r for r in read.get(key, []) if not within(r) and r != producer))
        out[layer] = (producer, readers)
    return out


def _is_norm(module: nn.Module, d: int) -> bool:
    weight = getattr(module, "weight", None)
    params = list(module.parameters(recurse=False))
    return (isinstance(weight, torch.Tensor) and tuple(weight.shape) == (d,)
            and all(p.dim() == 1 for p in params) and not any(True for _ in module.children()))


def _check(model: nn.Module, info: ModelInfo, layer: LayerInfo, ffn: nn.Module, norm: nn.Module, gain: NormGain,
           forward: Callable[[], torch.Tensor], reference: torch.Tensor) -> float:
    """Relative change of the model's output when `norm` takes a random scale in `gain`'s form and the FFN's
    first matrices its inverse (1.0 when the scale makes the output non-finite)."""
    gen = torch.Generator().manual_seed(1234 + layer.index)
    c = torch.exp(torch.empty(norm.weight.shape[0], dtype=torch.float64).uniform_(-0.7, 0.7, generator=gen))
    c = c.to(norm.weight.device)  # drawn on the host: the same scale wherever the layer is
    saved = [(t, t.detach().clone()) for t in [norm.weight, getattr(norm, "bias", None)] if isinstance(t, torch.Tensor)]
    mats = first_matrices(ffn, info, layer)
    saved += [(w, w.detach().clone()) for w, _ in mats]
    try:
        with torch.no_grad():
            g = norm.weight.double()
            new = (1.0 + g) * c - 1.0 if gain is NormGain.ONE_PLUS_GAIN else g * c
            norm.weight.copy_(new.to(norm.weight.dtype))
            bias = getattr(norm, "bias", None)
            if isinstance(bias, torch.Tensor):
                bias.copy_((bias.double() * c).to(bias.dtype))
            for w, dim in mats:
                shape = [1] * w.dim()
                shape[dim] = -1
                w.copy_((w.double() / c.view(shape)).to(w.dtype))
            got = forward()
    finally:
        with torch.no_grad():
            for t, old in saved:
                t.copy_(old)
    if not torch.isfinite(got).all():
        return 1.0
    return float((got.double() - reference.double()).abs().max() / reference.double().abs().max().clamp_min(1e-30))


def fold_sites(model: nn.Module, info: ModelInfo, layers: Sequence[LayerInfo], ids: torch.Tensor | None = None,
               run: Callable[[], torch.Tensor] | None = None) -> dict[LayerInfo, FoldSite]:
    """Each layer's FoldSite (see the module docstring), from the model run on `ids` ([1, 24] tokens by default),
    or from `run()`: a forward through part of `model` (the engine's one decoder layer) whose output the check
    compares."""
    if run is None and ids is None:
        vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", 32))
        ids = torch.randint(3, max(vocab, 4), (1, 24), generator=torch.Generator().manual_seed(0))
    names = [n for n, _ in model.named_modules()]
    # every expert of a layer shares one module (and one norm): the checks run per block
    ffns = {layer: _module_for(model, info, layer, names) for layer in layers}
    forward = run if run is not None else lambda: _output(model, info, ids)
    traced = _trace(model, info, layers, forward, ffns)
    with torch.no_grad():
        reference = forward()
    d = info.spec.d_model
    out: dict[LayerInfo, FoldSite] = {}
    by_block: dict[tuple[str, int], FoldSite] = {}
    for layer in layers:
        key = (layer.stack, layer.block)
        if key in by_block:
            out[layer] = _relabel(by_block[key], layer)
            continue
        name, module = ffns[layer]
        producer, readers = traced[layer]
        site = _decide(model, info, layer, name, module, producer, readers, d, forward, reference)
        by_block[key] = site
        out[layer] = site
    return out


def _relabel(site: FoldSite, layer: LayerInfo) -> FoldSite:
    return FoldSite(layer.label, site.ffn_module, site.norm, site.gain, site.readers, site.refusal, site.check_rel_diff)


def _decide(model: nn.Module, info: ModelInfo, layer: LayerInfo, name: str, module: nn.Module, producer: str | None,
            readers: tuple[str, ...], d: int, forward: Callable[[], torch.Tensor], reference: torch.Tensor) -> FoldSite:
    if producer is None:
        return FoldSite(layer.label, name, None, None, readers,
                        "no module produces the FFN's input: it is computed in the block's forward (the residual "
                        "stream, as when the norm comes after the FFN), so no norm gain can take a scale")
    norm = model.get_submodule(producer)
    if not _is_norm(norm, d):
        return FoldSite(layer.label, name, producer, None, readers,
                        f"the FFN's input comes from {producer} ({type(norm).__name__}), not a norm with a per-channel "
                        f"gain of width {d}")
    if readers:
        return FoldSite(layer.label, name, producer, None, readers,
                        f"{producer}'s output is also read by {', '.join(readers)}: scaling the norm would change "
                        f"{'it' if len(readers) == 1 else 'them'} too")
    # both gain forms are tried; the one that reproduces the output (by far the smaller change) is the norm's
    tried = {gain: _check(model, info, layer, module, norm, gain, forward, reference)
             for gain in (NormGain.GAIN, NormGain.ONE_PLUS_GAIN)}
    gain, worst = min(tried.items(), key=lambda kv: kv[1])
    if worst <= FOLD_RTOL:
        return FoldSite(layer.label, name, producer, gain, (), "", worst)
    return FoldSite(layer.label, name, producer, None, (),
                    f"folding a scale into {producer} changes the model's output by {worst:.2g} of its size (bound "
                    f"{FOLD_RTOL:g}): its output reaches the layer's output another way than through the FFN "
                    "(e.g. as the residual of a post-LN block)", worst)


def check_sites(sites: Mapping[LayerInfo, FoldSite], wanted: Sequence[LayerInfo]) -> None:
    """Raise, naming every layer and its reason, when any of `wanted` cannot fold its input scale."""
    bad = [sites[layer] for layer in wanted if sites[layer].refusal]
    if bad:
        detail = "; ".join(f"{s.label}: {s.refusal}" for s in bad[:4]) + (f"; and {len(bad) - 4} more" if len(bad) > 4 else "")
        raise FFNQuantError(f"cannot fold the FFN input scale (SmoothQuant/AWQ) of layer(s) "
                            f"{', '.join(s.label for s in bad)} into a norm: {detail}")


# ffnquant's FFN against the model's module on the same input: float32 summation order (addmm vs matmul + add,
# gelu_new's formula vs torch's tanh GELU) moves the output by a few ulps of its size; a wrong role or
# activation by its own size
REPRODUCE_RTOL = 1e-5


def check_reproduction(model: nn.Module, info: ModelInfo, layers: Any, ids: torch.Tensor | None = None,
                       run: Callable[[], Any] | None = None) -> dict[str, float]:
    """Each layer's ffnquant FFN (`HFLayer.ffn`) run on the input the loaded model's own FFN module received for
    `ids` (or in `run()`, a forward through part of the model: the engine's one decoder layer), against that
    module's output: {label: relative difference}. Raises, naming every layer beyond REPRODUCE_RTOL with its
    module, before anything is quantized."""
    names = [n for n, _ in model.named_modules()]
    arch = info.arch
    seen: dict[str, tuple[tuple, torch.Tensor]] = {}
    handles = []

    def keep(key: str):
        def hook(module, args, kwargs, out):  # returns None: the output passes unchanged
            if key not in seen:
                # routed experts: what the call hands each expert, with its experts and weights
                inputs = (routed_rows(module, args, kwargs) if arch.install is Install.EXPERTS
                          else (_first_input(args, kwargs),))
                y = out[0] if isinstance(out, (tuple, list)) else out
                if arch.residual_arg:  # the module returned FFN(x) + residual: the FFN's part is compared
                    y = y - _residual_input(args, kwargs)
                seen[key] = (tuple(t.detach().clone() for t in inputs), y.detach().clone())
        return hook

    def keep_rows(key: str):  # experts' matrices as child modules: the rows the first one is handed
        def hook(module, args, kwargs):
            if key + ":in" not in seen:
                seen[key + ":in"] = (tuple(t.detach().clone() for t in routed_rows(module, args, kwargs)), None)
        return hook

    def keep_outputs(key: str):  # ... and the rows down returns, each its expert's output
        def hook(module, args, out):
            if key not in seen and key + ":in" in seen:
                seen[key] = (seen.pop(key + ":in")[0], out.detach().clone())
        return hook

    def keep_split(key: str, part: str):
        def hook(module, args, out):
            if key + part not in seen:
                seen[key + part] = ((args[0].detach().clone(),), out.detach().clone())
        return hook

    blocks: dict[str, list[Any]] = {}
    for layer in layers:
        name, module = _module_for(model, info, layer.info, names)
        if name not in blocks:
            if arch.install is Install.SPLIT:
                first, _, second = arch.split_attrs
                handles.append(module.get_submodule(first).register_forward_hook(keep_split(name, ":in")))
                handles.append(module.get_submodule(second).register_forward_hook(keep_split(name, ":out")))
            elif arch.matrix_experts:
                first, down = call_modules(module, arch)
                handles.append(first.register_forward_pre_hook(keep_rows(name), with_kwargs=True))
                handles.append(down.register_forward_hook(keep_outputs(name)))
            else:
                handles.append(module.register_forward_hook(keep(name), with_kwargs=True))
        blocks.setdefault(name, []).append(layer)
    try:
        with torch.no_grad():
            if run is not None:
                run()
            else:
                model(**_model_inputs(info, model, ids))
    finally:
        for h in handles:
            h.remove()
    out: dict[str, float] = {}
    bad = []
    # the modules ran where the model computes (a GPU under --device cuda); ffnquant's FFNs are compared where they are
    where = next(layers[0].ffn.parameters()).device if layers else torch.device("cpu")
    seen = {key: (tuple(t.to(where) for t in args), want.to(where)) for key, (args, want) in seen.items()}
    for name, group in blocks.items():
        with torch.no_grad():
            if arch.install is Install.SPLIT:
                x, want = seen[name + ":in"][0][0], seen[name + ":out"][1]
                got = group[0].ffn(x.reshape(-1, x.shape[-1])).reshape(want.shape)
            elif arch.install is Install.EXPERTS:
                (x, index, weights), want = seen[name]
                x = x.reshape(-1, x.shape[-1])
                got = torch.zeros_like(x)
                for layer in group:  # the model's routing: each token's experts, weighted
                    token, slot = torch.where(index == layer.info.expert)
                    if token.numel():
                        got.index_add_(0, token, layer.ffn(x[token]) * weights[token, slot, None])
                got = got.reshape(want.shape)
            else:
                (x, *_), want = seen[name]
                got = group[0].ffn(x.reshape(-1, x.shape[-1])).reshape(want.shape)
        rel = float((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(1e-30))
        for layer in group:
            out[layer.label] = rel
        if not rel <= REPRODUCE_RTOL:
            bad.append(f"{group[0].info.label} ({name}): {rel:.2g} relative")
    if bad:
        raise FFNQuantError(f"ffnquant's FFN does not reproduce the model's own module on the same input (bound "
                            f"{REPRODUCE_RTOL:g}) in layer(s) {'; '.join(bad[:4])}{' and more' if len(bad) > 4 else ''}; "
                            "those layers cannot be quantized faithfully")
    return out
