"""The planned model as a Hugging Face folder in compressed-tensors' layout, and the proof that it is what was measured.

The folder is what llm-compressor writes and transformers and vLLM load: safetensors whose FFN Linear modules
carry compressed-tensors' data (int8 weights per output channel with static or per-token int8 activations,
"int-quantized"; packed 4-bit group weights, "pack-quantized"; fp8, "float-quantized") and a
`quantization_config` in config.json naming each module's scheme, with every other Linear left float.
The packing, the parameter names and the config are the `compressed-tensors` library's own: ffnquant sets
each module's scales and zero points to the grid its weights were quantized on and lets the library compress
and describe them, so a change in the library's layout follows by itself.

Mapping of ffnquant's numerics (each checked by `verify_folder`):
- weights: ffnquant's grids (`fakequant.WeightGrid`) are already on compressed-tensors' signed ranges;
  the library re-derives each code as round(w / scale) + zero_point from the dequantized weight, which returns
  the code exactly (|code| <= 128, far inside float32's exact integers).
- static activations: one scale and zero point per site; ffnquant's uint8 zero point z becomes the int8 z - 128
  (the same values). w_gate and w_up read one site and get the same scale.
- dynamic per-token int8: compressed-tensors' symmetric scale is absmax / 127.5 where ffnquant's is
  absmax / 127 (the extreme value then rounds one step in); the end-to-end check measures what that costs.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..backends import ASYMMETRIC_INT4_MEASURED, CTENSORS_SUPPORTED, ROTATE_WHY, supports
from ..errors import FFNQuantError
from ..infra.atomic import write_text
from ..infra.thirdparty import quiet_model_io
from . import ctproof
from .ctfiles import concatenated_for_loader, decompressed_weights
from .ctproof import LOAD_TOLERANCE
from .expert_loading import split_fused
from .experts import has_experts, plan_experts_refusal, unfused_for_loader, write_experts
from .planned import ModuleQuant, PlannedModel
from .precision import input_args, source_dtype

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..planning.planfile import Plan
    from ..recipe import Recipe
    from ..spec import FFNSpec

__all__ = ["FORMAT_NAME", "SUPPORTED", "LOAD_TOLERANCE", "ASYMMETRIC_INT4_MEASURED", "ctensors_available",
           "recipe_refusal", "plan_refusal", "packed_beside_inputs", "module_args", "write_folder", "decompressed_weights", "verify_folder",
           "folder_bytes"]

FORMAT_NAME = "compressed-tensors"
# What this writer stores, said in every refusal (the compressed-tensors backend's declaration).
SUPPORTED = CTENSORS_SUPPORTED
# The proof's bound: the loaded folder's perplexity equals the plan's measured one within this, relative.
# Files of a model folder that the writer produces itself (everything else is copied from the source folder).
_WRITTEN = ("config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json")
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx")
def ctensors_available() -> tuple[bool, str]:
    """(True, version) when the compressed-tensors package imports, else (False, how to install it)."""
    try:
        import compressed_tensors
    except ImportError as exc:
        return False, f"compressed-tensors is not installed ({exc}); pip install '.[deploy]' from the ffnquant checkout"
    return True, str(getattr(compressed_tensors, "__version__", "?"))


def _require() -> None:
    ok, why = ctensors_available()
    if not ok:
        raise FFNQuantError(why)


def recipe_refusal(recipe: Recipe, spec: FFNSpec) -> str | None:
    """Why this writer cannot store `recipe` on an FFN of `spec` (one line naming the recipe and what is
    supported), None when it can: the compressed-tensors backend's answer (`backends.supports`)."""
    return supports(FORMAT_NAME, recipe, spec).why


def plan_refusal(plan: Plan, info: ModelInfo) -> str | None:
    """The first layer whose recipe this writer cannot store, as a one-line reason; None when all can (routed
    experts: `experts.plan_experts_refusal`; packed 4-bit beside quantized inputs where transformers loads packed
    Linears only decompressed: `packed_beside_inputs`)."""
    for index, recipe in plan.layers.items():
        why = recipe_refusal(recipe, info.spec)
        if why is not None:
            return f"layer L{index}: {why}"
    return (plan_experts_refusal(plan, info) if has_experts(info) else None) or packed_beside_inputs(plan, info)


