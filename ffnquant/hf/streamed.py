"""What the commands stream through `hf.stream.SequentialModel`: `profile --model`'s range tables and token
positions (`stream_calibrate`) and `quantize --model`'s layers and end-to-end figures (`stream_quantize`), a
decoder layer at a time, with the same data as the in-memory path (tests/test_hf_stream.py).
"""

from __future__ import annotations

import os
import time
from typing import Any, Sequence

import torch

from .capture import text_label
from .checkpoint import ModelInfo, iter_ffn_layers, parse_layers
from .inputs import EvalSettings, LayerInputs, fit_settings, token_budget
from .stream import Progress, SequentialModel, _spill_folder, _Store, _trim, token_batches_of

__all__ = ["stream_calibrate", "stream_quantize"]


def stream_calibrate(info: ModelInfo, layers: str | int | list[int] | None = "all", text=None,
                     settings: EvalSettings = EvalSettings(), positions: bool = True, spill: bool = False,
                     spill_dir: str | os.PathLike | None = None, progress: Progress | None = None):
    """`calibrate_model` and `atlas.model_top_positions` in one pass, layer by layer: (RangeTable per layer label,
    top positions per label ({} without `positions`), what the positions were measured on)."""
    from ..atlas import TOP_FRACTION, PositionTracker, split_sequences
    from .evaluate import calibrate_layers

    settings = fit_settings(info, settings)
    ids = token_batches_of(info, text, "calibration", settings, settings.max_calib_tokens)
    label = text_label(text, "calibration")
    meta = {"source_label": f"text {label}",
            "calibration_text": token_budget("calibration", settings.max_calib_tokens, ids, label)}
    n_tokens = sum(int(b.numel()) for b in ids)
    measured = {"source": f"text {label}", "n_tokens": n_tokens, "n_sequences": sum(int(b.shape[0]) for b in ids),
                "seq_len": settings.seq_len, "skipped_experts": []}
    wanted = parse_layers(layers, info.n_layers)
    ffns = iter_ffn_layers(info, wanted)
    model = SequentialModel(info)
    tables, top = {}, {}
    with _spill_folder(spill, spill_dir) as folder:
        store = _Store(folder, "calibration")
        calls = model.embed(ids, store, progress)
        model.offload(model.embedding)
        for j in range(max(wanted) + 1):
            captured: list | None = [] if j in wanted else None
            with model.layer(j):
                model.run(j, store, calls, capture=captured)
            if captured is not None:  # the layer is offloaded first: its FFN and the observers take its place
                hf = next(ffns)
                tables.update(calibrate_layers([hf], ({hf.label: x} for x in captured), settings.bins)[0])
                tables[hf.label].meta = dict(tables[hf.label].meta, **meta)
                if positions:
                    tracker = PositionTracker(hf.ffn, n_tokens, k=5, top_fraction=TOP_FRACTION)
                    for batch_ids, x in zip(ids, captured):
                        tracker.update(split_sequences(x, int(batch_ids.shape[1])))
                    top[hf.label] = tracker.result()
                    del tracker  # it holds the FFN
                del hf, captured
                _trim()
            if progress is not None:
                progress(f"layers: L{j}", j + 1, max(wanted) + 1)
    return tables, top, measured


