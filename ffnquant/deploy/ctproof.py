"""The proof that a compressed-tensors folder (`deploy.ctensors`) is the measured model: the folder loaded back by
transformers (decompressed where it cannot run the compressed modules) as `ct_loading.transformers_loading` has it
load (routed experts held fused read from their per-expert tensors, the model's conversions of float tensors kept), its weights and static ranges against ffnquant's bit for bit, each FFN on the
same inputs, the end-to-end gates and greedy generation (`verify_folder`)."""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import first_line
from ..hf import compare_models, load_ffn_layers
from ..hf.capture import ffn_input_hooks, require_transformers
from ..hf.draft import feed
from ..hf.skeleton import causal_lm_class
from ..infra.thirdparty import captured_detail, quiet_model_io
from ..model import FFN
from ..numerics.accuracy import sqnr_db
from ..schemes import ActMode
from .ctfiles import input_qparams_check, safetensors_reader, weights_check
from .ct_loading import transformers_loading
from .planned import ModuleQuant, PlannedModel, loaded_ffn
from .precision import dtype_name
from .proof import end_to_end_gates, generation_equality, rounding_allowance, unfolded_ffns

if TYPE_CHECKING:  # annotations only
    from ..methods.fakequant import QuantizedFFN
    from ..schemes import Scheme

__all__ = ["LOAD_TOLERANCE", "verify_folder"]

LOAD_TOLERANCE = 1e-3


def _gates_why(allowance: dict) -> str:
    """Why the end-to-end gates are not met, where the original model itself is the cause."""
    if allowance.get("deterministic") is False and not allowance.get("reproduces_reference"):
        return ("end-to-end gates not met: the original model's own forward is not deterministic (two runs on the "
                "same text differ: an attention that draws at random, such as LSH hashing without a seed), and "
                "ffnquant's recorded reference lies further from a plain run than the gates allow a deployed folder")
    return "end-to-end gates not met"


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
    (`missing_from_files`). compressed-tensors' presence is checked by the caller (`ctensors.verify_folder`).
    """
    transformers = require_transformers()
    folder = Path(folder)
    # the original float model's figures (kept from the reference's run): the loaded folder and the allowance runs
    # are scored on them
    references = planned.references()
    dtype = planned.compute_dtype
    causal = causal_lm_class(transformers, folder)
    decompressed = None  # why transformers could not run the compressed modules, where it loaded them decompressed
    try:
        loaded, loading = _load(causal, folder, dtype, like=planned.float_model)
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
            loaded, loading = _load(causal, folder, dtype, run_compressed=False, like=planned.float_model)
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
            # the model's conversions of tensors stored in float, kept as without a quantization config
            "float_converters_kept": loading.get("float_converters") or [],
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
        (layers["all_at_parity"], "layers not within rounding ties"), (load["gates"]["met"], _gates_why(allowance)),
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


def _load(causal: Any, folder: Path, dtype: torch.dtype, run_compressed: bool = True,
          like: Any = None) -> tuple[Any, dict]:
    """The folder loaded by transformers with its own modules, in eval mode, and its loading report (a draft model
    run through the target its original `like` is: `hf.draft.feed`); with
    `run_compressed=False`, its compressed Linears decompressed as they load (transformers' own option). Inside
    `ct_loading.transformers_loading`, as a user loads it: routed experts the model holds fused read from their
    per-expert tensors (listed in the report as "per_expert"), the model's conversions of float tensors kept
    ("float_converters")."""
    kw: dict[str, Any] = {}
    if not run_compressed:
        from transformers import CompressedTensorsConfig

        kw["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    with quiet_model_io(), warnings.catch_warnings(), transformers_loading(folder) as needed:
        if kw:  # transformers warns that the folder's own quantization_config is kept beside the option passed
            warnings.simplefilter("ignore", UserWarning)
        loaded, loading = causal.from_pretrained(str(folder), dtype=dtype, use_kernels=False, output_loading_info=True,
                                                 **kw)
    # a draft model runs from the held-out token ids through its target, as the original did (`hf.draft`)
    return feed(loaded, str(folder), like=like).eval(), {**loading, **needed}
