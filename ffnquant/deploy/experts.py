"""Routed experts in a compressed-tensors folder: each expert's Linear under its on-disk per-expert name.

transformers (>= 5) fuses a checkpoint's per-expert tensors (`experts.N.gate_proj.weight`, ...) into 3-D tensors
when it loads the model, and writes them back per expert when it saves one. A compressed-tensors folder keeps the
per-expert names, as llm-compressor writes them (`experts.N.gate_proj.weight_packed`, `weight_scale`,
`weight_shape`); transformers' loader decompresses each expert and fuses the results. That loader reads every
routed expert of a model with ONE scheme (the config group whose `re:` targets name the experts) and only from
`weight_packed`: so every routed expert is quantized, with one weight-only symmetric integer recipe
(compressed-tensors' "pack-quantized"), or none is. `experts_refusal` and `plan_experts_refusal` say so before
anything is computed; the planner ties the layers' choices (`planning.search.tie`) for a plan made for the format.

The writer (`write_experts`) lets transformers' own save write the float model (experts per expert, reverted from
the fused tensors), checks that each expert's float tensor in the files is ffnquant's dequantized weight bit for
bit (the names are right), and replaces it with what compressed-tensors' compressor makes of it on the grid
ffnquant quantized it on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from ..infra.atomic import write_text
from ..schemes import ActDType, WeightDType

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..planning.planfile import Plan
    from .planned import ModuleQuant, PlannedModel

__all__ = ["EXPERTS_WHY", "has_experts", "tied_layers", "experts_refusal", "plan_experts_refusal", "experts_target",
           "loader_expert_names", "write_experts"]

EXPERTS_WHY = ("transformers loads a folder's routed experts decompressed from compressed-tensors' pack-quantized "
               "tensors, all under one scheme: every routed expert takes one weight-only symmetric int4/int8 recipe "
               "(w4a16-gN, w4a16-gN-gptq, w8a16), or all stay float")
GROUP_NAME = "routed_experts"


def has_experts(info: ModelInfo) -> bool:
    """Whether the model's planned FFNs are routed experts."""
    return any(layer.expert is not None for layer in info.layers)


def tied_layers(info: ModelInfo) -> tuple[int, ...]:
    """The layers a compressed-tensors plan of `info` must give one recipe (its routed experts' layers)."""
    return tuple(sorted({layer.index for layer in info.layers if layer.expert is not None}))


def experts_refusal(recipe: Any) -> str | None:
    """Why routed experts cannot be stored under `recipe` in a compressed-tensors folder (one line), None when they
    can (fp32 keeps them float)."""
    if recipe.is_float:
        return None
    scheme = recipe.resolve()
    why = None
    if scheme.act_dtype is not ActDType.NONE:
        why = "it quantizes activations, which transformers' loader of experts does not"
    elif scheme.weight_dtype not in (WeightDType.INT4, WeightDType.INT8):
        why = f"its {scheme.weight_dtype.value} weights are not integers"
    elif not scheme.weight_symmetric:
        why = "its weights are asymmetric (the loader reads no zero point)"
    elif getattr(recipe, "smooth", None) is not None or getattr(recipe, "rotate", False):
        why = "it scales or rotates the experts' input, which the router reads too"
    return None if why is None else f"routed experts cannot take {recipe}: {why}; {EXPERTS_WHY}"


def plan_experts_refusal(plan: Plan, info: ModelInfo) -> str | None:
    """Why `plan`'s routed experts cannot be written as one compressed-tensors folder (one line), None when they
    can: each recipe storable (`experts_refusal`) and one recipe for every routed layer."""
    layers = tied_layers(info)
    recipes = {i: plan.layers[i] for i in layers if i in plan.layers}
    for i, recipe in recipes.items():
        why = experts_refusal(recipe)
        if why is not None:
            return f"layer L{i}: {why}"
    distinct = sorted({str(r) for r in recipes.values()})
    if len(distinct) > 1:
        by = ", ".join(f"L{i} {r}" for i, r in recipes.items())
        return (f"the plan gives the routed experts {len(distinct)} recipes ({by}); {EXPERTS_WHY}. A plan made with "
                "--format compressed-tensors gives them one")
    return None


def _generic(mq: ModuleQuant) -> tuple[str, str]:
    """(the experts module's on-disk prefix, the projection) of a routed expert's Linear name."""
    marker = f".{mq.expert}."
    cut = mq.module.rfind(marker)
    if cut < 0:
        raise FFNQuantError(f"{mq.module}: the expert's on-disk name does not hold its id {mq.expert}")
    return mq.module[:cut], mq.module[cut + len(marker):]


