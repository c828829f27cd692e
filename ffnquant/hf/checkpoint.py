"""Read a local Hugging Face model folder's FFN layers into ffnquant `FFN` modules.

Only config.json and the FFN tensors are read; tensors are opened lazily with
`safetensors.safe_open`, so a large model costs the memory of the layers asked for.
Pickled checkpoints (.bin/.pt/.pth) are refused unless the caller opts in, and then read
with `torch.load(weights_only=True)`, which unpickles tensors only.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
from torch import nn

from ..errors import FFNQuantError
from ..infra.resources import non_regular_entries, os_reason, read_text as read_file_text
from ..model import FFN
from ..numerics.primitives import all_finite
from ..spec import Activation, FFNSpec
from .arch import Arch, ModelKind, ffn_variant, hf_activation
from .conversions import unread_conversions
from .discover import arch_for_config
from .ffn_candidates import expert_matrices, input_major
from .validate import check_attention_config, check_other_tensors
from .weights import _Weights  # read here, and from here by other modules

__all__ = [
    "LayerInfo",
    "ModelInfo",
    "HFLayer",
    "read_config",
    "parse_layers",
    "inspect_model",
    "iter_ffn_layers",
    "load_ffn_layers",
]



@dataclass(frozen=True)
class LayerInfo:
    """Where one FFN lives: global layer index, stack/block, expert, tensor name prefix, tensors by role."""

    index: int
    stack: str
    block: int
    expert: int | None
    name: str
    tensors: Mapping[str, str] = field(compare=False)  # role -> checkpoint tensor name ("role.kind")
    fused_expert_tensors: bool = False
    shares: int | None = None  # the layer whose FFN this one calls again, its weights stored once (Zamba's)

    @property
    def root(self) -> tuple[int, int | None]:
        """The FFN this layer calls: (the first layer holding its weights, its expert). Layers calling one FFN again
        (Zamba's shared transformer) have one root: quantized once, from every call's inputs."""
        return (self.shares if self.shares is not None else self.index, self.expert)

    @property
    def label(self) -> str:
        """Short human name: 'L3', 'L3.e1', 'encoder L0'."""
        base = f"L{self.index}" + (f".e{self.expert}" if self.expert is not None else "")
        return base

    def to_dict(self) -> dict[str, Any]:
        return {"index": self.index, "stack": self.stack, "block": self.block, "expert": self.expert,
                "name": self.name, "label": self.label, **({"shares": self.shares} if self.shares is not None else {})}


@dataclass(frozen=True)
class ModelInfo:
    """What `inspect_model` finds: architecture, variant, sizes and the FFN layers (no weights read)."""

    path: Path
    model_type: str
    arch: Arch
    hf_activation: str
    spec: FFNSpec
    n_layers: int  # transformer blocks with an FFN (all stacks)
    n_experts: int | None
    layers: tuple[LayerInfo, ...]
    weight_files: tuple[str, ...]
    weights_format: str  # "safetensors" or "pickle"
    config: Mapping[str, Any] = field(repr=False, default_factory=dict)
    n_params_total: int = 0  # elements of every tensor in the weight files (what loading the model takes)

    @property
    def kind(self) -> ModelKind:
        return self.arch.kind

    def shared_groups(self) -> tuple[tuple[int, ...], ...]:
        """The layers that call one FFN (its weights shared, `LayerInfo.shares`), each group in layer order: one
        quantization serves them all, so a plan gives them one recipe."""
        groups: dict[int, set[int]] = {}
        for layer in self.layers:
            if layer.shares is not None:
                groups.setdefault(layer.shares, {layer.shares}).add(layer.index)
        return tuple(tuple(sorted(g)) for _, g in sorted(groups.items()))

    def check_selection(self, indices: Any) -> None:
        """Refuse a layer selection that takes some calls of a shared FFN and not the others: the model stores one
        set of its weights, so quantizing it in one call and not another measures no model that can be deployed."""
        chosen = set(indices)
        for calls in self.shared_groups():
            picked = [i for i in calls if i in chosen]
            if picked and len(picked) < len(calls):
                left = [i for i in calls if i not in chosen]
                raise FFNQuantError(
                    f"--layers selects {', '.join(f'L{i}' for i in picked)} but not {', '.join(f'L{i}' for i in left)}, "
                    f"which call the same FFN (its weights shared, stored once): select all of its calls "
                    f"({','.join(map(str, calls))}) or none")

    def calls_differ(self) -> bool:
        """Whether the layers calling one FFN compute different functions with it: the model's own middle is passed
        the calling layer's index (Zamba 2's shared MLP adds each call's own adapter of its input to gate and up)."""
        return bool(self.shared_groups()) and getattr(self.arch.activation_template, "layer_idx", None) is not None

    def block_params(self) -> dict[str, Any]:
        """The model's own block arithmetic from config.json: each block's FFN parameters (every expert of a
        mixture-of-experts block), its attention's (`arch.attention_shape`: grouped-query heads counted as
        config.json gives them; a seq2seq decoder block's cross-attention counted too) and the FFN's share
        of the blocks' FFN + attention parameters (None when config.json names no head count)."""
        from .arch import attention_shape

        ffn = self.spec.n_params * (self.n_experts or 1)
        attn = attention_shape(self.config, self.spec.d_model, self.spec.bias)
        out: dict[str, Any] = {"model_type": self.model_type, "ffn_params_per_block": ffn, "attention": attn,
                               "ffn_share": None}
        if attn is None:
            out["reason"] = "config.json names no attention head count"
            return out
        per_stack = self.arch.n_layers(self.config, "config.json")
        blocks = sum(per_stack.values())
        cross = per_stack.get("decoder", 0) if self.kind is ModelKind.SEQ2SEQ else 0
        attention_total = attn["params"] * (blocks + cross)
        out.update(cross_attention_blocks=cross, blocks=blocks,
                   ffn_share=ffn * blocks / (ffn * blocks + attention_total))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "model_type": self.model_type,
            "kind": self.kind.value,
            "variant": self.spec.variant.value,
            "activation": self.spec.activation.value,
            "hf_activation": self.hf_activation,
            "spec": self.spec.to_dict(),
            "n_layers": self.n_layers,
            "n_experts": self.n_experts,
            "n_ffns": len(self.layers),
            "ffn_params_total": self.spec.n_params * sum(1 for layer in self.layers if layer.shares is None),
            "block_params": self.block_params(),
            "weight_files": list(self.weight_files),
            "weights_format": self.weights_format,
            "layers": [layer.to_dict() for layer in self.layers],
        }


