"""`profile --model` and `quantize --model` for causal LMs, through the one engine (`hf.stream.SequentialModel`):
the model's own decoder layers run in turn over the texts' hidden states, whether the model is resident or read a
layer at a time (`hf.memory.plan_memory` chooses). `calibrate_layerwise` gives each selected layer's range tables
and token positions; `quantize_layerwise` quantizes each selected layer on its FFN inputs as the streams pass it
and measures end to end. Before a layer's FFNs are used, they are checked to reproduce the model's own modules
on that layer's inputs (`SequentialModel.check`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Sequence

import torch

from ..atlas import TOP_FRACTION, PositionTracker, split_sequences
from ..errors import FFNQuantError
from .arch import ModelKind
from .capture import load_tokenizer, model_text_batches, text_label
from .checkpoint import ModelInfo, iter_ffn_layers, parse_layers
from .inputs import (EvalSettings, LayerInputs, _fill_unrouted, capture_whole, domain_budgets, domain_spans,
                     eval_domain_batches, fit_settings, token_budget)
from .layers import calibrate_layers, end_to_end_figures, model_layers_report, quantized_layers
from .metrics import _NLL, Agreement, ErrorStats, reference_batch
from .spill import Store, spill_folder
from .stream import Progress, SequentialModel, token_batches_of

__all__ = ["calibrate_layerwise", "capture_layer_inputs", "capture_layerwise", "end_to_end_layerwise",
           "model_top_positions", "quantize_layerwise"]


def _layer_ffns(model: SequentialModel, ffns, j: int, wanted: Sequence[int]) -> list:
    """Layer `j`'s FFNs (`HFLayer`s, every expert of an MoE layer) from the iterator `ffns`, [] when not wanted."""
    return [next(ffns) for _ in model.groups[j]] if j in wanted else []


def _inputs(hf_layers: Sequence[Any], captured: dict[str, list[torch.Tensor]], what: str,
            borrowed: dict[str, str]) -> dict[str, torch.Tensor]:
    """Each FFN's captured rows in one tensor; an expert the router sent none gets its layer's other experts'."""
    out = {hf.label: torch.cat(captured[hf.label]) if captured.get(hf.label) else torch.zeros(0, 0) for hf in hf_layers}
    _fill_unrouted(hf_layers, out, what, borrowed)
    return out


def _last_calls(info: ModelInfo, wanted: Sequence[int]) -> dict[tuple, int]:
    """Each selected FFN's last call (`LayerInfo.root`): its own layer, or the last of the layers that call it
    again where its weights are shared."""
    out: dict[tuple, int] = {}
    for layer in info.layers:
        if layer.index in wanted:
            out[layer.root] = max(out.get(layer.root, -1), layer.index)
    return out


def _joined(a: LayerInputs, b: LayerInputs) -> LayerInputs:
    """Two layers' captured inputs as one (their FFNs' labels differ)."""
    return dataclasses.replace(a, calib={**a.calib, **b.calib}, eval={**a.eval, **b.eval},
                               borrowed={**a.borrowed, **b.borrowed}, calib_borrowed={**a.calib_borrowed,
                                                                                      **b.calib_borrowed})


