"""A planned model as one ONNX graph: the causal LM exported whole, its FFN matmuls rewritten as the plan
quantized them, scored and timed on onnxruntime's CPU provider.

The graph is the cached decoder of `deploy.onnx_decoder` (past/present key-value inputs and outputs, one graph
for prefill and decode, greedy generation checked against transformers'); where a model does not export with
a cache, the prefill graph (`input_ids` -> `logits`, `last_hidden`, no cache) with the reason.

The graph is exported from `PlannedModel.model` (input scales folded into the norms, ffnquant's dequantized
FFN weights), so every FFN weight in it already lies on its grid: the rewrite recovers the integer codes from
the `ModuleQuant` grids and never quantizes anything again. Per FFN matmul:

- int8 weights, static input: QDQ as `onnxquant.write_qdq` writes it (the calibrated SiteRange on the input,
  int8 codes and per-channel DequantizeLinear on the weight); onnxruntime fuses it into integer matmuls.
- int8 weights, dynamic input: ffnquant's per-token range computed with ONNX ops (ReduceMin/Max, Round,
  Clip), the codes multiplied in MatMulInteger (exact int32 sums), then scaled per token and per channel.
  onnxruntime's DynamicQuantizeLinear is per tensor, which is not ffnquant's numerics.
- int8 weights, float input (w8a16): the weight's DequantizeLinear only.
- 4-bit group weights, float input: MatMulNBits with the grid's codes (`onnxmatmul.nbits_node`).
- a block-Hadamard rotation on the hidden site: a MatMul by the block before w_down (w_down carries it).
- float weights and input: the exported MatMul, untouched.
fp8 grids, llm-int8's outlier split and 4-bit weights with quantized inputs are refused with the reason.
"""

from __future__ import annotations

import inspect
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from ..backends import register_backend, supports
from ..errors import FFNQuantError, first_line
from ..hf import compare_models
from ..hf.arch import ModelKind
from ..hf.inputs import position_limit
from ..infra.atomic import ScratchFolder, atomic_path
from ..measure.latency import latency_stats
from ..methods import handler_for, quantize_linear
from ..methods.fakequant import WEIGHT_INPUT_SITE, SiteRange
from ..onnx.export import DEFAULT_OPSET, without_stack_traces
from ..onnx.onnxquant import ort_session
from ..onnx.ortcpu import int8_kernels, saturating
from ..schemes import ActMode, Method
from .onnx_decoder import (cached_run, compare_outputs, decode_latency, export_decoder, float_tolerance,
                           generation_check, greedy_generate, interleaved_times, is_decoder, prefill_feed, quiet)
from .onnx_experts import ExpertsInGraph
from .onnx_rewrite import module_kind, quantize_graph
from .planned import ModuleQuant, deployable_refusal

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..recipe import Recipe
    from ..schemes import Scheme
    from ..spec import FFNSpec
    from .planned import PlannedModel

__all__ = [
    "PPL_TOLERANCE",
    "graph_refusal",
    "recipe_refuser",
    "float_tolerance",
    "export_float_graph",
    "score_graph",
    "graph_latency",
    "write_model_graph",
]

# What a written graph must meet: its perplexity within 0.5% (relative) of ffnquant's torch reference.
PPL_TOLERANCE = 0.005
# One ONNX file is one protobuf message, which cannot exceed 2 GiB; larger models need external data files,
# which this writer does not produce (every model it takes fits, so one self-contained file is the format).
PROTOBUF_LIMIT = 2**31
# Peak memory of writing the graph, in fp32 weight copies: the exported proto, its serialization (check and
# save), the float graph loaded again for the rewrite, and two onnxruntime sessions (weights plus prepacked).
EXPORT_COPIES = 5
OUTPUTS = ("logits", "last_hidden")


