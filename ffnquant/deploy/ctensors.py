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
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..backends import ASYMMETRIC_INT4_MEASURED, CTENSORS_SUPPORTED, ROTATE_WHY, supports
from ..errors import FFNQuantError, first_line
from ..hf import compare_models, load_ffn_layers
from ..hf.capture import ffn_input_hooks, require_transformers
from ..hf.skeleton import causal_lm_class
from ..infra.atomic import write_text
from ..infra.thirdparty import captured_detail, quiet_model_io
from ..model import FFN
from ..numerics.accuracy import sqnr_db
from ..schemes import ActMode
from .ctfiles import concatenated_for_loader, decompressed_weights, input_qparams_check, safetensors_reader, weights_check
from .expert_loading import per_expert_loading, split_fused
from .experts import has_experts, plan_experts_refusal, unfused_for_loader, write_experts
from .planned import ModuleQuant, PlannedModel, loaded_ffn
from .precision import dtype_name, input_args, source_dtype
from .proof import end_to_end_gates, generation_equality, rounding_allowance, unfolded_ffns

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..methods.fakequant import QuantizedFFN
    from ..planning.planfile import Plan
    from ..recipe import Recipe
    from ..schemes import Scheme
    from ..spec import FFNSpec

__all__ = ["FORMAT_NAME", "SUPPORTED", "LOAD_TOLERANCE", "ASYMMETRIC_INT4_MEASURED", "ctensors_available",
           "recipe_refusal", "plan_refusal", "packed_beside_inputs", "module_args", "write_folder", "decompressed_weights", "verify_folder",
           "folder_bytes"]

FORMAT_NAME = "compressed-tensors"
# What this writer stores, said in every refusal (the compressed-tensors backend's declaration).
SUPPORTED = CTENSORS_SUPPORTED
# The proof's bound: the loaded folder's perplexity equals the plan's measured one within this, relative.
LOAD_TOLERANCE = 1e-3
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


def _layer_parity(loaded: Any, planned: PlannedModel) -> dict[str, Any]:
    """Each FFN of the loaded folder against ffnquant's quantized FFN on the SAME inputs (those the loaded model
    feeds it on the first held-out sequence: a layer's every output element compared, which one sequence shows as
    a batch does; routed experts on the first batch, as one sequence reaches few of them): bit for bit, or apart
    by rounding ties only.

    compressed-tensors rounds x / scale + zero_point in float32 where ffnquant, like ONNX QuantizeLinear and
    the int8 kernels, rounds x / scale and then adds the zero point: a value within float32 rounding of a half
    step can land on the neighbouring code. Each such tie is one step on one element, so a layer is at parity
    when the two outputs differ by at least 20 dB less than the layer's own quantization noise."""
    info = planned.info
    layers = [layer.info for layer in load_ffn_layers(info, "all")]
    captured: dict[str, torch.Tensor] = {}
    with torch.no_grad(), ffn_input_hooks(loaded, info, layers, lambda l, x: captured.setdefault(l.label, x)):
        routed = any(layer.expert is not None for layer in info.layers)
        loaded(planned.evals[0] if routed else planned.evals[0][:1], use_cache=False)
    roles = sorted(info.arch.roles, key=len, reverse=True)  # a role may be dotted (BERT's intermediate.dense)

    def ffn_module(mq: ModuleQuant) -> str:
        role = next((r for r in roles if mq.module.endswith("." + r)), mq.module.rsplit(".", 1)[1])
        return mq.module[: -len(role) - 1]

    names = {mq.layer: (mq.fused or ffn_module(mq), mq.expert) for mq in planned.modules}
    layer_db = {r["label"]: r["accuracy_torch"]["sqnr_db"] for r in planned.rows}  # each layer's quantization noise
    # a shared FFN whose calls compute differently is called with the calling layer's index, as the model calls it
    blocks = {layer.label: layer.block for layer in layers} if info.calls_differ() else {}
    rows = []
    for label, x in captured.items():
        q = planned.qffns[label]
        # as [batch, tokens, features]: compressed-tensors' per-token ranges keep the first two axes of what it gets
        x = x.reshape(1, -1, x.shape[-1]).to(planned.compute_dtype)  # captured as float32: the model's values
        with torch.no_grad():
            ours = q(x)
            theirs = loaded_ffn(loaded, info, *names[label], layer_idx=blocks.get(label))(x)
        parity_db, noise_db = sqnr_db(ours, theirs), layer_db[label]
        exact = bool(torch.equal(ours, theirs))
        row = {"layer": label, "bit_identical": exact, "parity_sqnr_db": parity_db, "layer_sqnr_db": noise_db,
               "at_parity": exact or parity_db >= noise_db + 20.0, "note": None}
        if not row["at_parity"] and _symmetric_per_token_int(q.scheme) and planned.compute_dtype is torch.float32:
            with torch.no_grad():
                convention_db = sqnr_db(_with_ct_per_token_scale(q)(x), theirs)
            row.update(at_parity=convention_db >= noise_db + 20.0, convention_parity_sqnr_db=convention_db,
                       note=CT_PER_TOKEN_NOTE)
        rows.append(row)
    return {"layers": len(rows), "bit_identical": sum(r["bit_identical"] for r in rows),
            "all_at_parity": all(r["at_parity"] for r in rows), "rows": rows}