def calibrate_layerwise(info: ModelInfo, layers: str | int | list[int] | None = "all", text=None,
                        settings: EvalSettings = EvalSettings(), positions: bool = True, resident: bool = False,
                        spill: bool = False, spill_dir: str | os.PathLike | None = None, allow_pickle: bool = False,
                        progress: Progress | None = None):
    """The selected layers' RangeTables and the token positions of their largest values, in one pass: (RangeTable
    per layer label, top positions per label ({} without `positions`), what the positions were measured on).
    Experts' positions are left out (the router's choice drops their tokens' places), and named."""
    settings = fit_settings(info, settings)
    ids = token_batches_of(info, text, "calibration", settings, settings.max_calib_tokens)
    label = text_label(text, "calibration")
    meta = {"source_label": f"text {label}",
            "calibration_text": token_budget("calibration", settings.max_calib_tokens, ids, label)}
    n_tokens = sum(int(b.numel()) for b in ids)
    measured = {"source": f"text {label}", "n_tokens": n_tokens, "n_sequences": sum(int(b.shape[0]) for b in ids),
                "seq_len": settings.seq_len, "skipped_experts": []}
    wanted = parse_layers(layers, info.n_layers)
    ffns = iter_ffn_layers(info, wanted, allow_pickle=allow_pickle)
    model = SequentialModel(info, resident=resident, allow_pickle=allow_pickle)
    tables, top = {}, {}
    with spill_folder(spill, spill_dir) as folder:
        store = Store(folder, "calibration")
        calls = model.embed(ids, store, progress)
        model.offload(model.embedding)
        for j in range(max(wanted) + 1):
            hfs = _layer_ffns(model, ffns, j, wanted)
            captured: dict[str, list[torch.Tensor]] | None = {} if hfs else None
            with model.layer(j):
                model.check(j, store, calls, hfs)
                model.run(j, store, calls, capture=captured)
            if hfs:  # the layer is offloaded first: its FFNs and the observers take its place
                batches = ({k: x} for k, xs in captured.items() for x in xs)
                got, _ = calibrate_layers(hfs, batches, settings.bins)
                for hf in hfs:
                    tables[hf.label] = got[hf.label]
                    tables[hf.label].meta = dict(tables[hf.label].meta, **meta)
                    if not positions:
                        continue
                    if hf.info.expert is not None:
                        measured["skipped_experts"].append(hf.label)
                        continue
                    tracker = PositionTracker(hf.ffn, n_tokens, k=5, top_fraction=TOP_FRACTION)
                    for batch_ids, x in zip(ids, captured[hf.label]):
                        tracker.update(split_sequences(x, int(batch_ids.shape[1])))
                    top[hf.label] = tracker.result()
                    del tracker  # it holds the FFN
                del hfs, captured
                model.release()
            if progress is not None:
                progress(f"layers: L{j}", j + 1, max(wanted) + 1)
    return tables, top, measured


