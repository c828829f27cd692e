"""Fold SmoothQuant/AWQ input scales into the norm before each FFN of a loaded transformers model, exactly.

`remedies.smooth` (and AWQ) leave a per-channel multiply x * c in an FFN's `input_transform` (a
`remedies.ChannelScale`) and put 1/c into the consuming weight columns. A deployed model has no such
multiply: it folds into the gain of the norm whose output is the FFN's input and nothing else's, found per layer
from the loaded model's graph (`hf.graph.fold_sites`; a hand-written `Arch.norm_pattern` must agree with it):
RMSNorm / LayerNorm y = n * g + b become n * (g c) + b c, Gemma's n * (1 + g) takes g <- (1 + g) c - 1 (the
form the graph's numeric check found). Where that norm's output also feeds something else (a parallel block's
attention, Mixtral's router, BERT's post-LN residual) the fold would change the model and is refused for that
layer with the reason. `fold_exactness` measures the fold end to end on a real model.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
from dataclasses import dataclass
from typing import Any, Iterator, Mapping, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from ..model import FFN
from ..numerics.observe import profile
from ..numerics.remedies import ChannelScale, smooth
from .arch import ModelKind, NormGain
from .capture import _module_for, iter_captured, shift_right
from .checkpoint import LayerInfo, ModelInfo, inspect_model, load_ffn_layers
from .graph import check_sites, fold_sites
from .inputs import EvalSettings, fit_settings

__all__ = ["FOLD_TOLERANCE", "fold_refusal", "norm_module", "fold_input_scales", "folded_input_scales",
           "fold_exactness"]

# An exact fold: folding changes fp32 logits by at most this, relative (max |a - b| / max |a|).
FOLD_TOLERANCE = 1e-5


def fold_refusal(info: ModelInfo) -> str | None:
    """Why input scales cannot fold exactly into this model's norms (one line, naming the architecture); None if they can."""
    why = info.arch.fold_refusal(info.config)
    return None if why is None else f"cannot fold FFN input scales into the norms of a {info.arch.name} model: {why}"


def _ffn_of(obj: Any, layer: LayerInfo) -> FFN:
    """The ffnquant FFN inside `obj` (an FFN, or a QuantizedFFN holding it in `.model`)."""
    if isinstance(obj, FFN):
        return obj
    inner = getattr(obj, "model", None)
    if isinstance(inner, FFN):
        return inner
    raise FFNQuantError(f"layer {layer.label}: cannot fold the input scale of a {type(obj).__name__}; "
                        "give an ffnquant FFN or QuantizedFFN")


def _input_scale(obj: Any, layer: LayerInfo) -> torch.Tensor | None:
    transform = _ffn_of(obj, layer).input_transform
    if isinstance(transform, nn.Identity):
        return None
    if not isinstance(transform, ChannelScale):
        raise FFNQuantError(f"layer {layer.label}: its input_transform is a {type(transform).__name__}, not a "
                            "per-channel scale; only a ChannelScale folds into a norm")
    scale = transform.scale.detach()
    if not bool(torch.isfinite(scale).all()):
        raise FFNQuantError(f"layer {layer.label}: its input scale has non-finite entries")
    return scale


def with_input_transform(obj: Any, layer: LayerInfo, transform: nn.Module) -> Any:
    """A copy of `obj` (an FFN or QuantizedFFN) whose FFN has `transform` as its input_transform. The weights
    (which a fold leaves unchanged), and a QuantizedFFN's recipe and prepared calibration, are shared with `obj`,
    not duplicated."""
    memo: dict[int, Any] = {id(t): t for t in list(obj.parameters()) + list(obj.buffers())}
    for name in ("recipe", "prepared"):
        value = getattr(obj, name, None)
        if value is not None:
            memo[id(value)] = value
    # deepcopy maps each hook dict and the handles pointing at it together: a QuantizedFFN copy's activation
    # fake-quantizers sit on the copy's taps, and its remove_hooks removes those
    new = copy.deepcopy(obj, memo)
    _ffn_of(new, layer).input_transform = transform
    return new


def _without_input_scale(obj: Any, layer: LayerInfo) -> Any:
    return with_input_transform(obj, layer, nn.Identity())


def _module_name(model: nn.Module, info: ModelInfo, layer: LayerInfo, names: Sequence[str]) -> str:
    return _module_for(model, info, layer, names)[0]


