"""Routed experts a model holds fused (gpt-oss' gate_up_proj [E, d, 2f], DBRX's flat w1, GraniteMoE's, ...) written
per expert, and read back fused by transformers' own loader.

A compressed-tensors folder stores one Linear per quantized matrix, so each routed expert is written under a per-expert
Linear name, `<experts module>.<e>.{gate,up,down}_proj.{weight...,bias}`: the layout llm-compressor writes for the same
model after it linearizes its experts. transformers reads a checkpoint's per-expert tensors into fused ones only where
its conversion mapping says how (Mixtral's, Qwen3-MoE's); for an experts module stored fused on disk it has none, and
would initialise such a folder's experts at random. `per_expert_loading(folder)` registers, while it runs, one
converter per fused tensor (`FuseExperts`): transformers' loader decompresses each expert (its compressed-tensors
step runs first) and the converter writes it into the fused tensor through the same views ffnquant reads experts with
(`hf.routed.expert_weight`, `expert_bias`), whatever the layout: gate and up side by side or interleaved, input- or
output-major, flat. `split_fused` is the writer's side: transformers' saved fused float tensors replaced by the
per-expert ones, which the compressed data then replaces.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn

from ..errors import FFNQuantError
from ..hf.routed import _n_experts, expert_bias, expert_tensors, expert_weight

__all__ = ["PROJECTIONS", "FuseExperts", "fused_experts", "loader_patched", "per_expert_loading", "split_fused"]

# ffnquant weight -> the per-expert Linear name (llm-compressor's linearized experts, transformers' own per-expert MLPs)
PROJECTIONS = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}
_ROLES = {proj: weight for weight, proj in PROJECTIONS.items()}


def _stand_in(name: str, tensor: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Module:
    """A module holding `tensor` under `name` (dotted: DBRX's mlp.w1) and `bias` as `<name>_bias`, as the experts
    module holds them: the views of `expert_weight` are taken of it."""
    root = parent = nn.Module()
    *path, last = name.split(".")
    for part in path:
        child = nn.Module()
        parent.add_module(part, child)
        parent = child
    parent.register_parameter(last, nn.Parameter(tensor, requires_grad=False))
    if bias is not None:
        parent.register_parameter(f"{last}_bias", nn.Parameter(bias, requires_grad=False))
    return root


def _views(module: nn.Module, weight: str, arch: Any, n_experts: int, bias: bool) -> list[torch.Tensor]:
    read = expert_bias if bias else expert_weight
    return [read(module, e, weight, arch) for e in range(n_experts)]


def _projection(key: str) -> str:
    """The ffnquant weight a per-expert tensor name (or pattern) holds: its `<projection>.` part."""
    found = [proj for proj in _ROLES if re.search(rf"(^|\.){proj}\.", key)]
    if len(found) != 1:
        raise FFNQuantError(f"{key}: not a per-expert tensor of one of {', '.join(_ROLES)}")
    return _ROLES[found[0]]


def _patterns(rel: str, role: str, kind: str) -> list[str]:
    """The per-expert source patterns of one fused tensor holding `role` ("w_gate+w_up"): one per projection, in the
    role's order."""
    return [f"{rel}.*.{PROJECTIONS[w]}.{kind}" for w in role.split("+")]


try:
    from transformers.core_model_loading import ConversionOps, WeightConverter
except ImportError:  # transformers < 5 has no conversion ops: `experts.loader_expert_names` then refuses such experts
    ConversionOps, WeightConverter = object, None  # type: ignore[assignment,misc]


class FuseExperts(ConversionOps):  # type: ignore[misc,valid-type]
    """transformers conversion op: the per-expert tensors of one fused experts tensor (each expert's [out, in] or
    bias, decompressed by transformers' compressed-tensors step where they are stored compressed) written into it."""

    def __init__(self, arch: Any, tensor: str, role: str, n_experts: int, bias: bool = False):
        self.arch, self.tensor, self.role, self.n_experts, self.bias = arch, tensor, role, n_experts, bias

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, torch.Tensor]:
        model, full = kwargs["model"], kwargs["full_layer_name"]
        param = model.get_parameter(full)
        first = next(iter(input_dict.values()))
        dtype = (first[0] if isinstance(first, (list, tuple)) else first).dtype
        fused = torch.zeros(param.shape, dtype=dtype)
        module = (_stand_in(self.tensor, fused) if not self.bias else
                  _stand_in(self.tensor, torch.empty(model.get_parameter(full[: -len("_bias")]).shape, dtype=dtype,
                                                     device="meta"), fused))
        filled = set()
        for key, value in input_dict.items():
            role = _projection(key)
            values = list(value) if isinstance(value, (list, tuple)) else list(value.unbind(0))
            if len(values) != self.n_experts:
                raise FFNQuantError(f"{full}: {len(values)} experts' {key} in the folder, the model has {self.n_experts}")
            for view, t in zip(_views(module, role, self.arch, self.n_experts, self.bias), values):
                view.copy_(t.to(dtype))
            filled.add(role)
        wanted = set(self.role.split("+"))
        if filled != wanted:  # an expert's projection missing from the folder would load as zeros
            raise FFNQuantError(f"{full}: the folder holds its experts' {', '.join(sorted(filled)) or 'nothing'}, "
                                f"it needs {', '.join(sorted(wanted))}")
        return {target_patterns[0]: fused}

    @property
    def reverse_op(self) -> ConversionOps:  # type: ignore[valid-type]
        return SplitExperts(self.arch, self.tensor, self.role, self.n_experts, self.bias)