def quantize_layerwise(info: ModelInfo, recipe: Any, layers: str | int | list[int] | None = "all", text=None,
                       eval_text=None, calib_tokens: int = 4096, eval_tokens: int = 2048,
                       settings: EvalSettings = EvalSettings(), *, smooth_sites: Sequence[str] | None = None,
                       out_artifacts: str | os.PathLike | None = None, onnx: bool = True, latency: bool = False,
                       sensitivity: bool = True, file_stem: str | None = None, resident: bool = False,
                       spill: bool = False, spill_dir: str | os.PathLike | None = None, allow_pickle: bool = False,
                       progress: Progress | None = None) -> dict[str, Any]:
    """Each selected layer quantized under `recipe` (or its own recipe of a `plan.Plan`) on its FFN inputs, and
    the model measured end to end: what `quantize --model` reports (`evaluate.model_layers_report`).

    Each selected layer is quantized (`quantized_layers`) on its FFNs' inputs as the float calibration and
    held-out streams pass it. The end-to-end figures keep a quantized stream of the held-out batches beside the
    float one (each quantized FFN in place as its layer passes) and, with `settings.ablation`, one stream per
    selected layer that leaves the float stream there with only that layer quantized. The final norm and LM head
    score every stream batch by batch."""
    settings = fit_settings(info, settings)
    calib_ids = token_batches_of(info, text, "calibration", settings, calib_tokens)
    eval_ids = token_batches_of(info, eval_text, "evaluation", settings, eval_tokens)
    cal_name, ev_name = text_label(text, "calibration"), text_label(eval_text, "evaluation")
    budgets = {"calibration": token_budget("calibration", calib_tokens, calib_ids, cal_name),
               "evaluation": token_budget("evaluation", eval_tokens, eval_ids, ev_name)}
    separation = "different texts: calibration inputs from " + cal_name + ", held-out inputs from " + ev_name
    wanted = parse_layers(layers, info.n_layers)
    ffns = iter_ffn_layers(info, wanted, allow_pickle=allow_pickle)
    ablate = settings.ablation and len(wanted) > 1
    model = SequentialModel(info, resident=resident, allow_pickle=allow_pickle)
    n_ffns = sum(len(model.groups[j]) for j in wanted)
    rows: list[dict[str, Any]] = []
    kw = dict(smooth_sites=smooth_sites, out_artifacts=out_artifacts, onnx=onnx, latency=latency,
              sensitivity=sensitivity, file_stem=file_stem)
    with spill_folder(spill, spill_dir) as folder:
        calib, float_eval = Store(folder, "calibration"), Store(folder, "evaluation")
        ccalls = model.embed(calib_ids, calib, progress, "embed calibration")
        ecalls = model.embed(eval_ids, float_eval, progress, "embed evaluation")
        model.offload(model.embedding)
        quant = float_eval.copy("quantized")
        ablation: dict[int, Store] = {}
        e2e_seconds = 0.0  # the quantized and ablation streams, then the head

        def downstream(j: int, qffns: dict[str, Any] | None) -> None:  # the quantized and ablation streams
            nonlocal e2e_seconds
            t0 = time.perf_counter()
            model.run(j, quant, ecalls, ffns=qffns)
            for i, store in ablation.items():
                if i <= j:  # an ablation stream starts at its layer (later ones exist while a shared FFN waits)
                    model.run(j, store, ecalls, ffns=qffns if i == j else None)
            e2e_seconds += time.perf_counter() - t0

        # an FFN called by several layers (its weights shared) is quantized at its last call, from every call's
        # inputs: the quantized streams wait before its first call until then (`pending`)
        last_call = _last_calls(info, wanted)
        held: dict[tuple, tuple[list, LayerInputs]] = {}  # a shared FFN's calls so far, with their inputs
        ready: dict[int, dict[str, Any]] = {}  # quantized FFNs by layer, for the quantized streams
        pending: list[int] = []  # layers the quantized streams have yet to pass, in order

        def flush(open_layer: int | None = None) -> None:
            while pending and (pending[0] in ready or not model.groups[pending[0]] or pending[0] not in wanted):
                k = pending.pop(0)
                qffns = ready.pop(k, None)
                if k == open_layer:
                    downstream(k, qffns)
                    continue
                # read again (from the page cache, usually) for the quantized streams; its float FFN only for the
                # ablation streams of the layers before, which pass it unquantized
                with model.layer(k, ffn=qffns is None or any(i < k for i in ablation)):
                    downstream(k, qffns)
                del qffns

        for j in range(info.n_layers):
            hfs = _layer_ffns(model, ffns, j, wanted)
            cal_x, ev_x = ({}, {}) if hfs else (None, None)
            pending.append(j)
            with model.layer(j):
                if j <= max(wanted):
                    model.check(j, calib, ccalls, hfs)
                    model.run(j, calib, ccalls, capture=cal_x)
                if ablate and hfs:
                    ablation[j] = float_eval.copy(f"ablation{j}")
                model.run(j, float_eval, ecalls, capture=ev_x)
                if not hfs:
                    flush(open_layer=j)
            if hfs:  # quantized with the layer offloaded: its FFNs and the quantization take its place
                calib_borrowed, borrowed = {}, {}
                inputs = LayerInputs(_inputs(hfs, cal_x, "calibration", calib_borrowed),
                                     _inputs(hfs, ev_x, "evaluation", borrowed), cal_name, ev_name, separation,
                                     {**calib_borrowed, **borrowed}, calib_borrowed=calib_borrowed, budgets=budgets)
                del cal_x, ev_x
                root = hfs[0].info.root
                if root in held:  # a shared FFN's earlier calls and their inputs join this one's
                    calls, before = held.pop(root)
                    hfs, inputs = calls + hfs, _joined(before, inputs)
                if last_call[root] != j:  # its later calls' inputs are still to come
                    held[root] = (hfs, inputs)
                else:
                    def report(message: str, done: int, total: int, k: int = len(rows)) -> None:
                        if progress is not None:
                            progress(message, k + done, n_ffns)

                    layer_rows, qffns = quantized_layers(info, hfs, inputs, recipe, progress=report, **kw)
                    rows += layer_rows
                    for hf in hfs:
                        ready.setdefault(hf.index, {})[hf.label] = qffns[hf.label]
                    del qffns
                del hfs, inputs
                model.release()
                flush()
            if j == max(wanted):
                del calib, ccalls  # the calibration stream has fed its last selected layer
            if progress is not None:
                progress(f"layers: L{j}", j + 1, info.n_layers)
        t_e2e = time.perf_counter() - e2e_seconds
        figures = _head_figures(model, eval_ids, float_eval, quant, ablation, progress=progress)
    e2e = {"status": "ok", "reason": None, "evaluation_text": ev_name, **figures,
           "seconds": time.perf_counter() - t_e2e}
    texts = LayerInputs({}, {}, cal_name, ev_name, separation, {}, budgets=budgets)
    return model_layers_report(info, recipe, rows, e2e, settings, texts)