def norm_module(model: nn.Module, info: ModelInfo, layer: LayerInfo,
                names: Sequence[str] | None = None) -> tuple[str, nn.Module]:
    """(name, module) of the norm whose output is `layer`'s FFN input (`Arch.norm_pattern`) in the loaded model."""
    names = [n for n, _ in model.named_modules()] if names is None else names
    if not info.arch.norm_pattern and info.arch.norm_from_graph:
        from .graph import fold_sites

        site = fold_sites(model, info, [layer])[layer]
        if site.norm is None or site.gain is None:
            raise FFNQuantError(f"layer {layer.label}: {site.refusal}")
        return site.norm, model.get_submodule(site.norm)
    if not info.arch.norm_pattern:
        raise FFNQuantError(f"{info.arch.name}: no norm before the FFN is known")
    ffn = _module_name(model, info, layer, names)
    pattern = re.compile(info.arch.norm_pattern.format(
        layer=layer.block, stack=re.escape(layer.stack), ffn=re.escape(ffn),
        ffn_parent=re.escape(ffn.rpartition(".")[0])))
    hits = [n for n in names if pattern.fullmatch(n)]
    if len(hits) != 1:
        raise FFNQuantError(f"cannot find the norm before the FFN of {info.arch.name} layer {layer.label} "
                            f"({ffn}) in the loaded transformers model: {len(hits)} modules match {pattern.pattern!r}")
    return hits[0], model.get_submodule(hits[0])


@dataclass(frozen=True)
class _Fold:
    layer: LayerInfo
    norm_name: str
    norm: nn.Module
    scale: torch.Tensor  # [d_model], the FFN's input multiply x * scale
    gain: NormGain


def _plan(model: nn.Module, info: ModelInfo, ffns: Mapping[LayerInfo, Any]) -> tuple[list[_Fold], dict[LayerInfo, Any]]:
    """Every check before any weight changes: which norm takes which scale (found from the model's graph,
    `hf.graph.fold_sites`), and the FFNs without their scale."""
    scales = {layer: _input_scale(obj, layer) for layer, obj in ffns.items()}
    todo = [layer for layer, s in scales.items() if s is not None]
    out = {layer: (obj if scales[layer] is None else None) for layer, obj in ffns.items()}
    if not todo:
        return [], out
    why = fold_refusal(info)
    if why is not None:
        raise FFNQuantError(why)
    sites = fold_sites(model, info, todo)
    check_sites(sites, todo)
    names = [n for n, _ in model.named_modules()]
    plan: list[_Fold] = []
    seen: dict[int, _Fold] = {}  # by the gain Parameter's identity
    for layer in todo:
        site = sites[layer]
        name, norm = site.norm, model.get_submodule(site.norm)
        if info.arch.norm_pattern:  # a hand-written entry names the norm too: it must be the graph's
            named, _ = norm_module(model, info, layer, names)
            if named != name:
                raise FFNQuantError(f"layer {layer.label}: the {info.arch.name} entry folds into {named}, but the FFN's "
                                    f"input comes from {name} in the loaded model; refusing a fold the graph contradicts")
        weight = getattr(norm, "weight", None)
        scale = scales[layer]
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != tuple(scale.shape):
            shape = None if not isinstance(weight, torch.Tensor) else tuple(weight.shape)
            raise FFNQuantError(f"layer {layer.label}: the norm {name} has gain shape {shape}, the input scale "
                                f"{tuple(scale.shape)}: nothing to fold it into")
        out[layer] = _without_input_scale(ffns[layer], layer)
        # one gain read by several layers (one norm, or one Parameter under several names: a shared block's called
        # by several layers) takes one scale, folded once
        twin = seen.get(id(weight))
        if twin is not None:
            if not torch.equal(twin.scale, scale) or twin.gain is not site.gain:
                raise FFNQuantError(f"layers {twin.layer.label} and {layer.label} both read the norm gain of "
                                    f"{twin.norm_name}{'' if twin.norm_name == name else ' (' + name + ')'} with "
                                    "different input scales: one gain cannot carry two input scales")
            continue
        seen[id(weight)] = _Fold(layer, name, norm, scale, site.gain)
        plan.append(seen[id(weight)])
    return plan, out


def _apply(plan: Sequence[_Fold]) -> None:
    # In float64, rounded once to the norm's dtype: the stored gain is the correctly rounded product.
    with torch.no_grad():
        for f in plan:
            c = f.scale.to(device=f.norm.weight.device, dtype=torch.float64)
            w = f.norm.weight
            g = w.double()
            new = (1.0 + g) * c - 1.0 if f.gain is NormGain.ONE_PLUS_GAIN else g * c
            w.copy_(new.to(w.dtype))
            bias = getattr(f.norm, "bias", None)
            if isinstance(bias, torch.Tensor):  # LayerNorm: (n g + b) c = n (g c) + b c
                bias.copy_((bias.double() * c).to(bias.dtype))