CT_PER_TOKEN_NOTE = ("symmetric per-token int8: compressed-tensors' torch emulation, which transformers runs, scales by "
                     "absmax / 127.5 where ffnquant and the int8 kernels (vLLM's, torch._int_mm's) use absmax / 127; "
                     "at parity with ffnquant's numerics under that convention")


def _symmetric_per_token_int(scheme: Scheme) -> bool:
    return scheme.act_mode is ActMode.DYNAMIC and scheme.act_dtype.is_integer and bool(scheme.act_symmetric)


def _with_ct_per_token_scale(qffn: QuantizedFFN):
    """ffnquant's quantized FFN with compressed-tensors' symmetric per-token scale (absmax / ((qmax - qmin) / 2))
    at its quantized sites: the same weights and grids, only that convention changed."""
    ffn = FFN(qffn.model.spec, activation=qffn.model.own_activation())
    ffn.load_state_dict(qffn.model.state_dict(), strict=False)
    ffn.input_transform = qffn.model.input_transform  # an unfolded FFN's input scale (the state dict skips it)
    ffn.eval()

    def per_token(mod, inp, out):
        xf = out.float()
        amax = xf.abs().amax(dim=-1, keepdim=True)
        scale = torch.where(amax > 0, amax / 127.5, torch.full_like(amax, torch.finfo(torch.float32).eps))
        return (torch.clamp(torch.round(xf / scale), -128, 127) * scale).to(out.dtype)

    for site in qffn.quantized_sites:
        ffn.taps[site].register_forward_hook(per_token)
    return ffn


CT_PER_TOKEN_CONVENTION = "compressed-tensors' symmetric per-token int8 scale absmax / 127.5 (ffnquant's: absmax / 127)"


def _ct_numerics(qffn: QuantizedFFN) -> Any:
    """A quantized FFN as the loaded folder computes it: with compressed-tensors' per-token scale where the layer
    quantizes symmetric per-token int8 activations (`CT_PER_TOKEN_NOTE`), as it is otherwise."""
    scheme = getattr(qffn, "scheme", None)
    if scheme is not None and qffn.quantized_sites and _symmetric_per_token_int(scheme):
        return _with_ct_per_token_scale(qffn)
    return qffn