def capture_layer_inputs(info: ModelInfo, layers: Sequence[Any], text=None, eval_text=None, captured=None,
                         calib_tokens: int = 4096, eval_tokens: int = 2048, settings: EvalSettings = EvalSettings(),
                         allow_pickle: bool = False, progress: Progress | None = None, by_domain: bool = False,
                         whole: bool = False, dtype: torch.dtype = torch.float32, references: bool = False) -> LayerInputs:
    """Calibration and held-out inputs of each FFN in `layers`, for quantizing them one by one (`LayerInputs`).

    A causal LM runs through the engine (`capture_layerwise`: the model resident; the inputs carry it as `engine`
    for the end-to-end figures). Encoders, FFN inputs from `captured` files, and `whole` take transformers' whole
    forward (`hf.inputs.capture_whole`): for a causal LM, the reference the engine is tested against. With
    `by_domain`, each evaluation text is a domain of its own (`eval_domains`), so that a plan can be held to its
    target on each. `progress(message, done, total)` after each stage; nothing prints here. `dtype`: what the
    causal LM computes in on the engine (the FFN inputs are float32 whatever it is); other paths are float32.
    `references` (the engine only): the held-out text, already through every layer, also through the final norm and
    head: the float model's figures on it (`LayerInputs.float_references`, `float_baseline`), so the end-to-end
    figures need not run the float model again."""
    if info.kind is ModelKind.CAUSAL_LM and captured is None and not whole:
        return capture_layerwise(info, layers, text=text, eval_text=eval_text, calib_tokens=calib_tokens,
                                 eval_tokens=eval_tokens, settings=settings, allow_pickle=allow_pickle,
                                 progress=progress, by_domain=by_domain, dtype=dtype, references=references)
    if dtype is not torch.float32:
        raise FFNQuantError(f"{info.path}: computing in {str(dtype).removeprefix('torch.')} runs a causal LM on the "
                            "engine; encoders and captured activations are float32")
    return capture_whole(info, layers, text=text, eval_text=eval_text, captured=captured, calib_tokens=calib_tokens,
                         eval_tokens=eval_tokens, settings=settings, allow_pickle=allow_pickle, progress=progress,
                         by_domain=by_domain)