def stream_quantize(info: ModelInfo, recipe: Any, layers: str | int | list[int] | None = "all", text=None,
                    eval_text=None, calib_tokens: int = 4096, eval_tokens: int = 2048,
                    settings: EvalSettings = EvalSettings(), *, smooth_sites: Sequence[str] | None = None,
                    out_artifacts: str | os.PathLike | None = None, onnx: bool = True, latency: bool = False,
                    sensitivity: bool = True, file_stem: str | None = None, spill: bool = False,
                    spill_dir: str | os.PathLike | None = None, progress: Progress | None = None) -> dict[str, Any]:
    """`capture_layer_inputs` + `quantize_model_layers` layer by layer, the same data.

    Each selected layer is quantized (`quantized_layers`) on its FFN's inputs as the float calibration and
    held-out streams pass it. The end-to-end figures keep a quantized stream of the held-out batches beside the
    float one (each quantized FFN in place as its layer passes) and, with `settings.ablation`, one stream per
    selected layer that leaves the float stream there with only that layer quantized: the runs `end_to_end`
    makes, a layer at a time. The final norm and LM head score every stream batch by batch."""
    from ..plan.planfile import Plan
    from .evaluate import end_to_end_figures, model_layers_report, quantized_layers
    from .metrics import _NLL, Agreement, ErrorStats, reference_batch

    settings = fit_settings(info, settings)
    calib_ids = token_batches_of(info, text, "calibration", settings, calib_tokens)
    eval_ids = token_batches_of(info, eval_text, "evaluation", settings, eval_tokens)
    cal_name, ev_name = text_label(text, "calibration"), text_label(eval_text, "evaluation")
    budgets = {"calibration": token_budget("calibration", calib_tokens, calib_ids, cal_name),
               "evaluation": token_budget("evaluation", eval_tokens, eval_ids, ev_name)}
    separation = "different texts: calibration inputs from " + cal_name + ", held-out inputs from " + ev_name
    wanted = parse_layers(layers, info.n_layers)
    ffns = iter_ffn_layers(info, wanted)
    ablate = settings.ablation and len(wanted) > 1
    model = SequentialModel(info)
    rows: list[dict[str, Any]] = []
    kw = dict(smooth_sites=smooth_sites, out_artifacts=out_artifacts, onnx=onnx, latency=latency,
              sensitivity=sensitivity, file_stem=file_stem)
    with _spill_folder(spill, spill_dir) as folder:
        calib, float_eval = _Store(folder, "calibration"), _Store(folder, "evaluation")
        ccalls = model.embed(calib_ids, calib, progress, "embed calibration")
        ecalls = model.embed(eval_ids, float_eval, progress, "embed evaluation")
        model.offload(model.embedding)
        quant = float_eval.copy("quantized")
        ablation: dict[int, _Store] = {}
        e2e_seconds = 0.0  # the runs `end_to_end` makes: the quantized and ablation streams, then the head

        def downstream(j: int, qffn: Any) -> None:  # the quantized and ablation streams through layer j (onloaded)
            nonlocal e2e_seconds
            t0 = time.perf_counter()
            model.run(j, quant, ecalls, ffn=qffn)
            for i, store in ablation.items():
                model.run(j, store, ecalls, ffn=qffn if i == j else None)
            e2e_seconds += time.perf_counter() - t0

        for j in range(info.n_layers):
            cal_x, ev_x = ([], []) if j in wanted else (None, None)
            with model.layer(j):
                if j <= max(wanted):
                    model.run(j, calib, ccalls, capture=cal_x)
                if ablate and j in wanted:
                    ablation[j] = float_eval.copy(f"ablation{j}")
                model.run(j, float_eval, ecalls, capture=ev_x)
                if j not in wanted:
                    downstream(j, None)
            if j in wanted:  # quantized with the layer offloaded: its FFN and the quantization take its place
                hf = next(ffns)
                inputs = LayerInputs({hf.label: torch.cat(cal_x)}, {hf.label: torch.cat(ev_x)}, cal_name, ev_name,
                                     separation, {}, budgets=budgets)
                del cal_x, ev_x

                def report(message: str, done: int, total: int, k: int = len(rows)) -> None:
                    if progress is not None:
                        progress(message, k + done, len(wanted))

                recipe_j = recipe.recipe_for(j) if isinstance(recipe, Plan) else recipe
                layer_rows, qffns = quantized_layers(info, [hf], inputs, recipe_j, progress=report, **kw)
                rows += layer_rows
                del hf, inputs
                _trim()
                # read again (from the page cache, usually) for the quantized streams; its float FFN only for the
                # ablation streams of the layers before, which pass it unquantized
                with model.layer(j, ffn=any(i != j for i in ablation)):
                    downstream(j, qffns.pop(layer_rows[0]["label"]))
            if j == max(wanted):
                del calib, ccalls  # the calibration stream has fed its last selected layer
            if progress is not None:
                progress(f"layers: L{j}", j + 1, info.n_layers)
        t_e2e = time.perf_counter() - e2e_seconds
        nll_base, nll_all, hidden_all, agreement = _NLL(), _NLL(), ErrorStats(), Agreement()
        abl_hidden = {i: ErrorStats() for i in ablation}
        abl_nll = {i: _NLL() for i in ablation}
        for b, ids in enumerate(eval_ids):
            ref_hidden, logits = model.head_out(float_eval.get(b))
            nll_base.update(logits, ids)
            ref = reference_batch(logits, ids)
            del logits  # a batch's logits at a time: [tokens, vocabulary] each
            hidden, logits = model.head_out(quant.get(b))
            hidden_all.update(ref_hidden, hidden)
            nll_all.update(logits, ids)
            agreement.update(ref, logits, ids)
            for i, store in ablation.items():
                hidden, logits = model.head_out(store.get(b))
                abl_hidden[i].update(ref_hidden, hidden)
                abl_nll[i].update(logits, ids)
            if progress is not None:
                progress(f"end to end: batch {b + 1}/{len(eval_ids)}", b + 1, len(eval_ids))
    # the figures and the layout `end_to_end` and `quantize_model_layers` give, from the same accumulators
    baseline = {"perplexity": nll_base.perplexity, "n_tokens": sum(int(b.numel()) for b in eval_ids)}
    e2e = {"status": "ok", "reason": None, "evaluation_text": ev_name,
           **end_to_end_figures(baseline, hidden_all, nll_all, {i: (abl_hidden[i], abl_nll[i]) for i in ablation},
                                 agreement),
           "seconds": time.perf_counter() - t_e2e}
    texts = LayerInputs({}, {}, cal_name, ev_name, separation, {}, budgets=budgets)
    return model_layers_report(info, recipe, rows, e2e, settings, texts)