def graph_refusal(info: ModelInfo) -> str | None:
    """Why `info`'s model cannot be written as one ONNX graph here (one line); None when it can."""
    from ..infra.resources import available_memory, human_bytes

    if info.kind is not ModelKind.CAUSAL_LM:
        return f"{info.model_type}: the whole-model graph is written for causal LMs (logits), not {info.kind.value} models"
    why = deployable_refusal(info, "onnx")
    if why is not None:
        return why
    from ..hf.draft import folder_draft_refusal

    if folder_draft_refusal(info.path) is not None:
        return (f"{info.model_type}: a draft model, whose forward takes its target model's states at each position "
                "(embeddings, hidden and key/value states), not token ids; a graph of it alone is not a model that "
                "generates, and the per-layer ONNX artifacts store its FFNs")
    weights = 4 * int(info.n_params_total)
    # the exporter may store a tied embedding twice: [V, d] for the lookup, transposed for the logits
    tied = 4 * int(info.config.get("vocab_size") or 0) * info.spec.d_model if info.config.get("tie_word_embeddings") else 0
    if weights + tied >= PROTOBUF_LIMIT:
        return (f"{info.model_type}: its fp32 graph would hold {human_bytes(weights + tied)} of weights, over the 2 GiB "
                "a single ONNX protobuf can hold; external-data graphs are not written")
    have = available_memory()
    if have is not None and EXPORT_COPIES * weights > have:
        return (f"{info.model_type}: writing its graph takes about {human_bytes(EXPORT_COPIES * weights)} "
                f"({EXPORT_COPIES} fp32 copies of {human_bytes(weights)}); this machine has {human_bytes(have)} available")
    return None


def recipe_refuser(info: ModelInfo) -> Callable[[Any], str | None]:
    """recipe -> why `export --format onnx` cannot write it as planned on `info`'s model (one line), None when it
    can; decided from the recipe alone. Where the model gets its whole graph (`graph_refusal` is None), the
    onnx-graph backend's answer (what the graph's rewrite refuses, `module_kind`); where it does not, a recipe
    without a per-layer artifact (the onnx-artifact backend's: its layers would have no file)."""
    from .experts import has_experts
    from .onnx_experts import experts_recipe_refusal

    graph_why = graph_refusal(info)  # once: it reads the machine's memory
    routed = has_experts(info)

    def refusal(recipe: Recipe) -> str | None:
        if graph_why is not None:
            art = supports("onnx-artifact", recipe)
            return None if art.ok else (f"recipe {recipe} has no per-layer ONNX artifact ({art.note}) and this "
                                        f"model gets no whole-model graph ({graph_why})")
        # routed experts are one QMoE node per layer (`deploy.onnx_experts`), which stores fewer recipes
        return supports("onnx-graph", recipe, info.spec).why or (experts_recipe_refusal(recipe, info) if routed else None)

    return refusal


def _graph_support(recipe: Recipe, spec: FFNSpec) -> tuple[str | None, str]:
    """The onnx-graph backend's decision: what the rewrite writes for each FFN matmul under `recipe`, or why not."""
    if spec is None:
        raise FFNQuantError("the onnx-graph backend decides for a model's FFN shape: pass its spec "
                            "(supports('onnx-graph', recipe, info.spec))")
    try:
        kinds = {m.weight: module_kind(m) for m in _recipe_modules(recipe, spec)}
    except FFNQuantError as exc:
        # module_kind names the matmul and the recipe; the recipe leads this line already
        said = str(exc).replace(f" (recipe {recipe})", "")
        return None, f"recipe {recipe} cannot be written in the whole-model ONNX graph: {said}"
    return ",".join(sorted(set(kinds.values()))), ", ".join(f"{w}: {k}" for w, k in kinds.items())


def _recipe_modules(recipe: Recipe, spec: FFNSpec) -> list[Any]:
    """The `ModuleQuant`s a layer under `recipe` would get: each weight's grid is what the scheme's method handler
    makes of a small stand-in weight of the layer's input width (`methods.quantize_linear`), the input quantizer
    a stand-in range of the scheme's integer type. FFNQuantError for weights without a grid."""
    scheme = recipe.resolve()
    weights, sites = recipe.quantized_parts(spec)
    out = []
    for weight in spec.weight_names:
        site = WEIGHT_INPUT_SITE[weight]
        grid = None
        if weight in weights and not scheme.weight_dtype.is_float:
            width = spec.d_model if site == "input" else spec.d_ff
            stand_in = torch.linspace(-1.0, 1.0, 2 * width).reshape(2, width)
            # a method that reads calibration data (GPTQ, AWQ) chooses other codes on round-to-nearest's grid
            grid_of = scheme.with_(method="rtn") if handler_for(scheme).needs_hessians else scheme
            grid = quantize_linear(stand_in, grid_of).grid
            if grid is None:
                raise FFNQuantError(f"its weights have no integer or fp8 grid ({_no_grid_why(scheme)})")
        mode = None
        if site in sites and not scheme.act_dtype.is_float:
            mode = "dynamic" if scheme.act_mode is ActMode.DYNAMIC else "static"
        rng = None
        if mode == "static":
            qmin, qmax = {"uint8": (0, 255), "int8": (-128, 127)}.get(scheme.act_dtype.value, (0, 0))
            rng = SiteRange(site, -1.0, 1.0, 1.0, 0, qmin, qmax, scheme.act_dtype.value, "", 0.0, -1.0, 1.0)
        out.append(ModuleQuant(module=weight, layer="", index=0, weight=weight, site=site, recipe=str(recipe),
                               scheme=scheme, grid=grid, input_mode=mode, input_range=rng))
    return out