def capture_layerwise(info: ModelInfo, layers: Sequence[Any], text=None, eval_text=None, calib_tokens: int = 4096,
                      eval_tokens: int = 2048, settings: EvalSettings = EvalSettings(), allow_pickle: bool = False,
                      progress: Progress | None = None, by_domain: bool = False,
                      dtype: torch.dtype = torch.float32, references: bool = False) -> LayerInputs:
    """`hf.inputs.capture_layer_inputs` for a causal LM, through the engine with the model resident: each FFN of
    `layers` checked against the model's module and its inputs captured as the calibration and held-out streams
    pass its decoder layer. The LayerInputs carry the engine (`engine`), for `end_to_end_layerwise`."""
    settings = fit_settings(info, settings)
    tokenizer = load_tokenizer(info.path)
    calib_ids = model_text_batches(info, tokenizer, text, "calibration", settings.seq_len, settings.batch_size,
                                   calib_tokens)
    domains = eval_domain_batches(info, tokenizer, eval_text, settings, eval_tokens, by_domain)
    eval_ids = [b for _, batches in domains for b in batches]
    engine = SequentialModel(info, resident=True, allow_pickle=allow_pickle, dtype=dtype)
    calib, evals = Store(None, "calibration"), Store(None, "evaluation")
    ccalls = engine.embed(calib_ids, calib, progress, "capture calibration inputs: embed")
    ecalls = engine.embed(eval_ids, evals, progress, "capture evaluation inputs: embed")
    # the reproduction check of a dense layer runs on the calibration text's first sequence alone (it compares
    # outputs to a relative bound, which one sequence shows as a batch does); routed experts on the first batch,
    # as one sequence reaches few of them
    checked = Store(None, "check")
    kcalls = engine.embed([calib_ids[0][:1]], checked)
    cal_x: dict[str, list[torch.Tensor]] = {}
    ev_x: dict[str, list[torch.Tensor]] = {}
    last = max(layer.index for layer in layers)
    for j in range(last + 1):
        hfs = [layer for layer in layers if layer.index == j]
        moe = any(g.expert is not None for g in engine.groups[j])
        engine.check(j, *((calib, ccalls) if moe else (checked, kcalls)), hfs)
        engine.run(j, checked, kcalls)
        engine.run(j, calib, ccalls, capture=cal_x if hfs else None)
        engine.run(j, evals, ecalls, capture=ev_x if hfs else None)
        if progress is not None:
            progress(f"capture inputs: L{j}", j + 1, last + 1)
    refs, baseline = None, None
    if references and last + 1 == len(engine.layers):  # the held-out text has passed every layer: the head's turn
        nll, refs = _NLL(), []
        for b, ids in enumerate(eval_ids):
            final, logits = engine.head_out(evals.get(b))
            refs.append(reference_batch(logits, ids, final))
            nll.add(refs[-1].nll)  # its NLLs, not computed again
            del logits
        baseline = {"perplexity": nll.perplexity, "n_tokens": sum(int(b.numel()) for b in eval_ids)}
    calib_borrowed, borrowed = {}, {}
    calib_in = _inputs(layers, cal_x, "calibration", calib_borrowed)
    eval_in = _inputs(layers, ev_x, "evaluation", borrowed)
    cal_name, ev_name = text_label(text, "calibration"), text_label(eval_text, "evaluation")
    if by_domain:
        ev_name = " + ".join(label for label, _ in domains)
    budgets = {"calibration": token_budget("calibration", calib_tokens, calib_ids, cal_name),
               **domain_budgets(domains, eval_tokens, by_domain, ev_name)}
    return LayerInputs(calib_in, eval_in, cal_name, ev_name,
                       "different texts: calibration inputs from " + cal_name + ", held-out inputs from " + ev_name,
                       {**calib_borrowed, **borrowed}, eval_ids, engine.model, calib_borrowed=calib_borrowed,
                       calib_batches=calib_ids, budgets=budgets, eval_domains=domain_spans(domains), engine=engine,
                       float_references=refs, float_baseline=baseline)


def end_to_end_layerwise(engine: SequentialModel, layers: Sequence[Any], qffns: dict[str, Any],
                         evals: Sequence[torch.Tensor], settings: EvalSettings = EvalSettings(),
                         baseline: dict[str, Any] | None = None, per_layer: dict[str, Any] | None = None,
                         progress: Progress | None = None, references: Sequence[Any] | None = None,
                         keep: list | None = None) -> dict[str, Any]:
    """`hf.evaluate.end_to_end` through the engine: the held-out batches streamed through the decoder layers float,
    with every FFN of `qffns` in place, and (`settings.ablation`) with each layer's alone; the same figures.
    `keep`: a list that gets the float model's `Reference` of each batch, as `hf.evaluate.float_reference` gives
    them (computed here when `references` is None), for a later scoring against the same float model."""
    by_label = {layer.label: layer for layer in layers}
    indices = sorted({by_label[k].index for k in qffns})
    ablate = settings.ablation and len(indices) > 1
    float_s = Store(None, "float")
    calls = engine.embed(evals, float_s)
    run_float = references is None or per_layer is not None or baseline is None or ablate
    quant = float_s.copy("quantized")
    ablation: dict[int, Store] = {}
    for j in range(len(engine.layers)):
        qj = {k: q for k, q in qffns.items() if by_label[k].index == j}
        if ablate and j in indices:
            ablation[j] = float_s.copy(f"ablation{j}")
        captured: dict[str, list[torch.Tensor]] | None = {} if per_layer is not None and qj else None
        with engine.layer(j):
            if run_float:
                engine.run(j, float_s, calls, capture=captured)
            engine.run(j, quant, calls, ffns=qj or None)
            for i, store in ablation.items():
                engine.run(j, store, calls, ffns=qj if i == j else None)
        with torch.no_grad():
            for label, xs in (captured or {}).items():
                for x in xs:
                    if label in qj:  # x is float32; a quantized FFN computes in the engine's dtype
                        per_layer[label].update(by_label[label].ffn(x), qj[label](x.to(engine.dtype)))
        if progress is not None:
            progress(f"end to end: L{j}", j + 1, len(engine.layers))
    return _head_figures(engine, evals, float_s, quant, ablation, baseline, references, keep=keep)