def fold_input_scales(model: nn.Module, info: ModelInfo, ffns: Mapping[LayerInfo, Any]) -> dict[LayerInfo, Any]:
    """Fold each FFN's input scale (a `ChannelScale` input_transform) into the norm before it, in place in
    `model`; returns the FFNs (or QuantizedFFNs) to install, copies with an identity input_transform (FFNs
    without a scale as given). Installed (`install_ffns`) into the folded model they compute what the
    smoothed FFNs computed in the unfolded one, to float32 rounding. Checked before any weight changes; an
    architecture whose norm cannot take the scale exactly raises an FFNQuantError saying why."""
    plan, out = _plan(model, info, ffns)
    _apply(plan)
    return out


@contextlib.contextmanager
def folded_input_scales(model: nn.Module, info: ModelInfo, ffns: Mapping[LayerInfo, Any]) -> Iterator[dict[LayerInfo, Any]]:
    """`fold_input_scales` while active (yields the FFNs to install); the norms' weights and biases are put
    back bit for bit afterwards, also on error."""
    plan, out = _plan(model, info, ffns)
    saved = [(t, t.detach().clone()) for f in plan for t in (f.norm.weight, getattr(f.norm, "bias", None))
             if isinstance(t, torch.Tensor)]
    try:
        _apply(plan)
        yield out
    finally:
        with torch.no_grad():
            for t, old in saved:
                t.copy_(old)


# --- measured on a real model -------------------------------------------------------------


class _Diff:
    """max |a - b| / max |a| and mean |a - b| / mean |a| over everything compared, streamed."""

    def __init__(self) -> None:
        self.max_diff = self.max_ref = self.sum_diff = self.sum_ref = 0.0

    # float64 copies of this many values at a time: a batch of a 262k-vocabulary model's logits is gigabytes, and
    # four float64 copies of it at once ran a 24 GB machine out of memory in Gemma 3's export
    CHUNK = 1 << 24

    def update(self, ref: torch.Tensor, got: torch.Tensor) -> None:
        ref, got = ref.reshape(-1), got.reshape(-1)
        for i in range(0, ref.numel(), self.CHUNK):
            r = ref[i : i + self.CHUNK].double()
            d = got[i : i + self.CHUNK].double().sub_(r).abs_()
            r.abs_()
            self.max_diff = max(self.max_diff, float(d.max()))
            self.max_ref = max(self.max_ref, float(r.max()))
            self.sum_diff += float(d.sum())
            self.sum_ref += float(r.sum())

    def to_dict(self) -> dict[str, float]:
        return {"max_rel_diff": self.max_diff / self.max_ref if self.max_ref else self.max_diff,
                "mean_rel_diff": self.sum_diff / self.sum_ref if self.sum_ref else self.sum_diff,
                "max_abs_diff": self.max_diff, "max_abs_reference": self.max_ref}


def _compared(model: nn.Module, info: ModelInfo, ids: torch.Tensor) -> torch.Tensor:
    """What the model's user gets: the logits (the final hidden states of an encoder)."""
    inputs = {"input_ids": ids}
    if info.kind is ModelKind.SEQ2SEQ:
        inputs["decoder_input_ids"] = shift_right(model, ids)
    with torch.no_grad():
        out = model(**inputs)
    return out.last_hidden_state if info.kind is ModelKind.ENCODER else out.logits


def _input_ranges(model: nn.Module, info: ModelInfo, layers: Sequence[Any], batches: Sequence[torch.Tensor],
                  bins: int) -> dict[str, Any]:
    """Each layer's RangeTable of its input site, from the model run on `batches` (the capture path)."""
    by_label = {layer.label: layer for layer in layers}
    tables: dict[str, Any] = {}
    for batch in iter_captured(model, info, [layer.info for layer in layers], batches):
        for label, x in batch.items():
            table = profile(by_label[label].ffn, [x], sites=("input",), bins=bins, weights=False)
            tables[label] = tables[label].merge(table) if label in tables else table
    missing = [label for label in by_label if label not in tables]
    if missing:
        raise FFNQuantError(f"layers {', '.join(missing)} received no calibration tokens")
    return tables