class SplitExperts(ConversionOps):  # type: ignore[misc,valid-type]
    """The reverse of `FuseExperts` (transformers' save of a model loaded so): one fused tensor -> its per-expert ones."""

    def __init__(self, arch: Any, tensor: str, role: str, n_experts: int, bias: bool = False):
        self.arch, self.tensor, self.role, self.n_experts, self.bias = arch, tensor, role, n_experts, bias

    @torch.no_grad()
    def convert(self, input_dict: dict[str, Any], source_patterns: list[str], target_patterns: list[str],
                **kwargs: Any) -> dict[str, torch.Tensor]:
        value = next(iter(input_dict.values()))
        fused = value[0] if isinstance(value, (list, tuple)) else value
        return split_tensor(self.arch, self.tensor, fused, self.n_experts, target_patterns, self.bias)

    @property
    def reverse_op(self) -> ConversionOps:  # type: ignore[valid-type]
        return FuseExperts(self.arch, self.tensor, self.role, self.n_experts, self.bias)


def split_tensor(arch: Any, tensor: str, fused: torch.Tensor, n_experts: int, patterns: list[str],
                 bias: bool = False, weight_shape: tuple[int, ...] | None = None) -> dict[str, torch.Tensor]:
    """{per-expert name: tensor} of one fused experts tensor, each pattern's `*` the expert's index (`bias`: `fused`
    is the tensor's `_bias`, and `weight_shape` the weight's)."""
    module = (_stand_in(tensor, fused) if not bias else
              _stand_in(tensor, torch.empty(weight_shape or (), device="meta"), fused))
    out = {}
    for pattern in patterns:
        views = _views(module, _projection(pattern), arch, n_experts, bias)
        out.update({pattern.replace("*", str(e)): v.contiguous().clone() for e, v in enumerate(views)})
    return out


def loader_patched() -> set[str]:
    """The experts classes transformers' loader replaces by per-expert modules for a compressed-tensors folder."""
    try:
        from transformers.quantizers.base import MODULES_TO_PATCH_FOR_QUANTIZATION
    except ImportError:  # a transformers without that table patches nothing
        return set()
    return {name for name, entry in MODULES_TO_PATCH_FOR_QUANTIZATION.items()
            if any(str(getattr(m, "value", m)) == "compressed-tensors" for m in entry.get("quantization_methods", ()))}