def packed_beside_inputs(plan: Plan, info: ModelInfo) -> str | None:
    """Why a plan with 4-bit packed layers beside layers that quantize their inputs cannot be a proven folder of
    this model (one line), None when it can: where the model's own weight initialisation reads `.weight` of every
    Linear (BLT's), transformers cannot load a packed Linear (weight_packed) compressed, only decompressed, and
    decompressed Linears compute on float inputs. Found by calling the model class's `_init_weights` on such a
    Linear, before anything is written."""
    packed = [i for i, r in plan.layers.items() if not r.is_float and r.resolve().weight_dtype.value == "int4"]
    inputs = [i for i, r in plan.layers.items() if not r.is_float and r.resolve().act_dtype.value != "none"]
    if not packed or not inputs:
        return None
    why = _packed_init_refusal(info)
    if why is None:
        return None
    return (f"{info.model_type}: {why}, so a folder of it loads in transformers only decompressed, which drops the "
            f"input quantization of {', '.join(f'L{i}' for i in inputs[:4])}{' and more' if len(inputs) > 4 else ''} "
            f"beside the 4-bit layers {', '.join(f'L{i}' for i in packed[:4])}{' and more' if len(packed) > 4 else ''}; "
            "plan with candidates that do not mix the two (--candidates of weight-only recipes alone, or of no "
            "4-bit one)")


def _packed_init_refusal(info: ModelInfo) -> str | None:
    """Why transformers' weight initialisation of this model fails on a Linear compressed-tensors packed (its
    `.weight` replaced by `weight_packed`), None where it does not."""
    import transformers

    from ..hf.skeleton import causal_lm_from_config

    config = transformers.AutoConfig.from_pretrained(str(info.path), local_files_only=True)
    with torch.device("meta"):
        model = causal_lm_from_config(transformers, config)
        linear = torch.nn.Linear(64, 32, bias=False)
    del linear.weight
    linear.register_parameter("weight_packed", torch.nn.Parameter(torch.zeros(32, 8, dtype=torch.int32),
                                                                  requires_grad=False))
    try:
        with torch.device("meta"):
            model._init_weights(linear)
    except AttributeError as exc:
        if "weight" not in str(exc):
            return None
        return f"its weight initialisation ({type(model).__name__}._init_weights) reads .weight of every Linear"
    except Exception:  # noqa: BLE001 - an init that fails on a bare Linear for another reason: not judged here
        return None
    return None


def module_args(mq: ModuleQuant) -> tuple[Any, Any]:
    """compressed-tensors' (weights, input_activations) QuantizationArgs of one FFN Linear; (None, None) keeps it float."""
    from compressed_tensors.quantization import QuantizationArgs

    if mq.rotation is not None:
        raise FFNQuantError(f"{mq.module} ({mq.recipe}) cannot be written as {FORMAT_NAME}: {ROTATE_WHY}. "
                            f"Supported: {SUPPORTED}")
    weights = None
    g = mq.grid
    if g is not None:
        strategy = {"per_tensor": "tensor", "per_channel": "channel", "per_group": "group"}[g.granularity]
        if g.kind == "fp8":
            weights = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy)
        elif strategy == "group" and not g.symmetric:
            # asymmetric groups as blocks of one row by a group: the one layout of them transformers loads back
            # (its zero points stored unpacked, [out, groups]; see the asymmetric 4-bit note in ffnquant.backends)
            weights = QuantizationArgs(num_bits=g.bits, type="int", symmetric=False, strategy="block",
                                       block_structure=[1, g.group_size])
        else:
            weights = QuantizationArgs(num_bits=g.bits, type="int", symmetric=g.symmetric, strategy=strategy,
                                       group_size=g.group_size if strategy == "group" else None)
    return weights, input_args(mq.scheme, mq.input_mode, mq.input_range)