def _head_figures(engine: SequentialModel, evals: Sequence[torch.Tensor], float_s: Store, quant: Store,
                  ablation: dict[int, Store], baseline: dict[str, Any] | None = None,
                  references: Sequence[Any] | None = None, progress: Progress | None = None,
                  keep: list | None = None) -> dict[str, Any]:
    """The end-to-end figures (`end_to_end_figures`) of streams at the last layer's output, a batch at a time
    through the model's final norm and head: the quantized stream and each ablation stream against the float
    stream (or the kept `references`), the float perplexity the `baseline` unless given."""
    nll_base, nll_all, hidden_all, agreement = _NLL(), _NLL(), ErrorStats(), Agreement()
    abl_hidden = {i: ErrorStats() for i in ablation}
    abl_nll = {i: _NLL() for i in ablation}
    for b, ids in enumerate(evals):
        if references is not None:
            ref = references[b]
        else:
            ref_hidden, logits = engine.head_out(float_s.get(b))
            nll_base.update(logits, ids)
            ref = reference_batch(logits, ids, ref_hidden)
            del logits  # a batch's logits at a time: [tokens, vocabulary] each
        if keep is not None:
            keep.append(ref)
        hidden, logits = engine.head_out(quant.get(b))
        hidden_all.update(ref.hidden, hidden)
        agreement.update(ref, logits, ids, nll_into=nll_all)
        for i, store in ablation.items():
            hidden, logits = engine.head_out(store.get(b))
            abl_hidden[i].update(ref.hidden, hidden)
            abl_nll[i].update(logits, ids)
        if progress is not None:
            progress(f"end to end: batch {b + 1}/{len(evals)}", b + 1, len(evals))
    if baseline is None:
        baseline = {"perplexity": nll_base.perplexity, "n_tokens": sum(int(b.numel()) for b in evals)}
    return end_to_end_figures(dict(baseline), hidden_all, nll_all,
                              {i: (abl_hidden[i], abl_nll[i]) for i in ablation}, agreement)


def model_top_positions(info, layers, text=None, settings=None, allow_pickle: bool = False, k: int = 5,
                        top_fraction: float | None = None,
                        progress: Callable[[str, int, int], None] | None = None) -> tuple[dict[str, dict], dict]:
    """Top values with their positions for each dense FFN of a real model (`hf.HFLayer`s), from one more run of the
    model on the calibration windows `hf.calibrate_model` uses for the same `text` and `settings` (so the very same
    tokens). Returns ({layer label: {site: `PositionTracker.result`}}, what it was measured on). Experts are left
    out: the router's selection drops their tokens' positions. `progress(message, done, total)` after each batch."""
    from .capture import iter_captured, load_hf_model, load_tokenizer, model_text_batches, text_label

    top_fraction = TOP_FRACTION if top_fraction is None else top_fraction
    settings = fit_settings(info, settings if settings is not None else EvalSettings())
    dense = [layer for layer in layers if layer.expert is None]
    ids = model_text_batches(info, load_tokenizer(info.path), text, "calibration", settings.seq_len,
                             settings.batch_size, settings.max_calib_tokens)
    n_tokens = sum(int(b.numel()) for b in ids)
    measured = {"source": f"text {text_label(text, 'calibration')}", "n_tokens": n_tokens,
                "n_sequences": sum(int(b.shape[0]) for b in ids), "seq_len": settings.seq_len,
                "skipped_experts": [layer.label for layer in layers if layer.expert is not None]}
    if not dense:
        return {}, measured
    trackers = {layer.label: PositionTracker(layer.ffn, n_tokens, k=k, top_fraction=top_fraction) for layer in dense}
    model = load_hf_model(info, allow_pickle=allow_pickle)
    for i, (batch_ids, captured) in enumerate(zip(ids, iter_captured(model, info, [l.info for l in dense], ids))):
        for label, x in captured.items():
            # one window per row of the batch: [batch, seq_len] flattened row-major by the capture hooks
            trackers[label].update(split_sequences(x, int(batch_ids.shape[1])))
        if progress is not None:
            progress(f"positions: batch {i + 1}/{len(ids)}", i + 1, len(ids))
    return {label: t.result() for label, t in trackers.items()}, measured