def fold_exactness(
    source: str | os.PathLike | ModelInfo | tuple[nn.Module, ModelInfo],
    alpha: float = 0.5,
    layers: str | int | list[int] | None = "all",
    text: str | os.PathLike | None = None,
    calib_text: str | os.PathLike | None = None,
    tokens: int = 512,
    seq_len: int = 128,
    batch_size: int = 4,
    bins: int = 256,
    allow_pickle: bool = False,
) -> dict[str, Any]:
    """Smooth each selected FFN's input (SmoothQuant scales with `alpha`, calibrated on `calib_text`, default
    the shipped calibration sample, `tokens` tokens), fold the scales into the norms, install the FFNs and
    compare the fp32 logits (final hidden states for encoders) with the untouched model's on `text` (default
    the shipped evaluation sample, `tokens` tokens).

    `source`: a model folder, its ModelInfo, or (loaded model, ModelInfo); a given model is left as it was.
    Relative differences: max |a - b| / max |a| over every logit of every token (`max_rel_diff`, what
    `FOLD_TOLERANCE` bounds), and mean |a - b| / mean |a|. The top-level figures are the folded model against
    the untouched one; `unfolded`: the smoothed FFNs doing their own multiply against the untouched model;
    `folded_vs_unfolded`: what the fold alone changes; `float_ffns`: ffnquant's unsmoothed float FFNs installed,
    the float32 rounding floor of replacing the model's own MLPs at all.
    """
    from .capture import install_ffns, load_hf_model, load_tokenizer, model_text_batches, text_label

    if isinstance(source, tuple):
        model, info = source
    else:
        info = source if isinstance(source, ModelInfo) else inspect_model(source, allow_pickle=allow_pickle)
        model = None
    why = fold_refusal(info)
    if why is not None:
        raise FFNQuantError(why)
    hf_layers = load_ffn_layers(info, layers, allow_pickle=allow_pickle)
    settings = fit_settings(info, EvalSettings(seq_len=seq_len, batch_size=batch_size, max_calib_tokens=tokens,
                                               max_eval_tokens=tokens, bins=bins))
    tokenizer = load_tokenizer(info.path)
    calib = model_text_batches(info, tokenizer, calib_text, "calibration", settings.seq_len, settings.batch_size,
                               settings.max_calib_tokens)
    evals = model_text_batches(info, tokenizer, text, "evaluation", settings.seq_len, settings.batch_size,
                               settings.max_eval_tokens)
    if model is None:
        model = load_hf_model(info, allow_pickle=allow_pickle)
    tables = _input_ranges(model, info, hf_layers, calib, settings.bins)
    smoothed = {layer.info: smooth(layer.ffn, tables[layer.label], alpha, sites=("input",))[0] for layer in hf_layers}
    factors = torch.cat([f.input_transform.scale for f in smoothed.values()])
    folded, unfolded, fold_only, float_ffns = _Diff(), _Diff(), _Diff(), _Diff()
    for ids in evals:
        ref = _compared(model, info, ids)
        with install_ffns(model, info, {layer.info: layer.ffn for layer in hf_layers}):
            float_ffns.update(ref, _compared(model, info, ids))
        with install_ffns(model, info, smoothed):
            smooth_out = _compared(model, info, ids)
        with folded_input_scales(model, info, smoothed) as plain, install_ffns(model, info, plain):
            fold_out = _compared(model, info, ids)
        folded.update(ref, fold_out)
        unfolded.update(ref, smooth_out)
        fold_only.update(smooth_out, fold_out)
    result = folded.to_dict()

    gains = sorted({str(site.gain) for site in fold_sites(model, info, list(smoothed)).values() if site.gain is not None})
    return {
        "model": str(info.path),
        "architecture": info.arch.name,
        "norm_gain": ", ".join(gains) or str(info.arch.norm_gain),
        "compared": "last_hidden_state" if info.kind is ModelKind.ENCODER else "logits",
        "alpha": float(alpha),
        "layers": [layer.label for layer in hf_layers],
        "n_layers": len(hf_layers),
        "tokens": sum(int(b.numel()) for b in evals),
        "calibration_tokens": sum(int(b.numel()) for b in calib),
        "calibration_text": text_label(calib_text, "calibration"),
        "evaluation_text": text_label(text, "evaluation"),
        "norm_factor_min": float(factors.min()),
        "norm_factor_max": float(factors.max()),
        **result,
        "tolerance": FOLD_TOLERANCE,
        "within_tolerance": result["max_rel_diff"] <= FOLD_TOLERANCE,
        "relative": "max |a - b| / max |a| over every compared value (mean_rel_diff: mean |a - b| / mean |a|)",
        "unfolded": unfolded.to_dict(),
        "folded_vs_unfolded": fold_only.to_dict(),
        "float_ffns": float_ffns.to_dict(),
    }