def experts_target(modules: Sequence[ModuleQuant]) -> str:
    """One `re:` target naming every routed expert Linear of `modules` (each experts module, any expert id, its
    projections), as transformers' loader finds the experts' config group (a `re:` target naming experts)."""
    prefixes, projections = set(), set()
    for mq in modules:
        prefix, projection = _generic(mq)
        prefixes.add(re.escape(prefix))
        projections.add(re.escape(projection))
    return (f"re:^(?:{'|'.join(sorted(prefixes))})\\.\\d+\\.(?:{'|'.join(sorted(projections))})$")


def _attach(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent = root
    *path, last = dotted.split(".")
    for part in path:
        if not hasattr(parent, part):
            parent.add_module(part, nn.Module())
        parent = getattr(parent, part)
    parent.add_module(last, module)


def _compressed(planned: PlannedModel, modules: Sequence[ModuleQuant], set_params: Any,
                module_args: Any) -> tuple[dict, Any, Any]:
    """{on-disk name: tensor} of every expert Linear compressed by compressed-tensors, its scheme and compressor
    (`set_params`, `module_args`: the writer's own, `deploy.ctensors`)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config

    args = {json.dumps(module_args(mq)[0].model_dump(mode="json"), sort_keys=True) for mq in modules}
    if len(args) != 1 or any(mq.input_mode is not None for mq in modules):
        raise FFNQuantError(f"the routed experts are quantized {len(args)} ways; {EXPERTS_WHY}")
    scheme = QuantizationScheme(targets=[experts_target(modules)], weights=module_args(modules[0])[0])
    by_layer: dict[str, list[ModuleQuant]] = {}
    for mq in modules:
        by_layer.setdefault(mq.fused, []).append(mq)
    state: dict[str, torch.Tensor] = {}
    compressor = None
    for layer in by_layer.values():  # a decoder layer's experts at a time: one float copy of one layer alive
        container = nn.Module()
        for mq in layer:
            weight = planned.weight_of(mq).float()
            linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
            linear.weight.data = weight.clone()
            _attach(container, mq.module, linear)
        apply_quantization_config(container, QuantizationConfig(config_groups={GROUP_NAME: scheme},
                                                                quantization_status="frozen"), show_progress=False)
        for mq in layer:
            set_params(container.get_submodule(mq.module), mq)
        compressor = ModelCompressor.from_pretrained_model(container)
        compressor.compress_model(container)
        state.update({k: v.detach() for k, v in container.state_dict().items()})
        del container
    return state, scheme, compressor


def write_experts(folder: Path, planned: PlannedModel, modules: Sequence[ModuleQuant], set_params: Any,
                  module_args: Any, dtype: torch.dtype) -> dict[str, Any]:
    """Replace each quantized routed expert's float tensor in the saved folder's safetensors with its
    compressed-tensors data (`set_params`, `module_args`: how the writer puts ffnquant's grid into a module and
    names its scheme), and add the experts' config group to config.json; returns what was written."""
    from .ctfiles import rewrite_shards, safetensors_reader

    quantized = [mq for mq in modules if mq.grid is not None]
    if not quantized:
        return {"routed_experts": len(modules), "quantized": 0}
    state, scheme, compressor = _compressed(planned, quantized, set_params, module_args)
    low = dtype is not torch.float32
    where, read = safetensors_reader(folder)
    by_module: dict[str, list[str]] = {}  # the compressed tensors of each expert Linear, grouped once
    for key in state:
        by_module.setdefault(key.rsplit(".", 1)[0], []).append(key)
    edits: dict[Path, dict[str, Any]] = {}
    for mq in quantized:
        name = mq.module + ".weight"
        if name not in where:
            raise FFNQuantError(f"transformers saved no tensor {name!r}: the checkpoint's expert names do not map to "
                                "the model's fused experts as ffnquant reads them")
        # the name the file keeps (DeepSeek-V4 saves layers.N.ffn.experts, loaded as .mlp.): the compressed
        # tensors go under it too, renamed at load as the float ones were
        stored = read.aliases.get(name, name)
        edit = edits.setdefault(where[name], {"drop": set(), "add": {}, "expect": {}})
        edit["drop"].add(stored)
        edit["expect"][stored] = planned.weight_of(mq)
        prefix = stored[: -len(".weight")]
        for key in by_module.get(mq.module, ()):
            value = state[key]
            # scales computed in a low precision are values of it (`precision.in_dtype`): stored in it
            edit["add"][prefix + key[len(mq.module):]] = value.to(dtype) if low and value.is_floating_point() else value
    rewrite_shards(folder, edits)
    _add_group(folder, scheme, compressor)
    return {"routed_experts": len(modules), "quantized": len(quantized), "target": scheme.targets[0],
            "compression_format": str(compressor.quantization_config.format)}



def _llama4_experts(gate_up: torch.Tensor, down: torch.Tensor) -> dict[str, torch.Tensor]:
    """Llama4TextExperts' fused tensors (gate_up_proj [E, d, 2f], gate columns first; down_proj [E, f, d], both
    applied as x @ W) as the per-expert Linear weights of transformers' SequentialLlama4TextExperts ([out, in])."""
    f = gate_up.shape[-1] // 2
    out = {}
    for e in range(gate_up.shape[0]):
        out[f"{e}.gate_proj.weight"] = gate_up[e, :, :f].T.contiguous()
        out[f"{e}.up_proj.weight"] = gate_up[e, :, f:].T.contiguous()
        out[f"{e}.down_proj.weight"] = down[e].T.contiguous()
    return out


# Fused experts modules transformers' loader replaces, for a compressed-tensors folder, by a list of per-expert MLPs
# read from per-expert tensors (`transformers.quantizers.base.MODULES_TO_PATCH_FOR_QUANTIZATION`), while its own
# save writes them fused: how each one's fused tensors split into those. Measured with transformers 5.25: a Llama 4
# folder left fused loads with its routed experts initialised at random ("MISSING ... experts.N.gate_proj.weight").
_LOADER_SPLITS = {"Llama4TextExperts": (("gate_up_proj", "down_proj"), _llama4_experts)}
# the per-expert Linears of each (`_llama4_experts`' names), by ffnquant weight
_LOADER_NAMES = {"Llama4TextExperts": {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}}


def loader_expert_names(arch: Any) -> dict[str, str]:
    """ffnquant weight -> the per-expert Linear name a fused experts module of `arch` is written under in a
    compressed-tensors folder (experts.N.gate_proj): where transformers' loader replaces the module by per-expert
    ones (Llama 4's), their names; any other fused layout is written so too and read back fused by
    `expert_loading.per_expert_loading`. {} where transformers replaces the module by per-expert ones ffnquant
    cannot split into."""
    from .expert_loading import PROJECTIONS, WeightConverter, loader_patched

    cls = getattr(arch, "experts_class", "")
    if cls in loader_patched():
        return dict(_LOADER_NAMES.get(cls, {})) if cls in _LOADER_SPLITS else {}
    # read back through transformers' conversion ops (transformers >= 5); without them the folder would not load
    return dict(PROJECTIONS) if WeightConverter is not None else {}


def unfused_for_loader(folder: Path, model: nn.Module) -> list[str]:
    """The fused float experts transformers saved in `folder` rewritten as the per-expert tensors its loader reads
    for a compressed-tensors folder (`_LOADER_SPLITS`); returns the modules rewritten. A class the loader replaces
    that ffnquant cannot split is refused in one line (a folder left fused would load with random experts)."""
    from safetensors import safe_open

    from .ctfiles import rewrite_shards, safetensors_reader
    from .expert_loading import loader_patched

    patched = loader_patched()
    found = {name: type(m).__name__ for name, m in model.named_modules() if type(m).__name__ in patched}
    if not found:
        return []
    unknown = sorted({cls for cls in found.values() if cls not in _LOADER_SPLITS})
    if unknown:
        raise FFNQuantError(f"transformers loads {', '.join(unknown)} from a compressed-tensors folder as per-expert "
                            "modules, and ffnquant does not know how its fused tensors split into them: the folder "
                            "would load with those experts at random, so none is written")
    where, _ = safetensors_reader(folder)
    edits: dict[Path, dict[str, Any]] = {}
    for name, cls in found.items():
        roles, split = _LOADER_SPLITS[cls]
        keys = [f"{name}.{role}" for role in roles]
        missing = [k for k in keys if k not in where]
        if missing:
            raise FFNQuantError(f"transformers saved no tensor {missing[0]!r} for {cls} {name}: ffnquant cannot write "
                                "the per-expert tensors its loader reads for a compressed-tensors folder")
        tensors = []
        for k in keys:
            with safe_open(str(where[k]), framework="pt") as f:
                tensors.append(f.get_tensor(k))
            edits.setdefault(where[k], {"drop": set(), "add": {}, "expect": {}})["drop"].add(k)
        # the per-expert tensors go to the file that held the first fused one
        edits[where[keys[0]]]["add"].update({f"{name}.{suffix}": t for suffix, t in split(*tensors).items()})
    rewrite_shards(folder, edits)
    return sorted(found)


def _add_group(folder: Path, scheme: Any, compressor: Any) -> None:
    """config.json's quantization_config with the experts' group (its format named in it) beside the others."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    fmt = getattr(compressor.quantization_config.format, "value", compressor.quantization_config.format)
    group = json.loads(scheme.model_dump_json())
    group["format"] = fmt
    qc = config.get("quantization_config")
    if not qc:
        compressor.update_config(str(folder))
        config = json.loads(path.read_text())
        qc = config["quantization_config"]
        qc["config_groups"] = {GROUP_NAME: group}
    else:
        for other in qc["config_groups"].values():
            other.setdefault("format", qc.get("format"))
        qc["config_groups"][GROUP_NAME] = group
        if any(g.get("format") != fmt for g in qc["config_groups"].values()):
            qc["format"] = "mixed-precision"
    write_text(path, json.dumps(config, indent=2, sort_keys=True) + "\n")