def _set_params(module: torch.nn.Module, mq: ModuleQuant) -> None:
    """Put ffnquant's scales and zero points into the parameters compressed-tensors initialized on `module`."""
    with torch.no_grad():
        g = mq.grid
        if g is not None:
            module.weight_scale.copy_(g.scale.reshape(module.weight_scale.shape).to(module.weight_scale.dtype))
            zp = getattr(module, "weight_zero_point", None)
            if zp is not None:
                zp.copy_((g.zero_point if g.zero_point is not None else torch.zeros_like(g.scale))
                         .reshape(zp.shape).to(zp.dtype))
        if mq.input_mode == "static":
            r = mq.input_range
            module.input_scale.fill_(r.scale)
            zp = getattr(module, "input_zero_point", None)
            if zp is not None:
                # ffnquant's uint8 grid 0..255 is compressed-tensors' int8 grid shifted by 128: same values
                zp.fill_(r.zero_point - 128 if r.qmin == 0 else r.zero_point)


def _config_groups(modules: Sequence[ModuleQuant]) -> tuple[dict[str, Any], dict[str, ModuleQuant]]:
    """One compressed-tensors scheme per distinct (weights, input) quantization, targeting its modules by name."""
    from compressed_tensors.quantization import QuantizationScheme

    groups: dict[str, tuple[Any, Any, list[str]]] = {}
    quantized: dict[str, ModuleQuant] = {}
    for mq in modules:
        weights, inputs = module_args(mq)
        if weights is None and inputs is None:
            continue
        key = json.dumps([weights.model_dump(mode="json") if weights else None,
                          inputs.model_dump(mode="json") if inputs else None], sort_keys=True)
        groups.setdefault(key, (weights, inputs, []))[2].append(mq.module)
        quantized[mq.module] = mq
    schemes = {f"group_{i}": QuantizationScheme(targets=targets, weights=w, input_activations=a)
               for i, (w, a, targets) in enumerate(groups.values())}
    return schemes, quantized


def _copy_side_files(source: Path, folder: Path) -> list[str]:
    """The source folder's tokenizer, chat template and other non-weight files, copied beside the weights."""
    copied = []
    for entry in sorted(source.iterdir()):
        if not entry.is_file() or entry.name in _WRITTEN or entry.name.endswith(_WEIGHT_SUFFIXES) \
                or entry.name.endswith(".index.json"):
            continue
        shutil.copy2(entry, folder / entry.name)
        copied.append(entry.name)
    return copied