@dataclass
class HFLayer:
    """One loaded FFN of a checkpoint: index, expert (or None), module name prefix, FFN, spec, activation."""

    index: int
    expert: int | None
    name: str
    ffn: FFN
    spec: FFNSpec
    activation: str  # the transformers activation name from config.json
    info: LayerInfo
    block: Mapping[str, Any] | None = None  # the model's block arithmetic (`ModelInfo.block_params`)

    @property
    def label(self) -> str:
        return self.info.label


# transformers writes a non-finite float of a config as {"__float__": "Infinity"} (JSON has no Infinity) and reads it
# back as the float; so does ffnquant, which hands config.json's values to transformers' config classes
_SPECIAL_FLOATS = {"Infinity": math.inf, "-Infinity": -math.inf, "NaN": math.nan}


def _special_float(obj: dict[str, Any]) -> Any:
    if len(obj) == 1 and isinstance(obj.get("__float__"), str) and obj["__float__"] in _SPECIAL_FLOATS:
        return _SPECIAL_FLOATS[obj["__float__"]]
    return obj


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """config.json of a model folder, with a one-line error if absent or unreadable."""
    folder = Path(path)
    try:
        is_dir = folder.is_dir()
    except OSError as exc:  # a parent folder without search permission
        raise FFNQuantError(f"model folder {str(folder)!r} cannot be accessed: {os_reason(exc)}") from None
    if not is_dir:
        raise FFNQuantError(f"model folder {str(folder)!r} does not exist or is not a folder")
    cfg = folder / "config.json"
    if not os.path.lexists(cfg):
        raise FFNQuantError(f"{str(cfg)!r} is missing: a Hugging Face model folder needs config.json")
    text = read_file_text(cfg, "model config")
    try:
        data = json.loads(text, object_hook=_special_float)
    except json.JSONDecodeError as exc:
        raise FFNQuantError(f"{str(cfg)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise FFNQuantError(f"{str(cfg)!r} must hold a JSON object")
    return data


def parse_layers(selection: str | int | list[int] | None, n_layers: int) -> list[int]:
    """Layer indices from 'all', '0-3', '0,5,7' (ranges and lists mix: '0-2,7'), an int or a list."""
    if selection is None or (isinstance(selection, str) and selection.strip().lower() in ("", "all")):
        return list(range(n_layers))
    if isinstance(selection, int) and not isinstance(selection, bool):
        items: list[int] = [selection]
    elif isinstance(selection, (list, tuple)):
        items = [int(i) for i in selection]
    else:
        items = []
        for part in str(selection).split(","):
            part = part.strip()
            m = re.fullmatch(r"(\d+)\s*-\s*(\d+)|(\d+)", part)
            if not m:
                raise FFNQuantError(f"layer selection {selection!r}: {part!r} is not N, A-B or 'all'")
            if m.group(3) is not None:
                items.append(int(m.group(3)))
            else:
                lo, hi = int(m.group(1)), int(m.group(2))
                if hi < lo:
                    raise FFNQuantError(f"layer selection {selection!r}: range {part!r} is empty")
                items.extend(range(lo, hi + 1))
    bad = sorted({i for i in items if not 0 <= i < n_layers})
    if bad:
        raise FFNQuantError(f"layer selection {selection!r}: layer(s) {bad} out of range; the model has layers 0-{n_layers - 1}")
    return sorted(set(items))


# --- tensor access ------------------------------------------------------------------


@dataclass
class _Found:
    prefix: str
    tensors: dict[str, str]
    fused: bool = False


def _group_tensors(arch: Arch, names: list[str]) -> dict[tuple[str, int, int | None], _Found]:
    pattern = re.compile(arch.tensor_pattern)
    fused = re.compile(arch.fused_experts_pattern) if arch.fused_experts_pattern else None
    groups: dict[tuple[str, int, int | None], _Found] = {}
    for name in names:
        m = pattern.fullmatch(name)
        is_fused = False
        if m is None and fused is not None:
            m = fused.fullmatch(name)
            is_fused = m is not None
        if m is None:
            continue
        gd = m.groupdict()
        expert = int(gd["expert"]) if gd.get("expert") is not None else None
        key = (gd.get("stack") or "", int(gd["layer"]), expert)
        role = gd["role"] + (("." + gd["kind"]) if not is_fused else ".bias" if gd.get("bias") else "")
        found = groups.setdefault(key, _Found(gd["prefix"], {}, is_fused))
        if found.prefix != gd["prefix"]:
            raise FFNQuantError(
                f"ambiguous checkpoint: FFN tensors for the same layer under {found.prefix!r} and {gd['prefix']!r}"
            )
        found.tensors[role] = name
    return groups


def _expected_shape(arch: Arch, weight: str, kind: str, d: int, f: int) -> tuple[int, ...]:
    n_out = {"w_up": f, "w_gate": f, "w_down": d, "w_gate+w_up": 2 * f, "w_up+w_gate": 2 * f}[weight]
    n_in = d if weight != "w_down" else f
    if kind == "bias":
        return (n_out,)
    return (n_in, n_out) if arch.transposed else (n_out, n_in)


def inspect_model(path: str | os.PathLike, allow_pickle: bool = False) -> ModelInfo:
    """Detect architecture, variant, sizes and every FFN layer of a model folder, and check that config.json and
    the tensors agree (heads, shapes, dtypes, a finite embedding); reads no tensor data but the embedding's."""
    folder = Path(path)
    config = read_config(folder)
    # transformers and tokenizers open files of the folder by many names; a FIFO or device among them
    # would block or stream forever, so any such entry is refused up front.
    odd = non_regular_entries(folder, "model folder")
    if odd:
        name, kind = odd[0]
        raise FFNQuantError(
            f"{str(folder / name)!r} is {kind}, not a regular file; a model folder holds regular files "
            "(config.json, weights, tokenizer): replace or remove it"
        )
    cfg_file = str(folder / "config.json")

    arch = arch_for_config(config, cfg_file)
    d, f = arch.d_model(config, cfg_file), arch.d_ff(config, cfg_file)
    act_name, gated = arch.activation(config, cfg_file)
    if arch.activation_template is not None:  # the model's own activation module ("own" or "own_gate")
        activation, act_name = Activation(act_name), f"{act_name} ({_own_class(arch)})"
    else:
        activation = hf_activation(act_name, cfg_file)
    variant, override = ffn_variant(activation, gated, cfg_file)
    per_stack = arch.n_layers(config, cfg_file)
    n_experts = arch.n_experts(config, cfg_file)
    check_attention_config(config, d, cfg_file)
    weights = _Weights(folder, allow_pickle)
    groups = _group_tensors(arch, sorted(weights.file_of))
    needed_now = arch.needed_roles(gated)
    partial = any(not g.fused and any(f"{r}.weight" not in g.tensors for r in needed_now) for g in groups.values())
    # stored under names transformers renames or converts as it loads (HRM's gate_up_proj, chunked into gate_proj
    # and up_proj): read by those names
    if (not groups or partial) and weights.rename_as_loaded(arch.name):
        groups = _group_tensors(arch, weights.names)
    where = weights.files[0] if len(weights.files) == 1 else "model.safetensors.index.json"
    where = str(folder / where)
    check_other_tensors(weights, config, d, (arch.fixed or {}).get("shapes"))

    if any(g.fused for g in groups.values()):
        groups = _expand_fused(groups, n_experts or 0, where)

    stacks = [s for s, _ in arch.stacks]
    for key in groups:
        stack, block, expert = key
        if block >= per_stack[stack]:
            any_tensor = next(iter(groups[key].tensors.values()))
            raise FFNQuantError(
                f"{where}: tensor {any_tensor!r} is for layer {block}, but config.json says "
                f"{per_stack[stack]} {stack + ' ' if stack else ''}layers"
            )
        if expert is not None and (n_experts is None or expert >= n_experts):
            raise FFNQuantError(f"{where}: tensor {next(iter(groups[key].tensors.values()))!r} is for expert {expert}, "
                                f"but config.json says {n_experts} experts")
    needed = arch.needed_roles(gated)
    bias = any(role.endswith(".bias") for g in groups.values() for role in g.tensors)
    spec = FFNSpec(variant, d_model=d, d_ff=f, bias=bias, activation_override=override)

    layers: list[LayerInfo] = []
    index = 0
    template = next(iter(groups.values())).prefix if groups else None
    kept = (arch.fixed or {}).get("blocks")  # a discovered model's blocks with the main FFN (others stay float)
    shares = (arch.fixed or {}).get("shares") or {}  # blocks calling an earlier block's FFN, stored once under its names
    # a looped depth (`hf.looped`): one layer per call of a block, in call order; a later call of a block calls the
    # FFN of its first call again (stored once, as a shared FFN)
    calls = tuple((arch.fixed or {}).get("calls") or ())
    for stack in stacks:
        first_call: dict[int, int] = {}
        for block in calls or range(per_stack[stack]):
            if kept is not None and block not in kept:
                index += 1
                continue
            again = first_call.setdefault(block, index) if calls else index
            shared = again if again != index else shares.get(block)
            experts: list[int | None] = list(range(n_experts)) if n_experts else [None]
            for expert in experts:
                found = groups.get((stack, block, expert))
                if found is None and block in shares:
                    found = groups.get((stack, shares[block], expert))
                if found is None:
                    unread = unread_conversions(arch.name, sorted(arch.roles)) if arch.discovered else []
                    if unread:  # made by transformers as it loads, from stored tensors ffnquant cannot convert
                        raise FFNQuantError(
                            f"{where}: {arch.name} stores its FFN's tensors in a form transformers converts as it "
                            f"loads, by operations ffnquant does not apply: {unread[0]}"
                            f"{f' (and {len(unread) - 1} more)' if len(unread) > 1 else ''}; ffnquant reads stored "
                            "tensors that transformers renames, reorders (Interleave) or splits (Chunk)")
                    hint = f" (e.g. under {template!r} for another layer)" if template else ""
                    what = f"layer {block}" + (f" expert {expert}" if expert is not None else "")
                    where_stack = f"{stack} " if stack else ""
                    expected = needed or arch.fused_expert_roles
                    raise FFNQuantError(
                        f"{where}: no {arch.name} FFN tensors for {where_stack}{what}{hint}; expected "
                        + (f"{', '.join(expected)} (gated={gated} from config.json)" if expected else
                           "the tensors of the modules the model's FFN is made of")
                    )
                tensors = dict(found.tensors)
                needed = arch.fused_expert_roles if found.fused else arch.needed_roles(gated)
                for role in needed:
                    if f"{role}.weight" not in tensors and role not in tensors:
                        raise FFNQuantError(
                            f"{where}: tensor {found.prefix + '.' + role + '.weight'!r} is missing "
                            f"({arch.name} {'gated' if gated else 'dense'} FFN needs {', '.join(needed)})"
                        )
                extra = sorted(r.rsplit(".", 1)[0] for r in tensors if r.rsplit(".", 1)[0] not in needed and r not in needed)
                if extra:
                    raise FFNQuantError(
                        f"{where}: tensor {found.prefix + '.' + extra[0]!r} does not fit a "
                        f"{'gated' if gated else 'dense'} FFN (config.json activation {act_name!r}); expected {', '.join(needed)}"
                    )
                if not found.fused:
                    for role, name in tensors.items():
                        base, kind = role.rsplit(".", 1)
                        want = _expected_shape(arch, arch.roles[base], kind, d, f)
                        got = weights.shape(name)
                        if got != want:
                            raise FFNQuantError(
                                f"{str(weights.path_of(name))!r}: tensor {name!r} has shape {list(got)}, but config.json "
                                f"(d_model={d}, d_ff={f}) implies {list(want)}"
                            )
                layers.append(LayerInfo(index, stack, block, expert, found.prefix, tensors, found.fused, shared))
            index += 1
    if not layers:
        raise FFNQuantError(f"{where}: no {arch.name} FFN tensors found")
    if arch.activation_template is not None:
        for layer in layers:
            for name in _own_activation_names(arch, layer).values():
                if not weights.has(name):
                    raise FFNQuantError(
                        f"{where}: tensor {name!r} is missing: the model's own activation "
                        f"({_own_class(arch)}{f', its {arch.activation_attr!r}' if arch.activation_attr else ''}) holds it per "
                        f"layer, and ffnquant computes the FFN with it")
    return ModelInfo(
        path=folder,
        model_type=str(config.get("model_type")),
        arch=arch,
        hf_activation=act_name,
        spec=spec,
        n_layers=index,
        n_experts=n_experts,
        layers=tuple(layers),
        weight_files=weights.files,
        weights_format=weights.format,
        config=config,
        n_params_total=sum(math.prod(shape) for shape in weights._shapes.values()),
    )


def _expand_fused(groups: dict, n_experts: int, where: str) -> dict:
    """Fused 3-D expert tensors (one entry per layer) become one group per expert, roles kept."""
    out: dict = {}
    for (stack, block, expert), found in groups.items():
        if not found.fused:
            out[(stack, block, expert)] = found
            continue
        for e in range(n_experts):
            out[(stack, block, e)] = _Found(found.prefix, dict(found.tensors), True)
    return out


def _load_layer(info: ModelInfo, weights: _Weights, layer: LayerInfo) -> HFLayer:
    arch, spec = info.arch, info.spec
    d, f = spec.d_model, spec.d_ff
    state: dict[str, torch.Tensor] = {}
    for role, name in layer.tensors.items():
        tensor = weights.get(name)
        if layer.fused_expert_tensors:
            # "gate_up_proj", or "gate_up_proj.bias" for gate_up_proj_bias; a dotted name (DBRX's mlp.w1) as it is
            base, kind = (role[:-len(".bias")], "bias") if role.endswith(".bias") else (role, "weight")
            # what the tensor holds: its role where discovery named it, else transformers' fused names
            target = arch.roles.get(base) or ("w_gate+w_up" if base == "gate_up_proj" else "w_down")
            n_in, n_out = (f, d) if target == "w_down" else (d, 2 * f if "+" in target else f)
            rows, cols = (n_in, n_out) if input_major(arch, base) else (n_out, n_in)
            # output-major [E, out, in], input-major [E, in, out] (gpt-oss'), or flat [E x rows, cols] (DBRX's)
            want = ((info.n_experts, n_out) if kind == "bias" else (info.n_experts * rows, cols) if arch.flat_experts
                    else (info.n_experts, rows, cols))
            if tuple(tensor.shape) != want:
                raise FFNQuantError(
                    f"{str(weights.path_of(name))!r}: tensor {name!r} has shape {list(tensor.shape)}, but config.json "
                    f"(experts={info.n_experts}, d_model={d}, d_ff={f}) implies {list(want)}"
                )
            tensor = tensor[layer.expert] if kind == "bias" else \
                expert_matrices(tensor, base, arch, info.n_experts)[layer.expert]  # [out, in]
        else:
            base, kind = role.rsplit(".", 1)
            target = arch.roles[base]
            if arch.transposed and kind == "weight":
                tensor = tensor.t()
        tensor = tensor.detach().to(torch.float32)
        if not all_finite(tensor):
            raise FFNQuantError(f"{str(weights.path_of(name))!r}: tensor {name!r} holds NaN or infinite values")
        if target in ("w_gate+w_up", "w_up+w_gate"):
            # gate first, as Phi3MLP / MixtralExperts chunk it; alternating rows where the model reads them so
            first, second = (tensor[0::2], tensor[1::2]) if arch.interleaved else tensor.chunk(2, dim=0)
            gate, up = (first, second) if target == "w_gate+w_up" else (second, first)
            state[f"w_gate.{kind}"], state[f"w_up.{kind}"] = gate, up
        else:
            state[f"{target}.{kind}"] = tensor
    if spec.bias:  # a checkpoint may bias only some projections; the missing ones are zero
        for wname in spec.weight_names:
            state.setdefault(f"{wname}.bias", torch.zeros(spec.d_model if wname == "w_down" else spec.d_ff))
    activation = _own_activation(info, weights, layer) if info.arch.activation_template is not None else None
    ffn = FFN.from_state(spec, {k: v.contiguous() for k, v in state.items()}, activation=activation)
    return HFLayer(layer.index, layer.expert, layer.name, ffn.eval(), spec, info.hf_activation, layer,
                   block=info.block_params())


def _own_class(arch: Arch) -> str:
    """The class of the model's module that computes its own activation (a gate function's owner, by name)."""
    template = arch.activation_template
    return type(getattr(template, "stored", template)).__name__


def _own_template(arch: Arch, layer: LayerInfo) -> Any:
    """The template of one layer's own activation module: its block's own where it holds other tensors
    (`Arch.activation_templates`), else the model's."""
    return arch.activation_templates.get(layer.block, arch.activation_template)


def _own_activation_names(arch: Arch, layer: LayerInfo) -> dict[str, str]:
    """The checkpoint names of one layer's own activation module's tensors, by their name in the module (a gate
    function's: in the module that owns it, `stored`)."""
    template = _own_template(arch, layer)
    stored = getattr(template, "stored", template)
    return {key: ".".join(p for p in (layer.name, arch.activation_attr, key) if p) for key in stored.state_dict()}


def _own_activation(info: ModelInfo, weights: _Weights, layer: LayerInfo) -> nn.Module:
    """A layer's copy of the model's own activation module (`Arch.activation_template`), its learned parameters and
    buffers read from the checkpoint, in float32 (the FFN's computing dtype)."""
    own = copy.deepcopy(_own_template(info.arch, layer)).to_empty(device="cpu")
    module = getattr(own, "stored", own)
    state = {}
    for key, name in _own_activation_names(info.arch, layer).items():
        tensor = weights.get(name)
        if tensor.is_floating_point():
            tensor = tensor.to(torch.float32)
            if not all_finite(tensor):
                raise FFNQuantError(f"{str(weights.path_of(name))!r}: tensor {name!r} holds NaN or infinite values")
        state[key] = tensor
    module.load_state_dict(state, strict=True)
    if getattr(own, "layer_idx", None) is not None:  # a middle whose forward takes the calling layer's index
        own.layer_idx = layer.block
    return own.float().eval()


def ffn_reader(info: ModelInfo, allow_pickle: bool = False) -> _Weights:
    """The checkpoint's tensors as `iter_ffn_layers` reads each FFN's: under the names transformers loads them as
    where its files store them under others (`inspect_model` found them so)."""
    weights = _Weights(info.path, allow_pickle or info.weights_format == "pickle")
    if any(name not in weights.file_of for layer in info.layers[:1] for name in layer.tensors.values()):
        weights.rename_as_loaded(info.arch.name)
    return weights


def iter_ffn_layers(
    path: str | os.PathLike | ModelInfo, layers: str | int | list[int] | None = "all", allow_pickle: bool = False,
    weights: _Weights | None = None,
) -> Iterator[HFLayer]:
    """Yield the selected FFN layers one at a time (one layer's weights in memory at once). `weights`: a reader
    of the checkpoint's FFN tensors (`ffn_reader`) a caller reading layers again and again keeps."""
    info = path if isinstance(path, ModelInfo) else inspect_model(path, allow_pickle=allow_pickle)
    wanted = set(parse_layers(layers, info.n_layers))
    weights = weights if weights is not None else ffn_reader(info, allow_pickle)
    # the calls of one shared FFN (its weights stored once) hold one copy of its weights, as the model does: a later
    # call's FFN computes with the first call's tensors (the engine holds every call until the last one's inputs)
    pending = {}
    for layer in info.layers:
        if layer.index in wanted and layer.shares is not None:
            pending[layer.root] = pending.get(layer.root, 0) + 1
    first: dict[tuple, HFLayer] = {}
    for layer in info.layers:
        if layer.index not in wanted:
            continue
        root = layer.root
        if layer.shares is not None and root in first:
            yield _later_call(info, weights, layer, first[root])
            pending[root] -= 1
            if not pending[root]:
                del first[root]
            continue
        loaded = _load_layer(info, weights, layer)
        if pending.get(root):
            first[root] = loaded
        yield loaded


def _later_call(info: ModelInfo, weights: _Weights, layer: LayerInfo, first: HFLayer) -> HFLayer:
    """A later call of a shared FFN: its FFN holds the first call's weight tensors (the same values: the checkpoint
    stores them once), and its own activation module: the first call's module computing with this call's index
    where only the index differs (Zamba 2's middle: `OwnMiddle.called_by`), else read for this call."""
    own = first.ffn.activation
    if callable(getattr(own, "called_by", None)) and getattr(own, "layer_idx", None) is not None:
        activation = own.called_by(layer.block)
    else:
        activation = _own_activation(info, weights, layer) if info.arch.activation_template is not None else None
    state = {k: v for k, v in first.ffn.state_dict().items() if k.partition(".")[0] in first.spec.weight_names}
    ffn = FFN.from_state(first.spec, state, activation=activation)
    return HFLayer(layer.index, layer.expert, layer.name, ffn.eval(), first.spec, info.hf_activation, layer,
                   block=info.block_params())


def load_ffn_layers(
    path: str | os.PathLike | ModelInfo, layers: str | int | list[int] | None = "all", allow_pickle: bool = False
) -> list[HFLayer]:
    """Every selected FFN layer (all experts of a selected MoE layer) as ffnquant FFN modules."""
    return list(iter_ffn_layers(path, layers, allow_pickle=allow_pickle))