def fused_experts(model: nn.Module, info: Any) -> dict[str, nn.Module]:
    """{module name: experts module} of the model's routed experts held fused that ffnquant writes per expert: every
    one of its planned experts layers stored fused, less the classes transformers' own loader replaces by per-expert
    modules for a compressed-tensors folder (Llama 4's, `experts.unfused_for_loader`)."""
    patched = loader_patched()
    out = {}
    for layer in info.layers:
        if layer.expert is None or not layer.fused_expert_tensors or layer.name in out:
            continue
        module = model.get_submodule(layer.name)
        if type(module).__name__ not in patched:
            out[layer.name] = module
    return out


def _relative(name: str) -> str:
    """A module's name within its decoder layer (model.layers.3.mlp.experts -> mlp.experts): a converter's patterns
    match every layer."""
    return re.sub(r"^.*?\.\d+\.", "", name, count=1)


def converters(modules: dict[str, nn.Module], arch: Any) -> list[Any]:
    """transformers WeightConverters reading each fused tensor of `modules` (and its `_bias`) from per-expert ones."""
    out, seen = [], set()
    for name, module in modules.items():
        rel = _relative(name)
        n = _n_experts(module, arch)
        for role, tensor in expert_tensors(module, arch).items():
            if (rel, tensor) in seen:
                continue
            seen.add((rel, tensor))
            out.append(WeightConverter(_patterns(rel, role, "weight"), f"{rel}.{tensor}",
                                       operations=[FuseExperts(arch, tensor, role, n)]))
            if "." not in tensor and isinstance(getattr(module, f"{tensor}_bias", None), torch.Tensor):
                out.append(WeightConverter(_patterns(rel, role, "bias"), f"{rel}.{tensor}_bias",
                                           operations=[FuseExperts(arch, tensor, role, n, bias=True)]))
    return out


def split_fused(folder: Path, model: nn.Module, info: Any) -> list[str]:
    """The fused float experts tensors transformers saved in `folder` (from `model`, the model it saved) rewritten as
    per-expert tensors (`<module>.<e>.<projection>.weight`, `.bias`); returns the experts modules rewritten. Each
    fused tensor is split from the module's own (what the file holds, as transformers loads it: Inkling 2's
    w13_weight is stored with its gate and up rows interleaved otherwise), and dropped from the file under the
    name it is stored (`ctfiles.safetensors_reader`) or made from (`hf.weights.converted_names`)."""
    from ..hf.conversions import mapping_for
    from ..hf.weights import converted_names
    from .ctfiles import rewrite_shards, safetensors_reader

    modules = fused_experts(model, info)
    if not modules:
        return []
    where, read = safetensors_reader(folder)
    converted = converted_names([k for k in where if k not in read.aliases], mapping_for(info.model_type))
    edits: dict[Path, dict[str, Any]] = {}
    for name, module in modules.items():
        n = _n_experts(module, info.arch)
        for role, tensor in expert_tensors(module, info.arch).items():
            for bias in (False, True):
                if bias and ("." in tensor or not isinstance(getattr(module, f"{tensor}_bias", None), torch.Tensor)):
                    continue
                key = f"{name}.{tensor}" + ("_bias" if bias else "")
                if key in where:
                    stored = [read.aliases.get(key, key)]
                elif key in converted:  # made at load from a stored tensor and its companions (scales)
                    stored = [converted[key].stored, *(c for _, c in converted[key].companions)]
                else:
                    raise FFNQuantError(f"transformers saved no tensor {key!r} of {type(module).__name__} {name}: "
                                        "ffnquant cannot write its experts per expert")
                edit = edits.setdefault(where[stored[0]], {"drop": set(), "add": {}, "expect": {}})
                edit["drop"].update(stored)
                value = module.get_parameter(key[len(name) + 1:]).detach()
                edit["add"].update(split_tensor(info.arch, tensor, value, n,
                                                _patterns(name, role, "bias" if bias else "weight"), bias=bias,
                                                weight_shape=tuple(module.get_parameter(tensor).shape)))
    rewrite_shards(folder, edits)
    return sorted(modules)