def write_folder(planned: PlannedModel, folder: str | os.PathLike) -> dict[str, Any]:
    """Write the planned model into `folder` (an empty staging folder) in compressed-tensors' layout; returns
    what was written: the formats the library chose, the config groups, the float modules, the files."""
    import copy

    _require()
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config

    folder = Path(folder)
    experts = [m for m in planned.modules if m.expert is not None]  # stored per expert after the save
    schemes, quantized = _config_groups([m for m in planned.modules if m.expert is None])
    model = copy.deepcopy(planned.model)  # compressed in place; planned.model stays the reference
    # a model computed in a low precision is stored in it (the runtime loads every parameter in it anyway);
    # one computed in float32 keeps the source's dtype where that is lossless
    low = planned.compute_dtype is not torch.float32
    dtype = planned.compute_dtype if low else source_dtype(planned.info)
    kept = _in_source_dtype(model, dtype, set(quantized), rounded=low)
    with quiet_model_io():
        if schemes:
            apply_quantization_config(model, QuantizationConfig(config_groups=schemes, quantization_status="frozen"),
                                      show_progress=False)
            for name, mq in quantized.items():
                _set_params(model.get_submodule(name), mq)
            compressor = ModelCompressor.from_pretrained_model(model)
            compressor.compress_model(model)  # from the float32 weights: codes re-derived exactly
            if low:  # the scales computed in that precision are values of it: stored in it, without loss
                _scales_in(model, dtype, quantized)
        model.save_pretrained(folder)
        if schemes:
            compressor.update_config(str(folder))
        # experts transformers saves fused but loads per expert from a compressed-tensors folder, rewritten so
        # (first: the quantized ones then replace their per-expert float tensors)
        quantized_folder = any(mq.grid is not None for mq in experts or ()) or \
            "quantization_config" in json.loads((folder / "config.json").read_text())
        unfused = unfused_for_loader(folder, model) if quantized_folder else []
        # experts held fused, written per expert (read back fused by `expert_loading.per_expert_loading`)
        unfused += split_fused(folder, model, planned.info) if quantized_folder and experts else []
        routed = write_experts(folder, planned, experts, _set_params, module_args, dtype) if experts else None
        # float tensors its loader concatenates, which it cannot find once a quantization config is present
        concatenated = concatenated_for_loader(folder, model) if quantized_folder else []
    copied = _copy_side_files(Path(planned.info.path), folder)
    config = json.loads((folder / "config.json").read_text())
    if dtype is not torch.float32:  # served in the source's dtype, as the source checkpoint is
        name = str(dtype).removeprefix("torch.")
        config.update({"dtype": name, "torch_dtype": name})
        write_text(folder / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    qc = config.get("quantization_config", {})
    floats = [m.module for m in planned.modules if m.module not in quantized and m.grid is None]
    return {"format": FORMAT_NAME, "compression_format": qc.get("format"),
            "config_groups": len(qc.get("config_groups") or {}), "routed_experts": routed,
            "experts_written_per_expert": unfused, "written_concatenated": concatenated,
            "quantized_modules": len(quantized) + ((routed or {}).get("quantized") or 0), "float_ffn_modules": floats, "ignore": qc.get("ignore", []),
            "copied": copied, "files": _files(folder),
            "float_dtype": {"source": str(source_dtype(planned.info)).removeprefix("torch."),
                            "stored": str(dtype).removeprefix("torch."),
                            "compute": str(planned.compute_dtype).removeprefix("torch."), **kept}}


def _in_source_dtype(model: torch.nn.Module, dtype: torch.dtype, quantized: set[str],
                     rounded: bool = False) -> dict[str, Any]:
    """The float parameters outside the quantized modules stored in `dtype` where that is lossless (every value
    exactly representable: they came from the source checkpoint); the others (a norm that took a folded
    smoothing scale) stay float32, listed. With `rounded` (the model computes in `dtype`, which is how the
    runtime loads every parameter), those are rounded to `dtype` too, listed as `rounded`."""
    if dtype is torch.float32:
        return {"converted": 0, "kept_float32": [], "rounded": []}
    kept, converted, rounded_names = [], 0, []
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if module_name in quantized:
                continue
            for name, p in list(module.named_parameters(recurse=False)):
                if not p.is_floating_point() or p.dtype is dtype:
                    continue
                low = p.detach().to(dtype)
                full = f"{module_name}.{name}" if module_name else name
                if torch.equal(low.to(p.dtype), p.detach()):
                    p.data = low  # the same Parameter: a tied head follows its embedding
                    converted += 1
                elif rounded:
                    p.data = low
                    rounded_names.append(full)
                else:
                    kept.append(full)
    return {"converted": converted, "kept_float32": kept, "rounded": rounded_names}


def _scales_in(model: torch.nn.Module, dtype: torch.dtype, quantized: Mapping[str, Any]) -> None:
    """The quantized modules' float parameters (scales) in `dtype`; each must be a value of it (the grids were
    rounded to it: `precision.in_dtype`), else the folder would not hold the measured model."""
    with torch.no_grad():
        for name in quantized:
            module = model.get_submodule(name)
            for pname, p in list(module.named_parameters(recurse=False)):
                if p.is_floating_point() and p.dtype is not dtype:
                    low = p.detach().to(dtype)
                    if not torch.equal(low.to(p.dtype), p.detach()):
                        raise FFNQuantError(f"{name}.{pname} is not a {str(dtype).removeprefix('torch.')} value: the "
                                            "planned model was not computed in that dtype")
                    p.data = low


def _files(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}


def verify_folder(folder: str | os.PathLike, planned: PlannedModel, plan_ratio: float | None = None) -> dict[str, Any]:
    """The folder loaded back and checked against the measurement (`ctproof.verify_folder`, which says what)."""
    _require()
    return ctproof.verify_folder(folder, planned, plan_ratio)


def folder_bytes(folder: str | os.PathLike, weights_only: bool = True) -> int:
    """Bytes on disk of a model folder's weight files (or of every file)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir()
               if p.is_file() and (not weights_only or p.name.endswith(".safetensors")))