def verify_folder(folder: str | os.PathLike, planned: PlannedModel, plan_ratio: float | None = None) -> dict[str, Any]:
    """The proof that `folder` is the measured model, in four checks.

    1. `weights`: every FFN weight decompressed by compressed-tensors from the files equals ffnquant's
       dequantized reference bit for bit; every float FFN weight is stored as it was.
    2. `inputs`: every static input scale and zero point in the files is the calibrated one, exactly.
    3. `layers`: each FFN of the folder loaded by transformers, fed the same inputs as ffnquant's FFN, gives the
       same output, bit for bit or apart by rounding ties only (`_layer_parity`).
    4. `load`: the folder loaded with `AutoModelForCausalLM.from_pretrained` (float32), scored against the
       ORIGINAL float model on the held-out batches (perplexity, final hidden SQNR, KL), each figure gated against
       ffnquant's torch reference of the plan (also measured against the original model) within twice what float32
       rounding alone moves it, measured on the original, unfolded model, or LOAD_TOLERANCE relative (`proof.end_to_end_gates`,
       `proof.rounding_allowance`); symmetric per-token layers are taken under compressed-tensors' convention
       (`CT_PER_TOKEN_CONVENTION`, its cost reported). The perplexity against the recorded reference within
       LOAD_TOLERANCE relative (`meets`) and the plan's own recorded figure (`plan_ratio`) are reported too.
    5. `generation`: greedy generation with a KV cache of the loaded folder against ffnquant's reference of the
       plan (under compressed-tensors' per-token convention where the gates take it: `convention`)
       (`proof.generation_equality`), token for token: reported, not a gate (a folded norm is rounded once
       more than the unfolded reference, which may turn a near-tie of two tokens).
    `proven`: 1-3 hold, every end-to-end gate holds, and transformers initialised no tensor at random
    (`missing_from_files`).
    """
    _require()

    transformers = require_transformers()
    folder = Path(folder)
    # the original float model's figures (kept from the reference's run): the loaded folder and the allowance runs
    # are scored on them
    references = planned.references()
    dtype = planned.compute_dtype
    causal = causal_lm_class(transformers, folder)
    decompressed = None  # why transformers could not run the compressed modules, where it loaded them decompressed
    try:
        loaded, loading = _load(causal, folder, dtype)
    except Exception as exc:  # noqa: BLE001 - transformers' loader refusing the folder's compressed modules
        # transformers' own words for a failed conversion, printed in its loading report, not in the exception
        first = f"{type(exc).__name__}: {captured_detail(exc) or first_line(exc)}"
        # a model whose own code reads `.weight` of a Linear compressed-tensors replaced (GPT-BigCode's init, Zamba's
        # tied shared block): transformers' documented load of the folder decompressed, where that computes the
        # plan: decompressed Linears compute on float inputs, so not where the plan quantizes inputs (not loaded)
        inputs = sorted({(mq.index, mq.layer) for mq in planned.modules if mq.input_mode is not None})
        if inputs:
            names = [label for _, label in inputs]
            return _not_loaded(folder, planned, (
                f"transformers cannot load the folder: {first}; decompressed (run_compressed=False), its Linears would "
                f"drop the input quantization of {', '.join(names[:4])}{' and more' if len(names) > 4 else ''}, so "
                "it would not compute what was measured"))
        try:
            loaded, loading = _load(causal, folder, dtype, run_compressed=False)
            decompressed = first
        except Exception as exc2:  # noqa: BLE001 - no deployment, said with its reason; the files are still checked
            why = (f"transformers cannot load the folder: {first}"
                   + (f" (nor decompressed: {type(exc2).__name__}: {captured_detail(exc2) or first_line(exc2)})"
                      if first_line(exc2) != first_line(exc) else ""))
            return _not_loaded(folder, planned, why)
    with quiet_model_io():
        figures = compare_models(None, loaded, planned.info, planned.evals, references=references)
        layers = _layer_parity(loaded, planned)
        unfolded = unfolded_ffns(planned)  # ffnquant's reference of the plan, for both checks below
        # symmetric per-token layers run under compressed-tensors' convention: the folder is gated against
        # ffnquant's reference computed that way (on the original model), and what the convention costs is reported
        # beside it (a model computed in a low precision already runs compressed-tensors' own quantizers:
        # precision.in_dtype); its generation is compared with that reference too, since a convention's rounding
        # turns near-ties of two tokens as any rounding does
        convention = dtype is torch.float32 and any(_ct_numerics(q) is not q for q in planned.qffns.values())
        generated_as = {layer: _ct_numerics(q) for layer, q in unfolded.items()} if convention else unfolded
        generation = generation_equality(planned, loaded, ffns=generated_as)
        generation["convention"] = CT_PER_TOKEN_CONVENTION if convention else None
    del loaded
    reference = planned.reference["end_to_end"]
    ref_ratio = reference.get("perplexity_ratio")
    load = {"loaded_with": f"transformers {transformers.__version__} {causal.__name__} ({dtype_name(dtype)})"
                           + (", decompressed (CompressedTensorsConfig(run_compressed=False))" if decompressed else ""),
            "decompressed_because": decompressed,
            # experts the model holds fused, read from their per-expert tensors through ffnquant's converters
            "per_expert_loading": loading.get("per_expert") or [],
            "compute_dtype": dtype_name(dtype), **figures,
            "reference_perplexity_ratio": ref_ratio, "reference_hidden_sqnr_db": reference.get("hidden_sqnr_db"),
            "reference_kl_mean": (reference.get("kl") or {}).get("mean"),
            "plan_perplexity_ratio": plan_ratio, "tolerance": LOAD_TOLERANCE}
    if figures.get("perplexity") is not None and ref_ratio is not None:
        rel = abs(figures["perplexity_ratio"] / ref_ratio - 1.0)  # the float perplexity is the same in both
        load.update(relative_difference=rel, meets=rel <= LOAD_TOLERANCE)
        if plan_ratio is not None:
            plan_rel = abs(figures["perplexity_ratio"] / plan_ratio - 1.0)
            load.update(plan_relative_difference=plan_rel, meets_plan=plan_rel <= LOAD_TOLERANCE)
    allowance = rounding_allowance(planned, references, ffns=unfolded, numerics=_ct_numerics if convention else None,
                                   numerics_name=CT_PER_TOKEN_CONVENTION if convention else None,
                                   deployed=figures, ppl_tolerance=LOAD_TOLERANCE)
    load.update(allowance=allowance, gates=end_to_end_gates(figures, allowance, LOAD_TOLERANCE))
    reader = safetensors_reader(folder)  # the files' tensor index, read once for both checks
    weights = weights_check(folder, planned, reader)
    inputs = input_qparams_check(planned, reader)
    # a proof needs evidence: a held-out text too short for one generation prompt, or no end-to-end tokens, proves
    # nothing about the loaded model's generation (0 of 0 prompts is not "all equal")
    # tensors the loaded model wanted and the folder lacks were initialised at random by transformers: said by name
    missing = sorted(loading.get("missing_keys") or [])
    unproven = [why for ok, why in (
        (not missing, f"transformers initialised {len(missing)} tensor(s) at random, missing from the files "
                      f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"),
        (weights["all_identical"], "weights differ"), (inputs["all_equal"], "static input qparams differ"),
        (layers["all_at_parity"], "layers not within rounding ties"), (load["gates"]["met"], "end-to-end gates not met"),
        # transformers failing to generate with the model class at all is said in `generation["skipped"]`
        (generation["prompts"] > 0 or generation.get("skipped"), f"no generation prompt: the held-out text has {figures.get('n_tokens') or 0} "
                                    "tokens, fewer than one 16-token prompt; give a longer --eval-text")) if not ok]
    return {"proven": not unproven, "unproven": unproven, "weights": weights, "inputs": inputs, "layers": layers,
            "load": load, "generation": generation, "missing_from_files": missing}


def _not_loaded(folder: Path, planned: PlannedModel, why: str) -> dict[str, Any]:
    """The proof of a folder transformers cannot load as planned: not proven, its reason, the files still checked."""
    reader = safetensors_reader(folder)
    return {"proven": False, "unproven": [why], "not_loaded": why, "weights": weights_check(folder, planned, reader),
            "inputs": input_qparams_check(planned, reader)}


def _load(causal: Any, folder: Path, dtype: torch.dtype, run_compressed: bool = True) -> tuple[Any, dict]:
    """The folder loaded by transformers with its own modules, in eval mode, and its loading report; with
    `run_compressed=False`, its compressed Linears decompressed as they load (transformers' own option). Routed
    experts the model holds fused are read from their per-expert tensors (`expert_loading.per_expert_loading`,
    listed in the report as "per_expert")."""
    kw: dict[str, Any] = {}
    if not run_compressed:
        from transformers import CompressedTensorsConfig

        kw["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    with quiet_model_io(), warnings.catch_warnings(), per_expert_loading(folder) as per_expert:
        if kw:  # transformers warns that the folder's own quantization_config is kept beside the option passed
            warnings.simplefilter("ignore", UserWarning)
        loaded, loading = causal.from_pretrained(str(folder), dtype=dtype, use_kernels=False, output_loading_info=True,
                                                 **kw)
    return loaded.eval(), {**loading, "per_expert": per_expert}


def folder_bytes(folder: str | os.PathLike, weights_only: bool = True) -> int:
    """Bytes on disk of a model folder's weight files (or of every file)."""
    return sum(p.stat().st_size for p in Path(folder).iterdir()
               if p.is_file() and (not weights_only or p.name.endswith(".safetensors")))