def _folder_modules(folder: Path) -> tuple[str, dict[str, nn.Module], Any] | None:
    """(model type, the fused experts modules stored per expert in `folder`, arch), or None where none is."""
    import transformers

    from ..hf.checkpoint import read_config
    from ..hf.conversions import mapping_for
    from ..hf.discover import arch_for_config, discover_config
    from ..hf.skeleton import causal_lm_from_config

    if not (folder / "config.json").is_file():
        return None
    names = _stored_names(folder)
    per_expert = re.compile(r"\.\d+\.(?:" + "|".join(_ROLES) + r")\.")
    if not any(per_expert.search(k) for k in names):  # no per-expert tensor at all: nothing to read so
        return None
    # not caught: a folder whose experts cannot be found would load with them at random
    config = read_config(folder)  # transformers' own form of non-finite values read (Granite MoE hybrid's)
    # transformers merges per-expert tensors itself (a converter of `*` patterns: Mixtral's, Qwen3-MoE's): nothing
    # to register, and no discovery of the model run to find that out
    if any("*" in str(p) for t in mapping_for(str(config.get("model_type") or ""))
           for p in getattr(t, "source_patterns", ())):
        return None
    arch = arch_for_config(config, folder.name)
    # experts transformers itself reads per expert (its conversion mapping names their per-expert tensors: Mixtral's,
    # Qwen3-MoE's, `hf.conversions`) need nothing of ffnquant's
    if arch.install is not arch.install.EXPERTS or arch.gated_roles:
        return None
    found = discover_config(config, folder.name)
    cfg = transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    with torch.device("meta"):
        model = causal_lm_from_config(transformers, cfg)
    patched = loader_patched()
    modules = {}
    for block in found.blocks:
        name = f"{found.layers_path}.{block}" + (f".{found.ffn.path}" if found.ffn.path else "")
        module = model.get_submodule(name)
        # held fused and stored per expert; not a class transformers itself replaces by per-expert modules
        if type(module).__name__ not in patched and any(k.startswith(f"{name}.0.") for k in names):
            modules[name] = module
    return (str(config.get("model_type") or ""), modules, arch) if modules else None


def _stored_names(folder: Path) -> set[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    from safetensors import safe_open

    names: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as f:
            names.update(f.keys())
    return names


@contextlib.contextmanager
def per_expert_loading(folder: str | Path) -> Iterator[list[str]]:
    """While it runs, transformers' `from_pretrained` reads `folder`'s routed experts stored per expert into the
    experts modules its model holds fused (a conversion registered for the model type, the previous one restored
    after); yields the experts modules so read ([] where the folder needs none: nothing registered).

        with per_expert_loading(folder):
            model = AutoModelForCausalLM.from_pretrained(folder)
    """
    found = _folder_modules(Path(folder))
    if found is None:
        yield []
        return
    model_type, modules, arch = found
    from transformers import conversion_mapping as cm

    previous = cm.get_checkpoint_conversion_mapping(model_type)
    user = model_type in cm.USER_REGISTERED_MAPPINGS
    cm.register_checkpoint_conversion_mapping(model_type, (previous or []) + converters(modules, arch), overwrite=True)
    try:
        yield sorted(modules)
    finally:
        cache = cm._checkpoint_conversion_mapping_cache  # the registry's own table: the previous entry put back
        if previous is None:
            cache.pop(model_type, None)
        else:
            cache[model_type] = previous
        if not user:
            cm.USER_REGISTERED_MAPPINGS.discard(model_type)