def _no_grid_why(scheme: Scheme) -> str:
    return "HQQ's float zero points" if scheme.method is Method.HQQ else f"bitsandbytes' {scheme.weight_dtype.value} codes"


register_backend("onnx-graph", "the whole causal LM as one ONNX graph with its FFN matmuls rewritten (QDQ, per-token "
                 "MatMulInteger, MatMulNBits)", _graph_support)


# --- export ------------------------------------------------------------------------------------------

class _Prefill(nn.Module):
    """The causal LM as the graph computes it: token ids -> (logits, final hidden state), no KV cache."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=input_ids, use_cache=False, output_hidden_states=True, return_dict=True)
        return out.logits, out.hidden_states[-1]


def _parity(model: nn.Module, info: ModelInfo, path: Path, ids: torch.Tensor) -> dict[str, Any]:
    session = ort_session(path)
    got = session.run(list(OUTPUTS), {"input_ids": ids.numpy().astype(np.int64)})
    with torch.no_grad():
        ref = [t.float().numpy() for t in _Prefill(model)(ids)]
    return {"shape": list(ids.shape), "provider": session.get_providers()[0],
            **compare_outputs(path, info, dict(zip(OUTPUTS, got)), dict(zip(OUTPUTS, ref)))}


def _fixed_input_dims(proto: Any) -> list[tuple[str, int]]:
    """The input_ids dimensions an exported graph fixed to a number: [(batch|seq, size)], empty when both are
    symbolic."""
    for value in proto.graph.input:
        if value.name == "input_ids":
            dims = value.type.tensor_type.shape.dim
            return [(axis, d.dim_value) for axis, d in zip(("batch", "seq"), dims) if d.HasField("dim_value")]
    return []


def _export(model: nn.Module, info: ModelInfo, path: str | os.PathLike, opset: int, ids: torch.Tensor | None) -> dict[str, Any]:
    import onnx

    model = model.eval()
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    example = torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(0))
    if "dynamo" not in inspect.signature(torch.onnx.export).parameters:
        raise FFNQuantError(f"torch {torch.__version__} has no dynamo ONNX exporter (torch >= 2.5 exports whole models)")
    with quiet(), torch.no_grad():
        batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
        try:
            program = torch.onnx.export(_Prefill(model), (example,), dynamo=True, opset_version=opset,
                                        dynamic_shapes={"input_ids": {0: batch, 1: seq}}, input_names=["input_ids"],
                                        output_names=list(OUTPUTS), verbose=False)
        except Exception as exc:  # the exporter's own (long, multi-line) report of an op or pattern it cannot take
            raise FFNQuantError(f"{info.model_type}: torch.onnx could not export the model: {first_line(exc)}") from exc
        proto = without_stack_traces(program.model_proto)  # no path of this machine in the graph
        del program
    fixed = _fixed_input_dims(proto)
    if fixed:  # torch.export specialised a dimension (a hybrid's state-space path, say): the graph takes one shape
        raise FFNQuantError(f"{info.model_type}: torch.onnx fixed the graph's input_ids dimension(s) "
                            f"{', '.join(f'{axis} to {n}' for axis, n in fixed)} (the example's), so the graph would run "
                            "only on inputs of that shape; the model's forward is not exportable with dynamic shapes")
    proto.ir_version = min(proto.ir_version, 10)  # onnxruntime reads IR <= 10
    onnx.helper.set_model_props(proto, {"ffnquant_graph": "fp32", "model_type": info.model_type,
                                        "exporter": "torch.onnx dynamo"})
    onnx.checker.check_model(proto, full_check=True)
    if ids is None:
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with atomic_path(path) as tmp:  # checked before it takes the name: a failed parity leaves no file
        onnx.save_model(proto, str(tmp))
        del proto
        parity = _parity(model, info, tmp, ids)
        if not parity["passed"]:
            worst = max(OUTPUTS, key=lambda k: parity[k]["max_abs_error"] / parity[k]["tolerance"])
            raise FFNQuantError(f"{path}: the fp32 graph's {worst} differs from torch by "
                                f"{parity[worst]['max_abs_error']:.3g} (tolerance {parity[worst]['tolerance']:.3g})")
    return parity


def export_float_graph(model: nn.Module, info: ModelInfo, path: str | os.PathLike, opset: int = DEFAULT_OPSET,
                       ids: torch.Tensor | None = None) -> Path:
    """`model` (a transformers causal LM) as one fp32 ONNX graph: input `input_ids` [batch, seq] (dynamic),
    outputs `logits` and `last_hidden` (hidden_states[-1]); prefill only, no KV cache. Checked on onnxruntime
    against torch on `ids` (default a random [2, 16] batch); FFNQuantError when they differ (`float_tolerance`)."""
    _export(model, info, path, opset, ids)
    return Path(path)


# --- measurement -------------------------------------------------------------------------------------

def score_graph(path: str | os.PathLike, planned: PlannedModel, cached: bool = True) -> dict[str, Any]:
    """The graph on onnxruntime's CPU provider over `planned.evals`, against the float model in torch
    (`hf.compare_models`: perplexity, final-hidden SQNR), beside ffnquant's torch reference of the same plan.

    Where this CPU's int8 kernel for the graph's activations saturates (`ortcpu`), `onnx` is what ran and the
    bound is checked on `graph`: the same graph with no integer kernel fused in, what exact kernels compute.
    A cached decoder is also scored through its cache (`cached`: `_cached_score`) when `cached`."""
    def figures(session) -> dict[str, Any]:
        def run(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            logits, hidden = session.run(list(OUTPUTS), prefill_feed(session, ids))
            return torch.from_numpy(logits), torch.from_numpy(hidden)

        return compare_models(planned.float_model, None, planned.info, planned.evals, candidate_run=run)

    session = ort_session(path)
    checked_session = session
    out: dict[str, Any] = {"onnx": figures(session)}
    if saturating(path):
        checked_session = ort_session(path, as_written=True)
        out["graph"] = figures(checked_session)
        out["int8_kernel"] = int8_kernels().describe()
    checked = out.get("graph", out["onnx"])
    ref = planned.reference["end_to_end"]
    rel = checked["perplexity"] / ref["perplexity"] - 1.0
    if cached and is_decoder(session):
        out["cached"] = _cached_score(checked_session, planned, checked, ref["perplexity"])
    return {**out, "reference": {"perplexity": ref["perplexity"], "hidden_sqnr_db": ref.get("hidden_sqnr_db")},
            "perplexity_rel_diff": rel, "tolerance": PPL_TOLERANCE, "meets_tolerance": abs(rel) <= PPL_TOLERANCE,
            "hidden_sqnr_db_diff": checked["hidden_sqnr_db"] - ref["hidden_sqnr_db"]
            if ref.get("hidden_sqnr_db") is not None else None,
            "provider": session.get_providers()[0], "providers": list(session.get_providers())}


def _cached_score(session: Any, planned: PlannedModel, once: dict[str, Any], ref_ppl: float) -> dict[str, Any]:
    """The same held-out batches through the cache (each row's first half in one call, then a token per call)
    against the same graph run at once: the logits may differ by float32 rounding only (attention sums over
    other lengths), so |ln ppl_cached - ln ppl_once| <= 2 x `float_tolerance` of the logits (a token's NLL
    moves by at most twice its largest logit change), and the reference bound holds on the cached figure."""
    info, worst = planned.info, {"diff": 0.0, "absmax": 0.0}

    def run(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits, hidden = cached_run(session, ids, max(1, ids.shape[1] // 2))
        at_once = session.run(["logits"], prefill_feed(session, ids))[0]
        worst["diff"] = max(worst["diff"], float(np.abs(logits.numpy() - at_once).max()))
        worst["absmax"] = max(worst["absmax"], float(np.abs(at_once).max()))
        return logits, hidden

    fig = compare_models(planned.float_model, None, info, planned.evals, candidate_run=run)
    tol = float_tolerance(worst["absmax"], info.n_layers, max(info.spec.d_model, info.spec.d_ff))
    log_diff = math.log(fig["perplexity"] / once["perplexity"])
    rel = fig["perplexity"] / ref_ppl - 1.0
    return {**fig, "how": "each row's first half in one call, then one token per call",
            "max_abs_logit_diff": worst["diff"], "logit_tolerance": tol,
            "perplexity_rel_diff_to_once": math.expm1(log_diff), "log_perplexity_tolerance": 2.0 * tol,
            "equals_once": abs(log_diff) <= 2.0 * tol, "perplexity_rel_diff": rel,
            "meets_tolerance": abs(rel) <= PPL_TOLERANCE, "provider": session.get_providers()[0]}


def graph_latency(float_path: str | os.PathLike, quant_path: str | os.PathLike, tokens: Sequence[int] = (1, 512),
                  rounds: int = 5, per_round: int = 1, warmup: int = 1, threads: int | None = None,
                  seed: int = 0) -> dict[str, Any]:
    """Side-by-side latency of the fp32 and quantized graphs on onnxruntime's CPU provider at batch 1 and each
    token count: interleaved rounds (each graph and size in every round, so machine drift hits all alike),
    p10/p50/p90 ms and the speedup (fp32 p50 / quantized p50). Cheap by default; ask for more rounds to publish."""
    if rounds < 1 or per_round < 1 or warmup < 0 or not tokens or min(tokens) < 1:
        raise FFNQuantError("graph_latency needs rounds >= 1, per_round >= 1, warmup >= 0 and token counts >= 1")
    sessions = {"float": ort_session(float_path, threads=threads), "quantized": ort_session(quant_path, threads=threads)}
    vocab = sessions["float"].get_outputs()[0].shape[-1]
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else 2
    rng = np.random.default_rng(seed)
    inputs = {n: prefill_feed(sessions["float"], rng.integers(0, vocab, (1, n), dtype=np.int64)) for n in tokens}
    times = interleaved_times(sessions, inputs, warmup=warmup, rounds=rounds, per_round=per_round)
    out: dict[str, Any] = {"provider": sessions["quantized"].get_providers()[0], "threads": threads or "onnxruntime default",
                           "rounds": rounds, "per_round": per_round, "batch": 1, "tokens": {}}
    for n in tokens:
        row = {}
        for key in sessions:
            s = latency_stats(times[key, n])
            row[key] = {"p10_ms": s.p10_s * 1e3, "p50_ms": s.median_s * 1e3, "p90_ms": s.p90_s * 1e3, "samples": s.n}
        row["speedup"] = row["float"]["p50_ms"] / row["quantized"]["p50_ms"]
        out["tokens"][str(n)] = row
    return out


def _prompts(planned: PlannedModel, n: int, length: int = 8) -> list[list[int]]:
    """`n` prompts of `length` tokens from the held-out batches (consecutive slices of their rows)."""
    stream = torch.cat([b.reshape(-1) for b in planned.evals]) if planned.evals else torch.arange(1, 1 + n * length)
    return [stream[i * length:(i + 1) * length].tolist() for i in range(n) if (i + 1) * length <= stream.numel()]


def _decoder_figures(planned: PlannedModel, fp32: Path, quant: Path, *, contexts: Sequence[int], rounds: int, prompts: int,
                     new_tokens: int) -> dict[str, Any]:
    """The cached graphs' own figures: greedy generation of the fp32 graph against transformers' (and how many
    leading tokens the quantized graph's greedy generation shares with it), per-token decode latency."""
    chosen = _prompts(planned, prompts)
    generation = generation_check(planned.float_model, ort_session(fp32), chosen, new_tokens)
    quant_session = ort_session(quant)
    shared, quantized = [], []
    for row in generation["rows"]:
        q = greedy_generate(quant_session, [row["prompt"]], new_tokens, generation["eos_token_id"],
                            generation["pad_token_id"])[0]
        quantized.append({"prompt": row["prompt"], "tokens": q})
        shared.append(next((i for i, (a, b) in enumerate(zip(q, row["onnx"])) if a != b), min(len(q), len(row["onnx"]))))
    generation["quantized_leading_tokens_equal"] = shared
    generation["quantized_rows"] = quantized  # ffnquant's loop on the quantized graph: what genai must reproduce
    limit = position_limit(planned.info.config) or 0
    kept = [c for c in contexts if not limit or c <= limit]
    latency = decode_latency(fp32, quant, kept, rounds=rounds) if kept else {"contexts": {}}
    latency["beyond_max_positions"] = [c for c in contexts if c not in kept]
    return {"generation": generation, "decode_latency": latency}


def _genai(planned: PlannedModel, folder: Path, quant: Path, generation: dict[str, Any], new_tokens: int) -> dict[str, Any]:
    """onnxruntime-genai's files for the quantized decoder (`deploy.genai`) and its greedy tokens against ffnquant's
    loop on the same graph and prompts (`genai_check`)."""
    from .genai import genai_check, genai_config, with_known_type, write_genai_files
    from .onnx_decoder import cache_layout

    model = planned.float_model
    config, type_note = with_known_type(genai_config(model.config, cache_layout(model), quant.name,
                                                     getattr(model, "generation_config", None)))
    files = write_genai_files(folder, planned.info.path, config)
    return {"files": files, "type": config["model"]["type"], **({"type_note": type_note} if type_note else {}),
            **genai_check(folder, generation["quantized_rows"], new_tokens)}


def write_model_graph(planned: PlannedModel, folder: str | os.PathLike, *, opset: int = DEFAULT_OPSET,
                      tokens: Sequence[int] = (1, 512), rounds: int = 5, contexts: Sequence[int] = (128, 1024),
                      prompts: int = 3, new_tokens: int = 16) -> dict[str, Any]:
    """The planned model as ONNX in `folder`: `model.fp32.onnx` (the float model, the latency baseline) and
    `model.onnx` (the quantized graph), scored and timed, with onnxruntime-genai's genai_config.json and the
    tokenizer files beside them (`deploy.genai`; `decoder.genai` holds genai's greedy tokens against ffnquant's
    loop on the quantized graph); JSON-able. Both are cached decoders
    (`deploy.onnx_decoder`: `decoder` holds greedy generation against transformers' on `prompts` held-out
    prompts x `new_tokens`, and decode latency at each context of `contexts` within the model's positions), or
    prefill graphs where the model does not export with a cache (`decoder` says why). Single files:
    `graph_refusal` refuses models whose graph would need external data. The caller stages `folder`."""
    import onnxruntime as ort

    why = graph_refusal(planned.info)
    if why is not None:
        raise FFNQuantError(why)
    for m in planned.modules:  # refuse before minutes of exporting
        if m.expert is None:
            module_kind(m)
    # routed experts: one MoE node per module in the float graph, QMoE in the planned one (`deploy.onnx_experts`);
    # entered here so that a module none can compute is refused before anything is exported
    float_experts = ExpertsInGraph(planned.float_model, planned.info)
    planned_experts = ExpertsInGraph(planned.model, planned.info, planned.modules, planned.weight_of,
                                     like=float_experts)  # the operators found once, on the float model
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    fp32, quant = folder / "model.fp32.onnx", folder / "model.onnx"
    ids = planned.evals[0][:1, :64] if planned.evals else None
    decoder: dict[str, Any] = {"status": "ok", "layout": "onnxruntime-genai: past_key_values.%d.key/value -> "
                                                          "present.%d.key/value"}
    with float_experts:
        try:
            parity = export_decoder(planned.float_model, planned.info, fp32, opset, ids)
            export = export_decoder
            decoder["attention"] = f"{parity['attention']}, opset {parity['opset']}"
        except FFNQuantError as exc:  # the prefill graph as before, with the reason
            decoder = {"status": "refused", "reason": str(exc)}
            parity, export = _export(planned.float_model, planned.info, fp32, opset, ids), _export
    with ScratchFolder("graph", dir=folder) as tmp:
        # the rewrite starts from the planned model's own export: its weights are the grids' values, its routed
        # experts QMoE nodes of the plan's codes
        planned_fp32 = Path(tmp) / "planned.fp32.onnx"
        with planned_experts as experts:
            planned_parity = export(planned.model, planned.info, planned_fp32, opset, ids)
        written = quantize_graph(planned_fp32, planned, quant)
        written["experts"] = experts
    score = score_graph(quant, planned)
    # no prompt longer than the model's positions (a tiny model's 128): its embedding has no row for more
    limit = position_limit(planned.info.config) or 0
    latency = graph_latency(fp32, quant, tokens=sorted({min(t, limit) if limit else t for t in tokens}), rounds=rounds)
    files = {fp32.name: fp32.stat().st_size, quant.name: quant.stat().st_size}
    if decoder["status"] == "ok":
        decoder.update(_decoder_figures(planned, fp32, quant, contexts=contexts, rounds=rounds, prompts=prompts,
                                        new_tokens=new_tokens))
        decoder["genai"] = _genai(planned, folder, quant, decoder["generation"], new_tokens)
        files.update({name: (folder / name).stat().st_size for name in decoder["genai"]["files"]})
    return {"files": files, "external_data": False,
            "opset": opset, "parity": {"float": parity, "planned": planned_parity}, "quantize": written,
            "score": score, "latency": latency, "decoder": decoder, "onnxruntime": ort.__version__,
            "providers": score["providers"]}
