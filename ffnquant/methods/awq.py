"""AWQ (Lin et al. 2023): activation-aware per-channel weight scales, searched on calibration data, folded exactly.

A weight's input channel j is multiplied by s_j before round-to-nearest and the activation by 1/s_j,
so the float function is unchanged while the channels that carry large activations get finer steps:
the matmul computes x diag(1/s) Q(W diag(s))^T. AWQ takes s = stat^alpha from a per-channel
activation statistic and picks alpha on a grid by the output error of the quantized weights.

Here the statistic and the error both come from GPTQ's input Hessian H = sum X^T X
(`fakequant.input_hessians`): the statistic is each channel's RMS, sqrt(diag(H) / n), and the error of
a weight is ||X dW^T||^2 = tr(dW H dW^T) with dW = W - Q(W diag(s)) diag(1/s), exact over every
calibration token. Where the scales go (`awq_fold`):

- `input` (read by w_gate and w_up): one s shared by both weights (they read the same x, and the 1/s
  lives in one place, `model.input_transform`, i.e. the preceding norm's gain in a full model); the
  search minimises the sum of both weights' errors.
- `hidden` (read by w_down): 1/s folded into w_up's output rows and bias, exact where
  `remedies.smooth_exact_for` says so (gated variants: hidden = act(gate) * up is linear in up; ReLU is
  positively homogeneous). Otherwise, or when the hidden is rotated (the rotation mixes channels), the
  hidden keeps s = 1 and the record says why.

Quantization itself stays round-to-nearest on the scheme's int4 group grid (`primitives.int4_group_rtn`),
on the scaled weights, after AutoAWQ's clipping search (`clip_search`): each group's weights are clamped to
+-r max|w| with the ratio r in 1, 0.95, ..., 0.55 that minimises that group's output error (the group's
diagonal block of the scaled H, where AutoAWQ uses 512 sampled tokens), and a row keeps its clipping only
where it lowers the row's whole output error (cross-group terms included), so the final error is never
above the unclipped one. The fold (`awq_fold`) is exact; the clipping (`clip_weights`) changes only the
weights about to be rounded. This module holds the searches, the fold and the clip;
`fakequant.quantize_model` runs them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import torch
from torch import nn

from ..numerics import primitives as P
from ..errors import FFNQuantError
from ..model import FFN
from ..numerics.remedies import ChannelScale, RemedyRecord, smooth_exact_for
from ..schemes import Granularity, Method, Scheme

__all__ = [
    "ALPHA_GRID",
    "MAX_SCALE_SPREAD",
    "channel_rms",
    "awq_scales",
    "rtn",
    "output_error",
    "scaled_error",
    "SiteSearch",
    "search_site",
    "CLIP_RATIOS",
    "clip_search",
    "clip_groups",
    "AWQRecord",
    "apply_scales",
    "awq_fold",
    "refold",
    "clip_weights",
]

# AutoAWQ's grid: alpha = i / 20, i = 0..19. alpha = 0 gives s = 1, plain RTN, so the search never does worse
# than RTN on the calibration objective.
ALPHA_GRID: tuple[float, ...] = tuple(i / 20 for i in range(20))
# s_max / s_min is at most this: a channel with (almost) no calibration energy gets the smallest s allowed rather
# than s -> 0 (AutoAWQ clamps stat^alpha at 1e-4 in activation units; a ratio does not depend on the units).
MAX_SCALE_SPREAD = 1e4
# AutoAWQ's clipping grid: max_val = (1 - i / 20) * max|w| of the group, i = 0..9 (max_shrink 0.5); 1 = no clipping.
CLIP_RATIOS: tuple[float, ...] = tuple(1 - i / 20 for i in range(10))
_READS = {"w_up": "input", "w_gate": "input", "w_down": "hidden"}  # the site each weight reads (fakequant's map)


def channel_rms(hessian: torch.Tensor, n_tokens: int | None = None) -> torch.Tensor:
    """Each input channel's RMS over the calibration tokens, sqrt(diag(H) / n), float64 [in].

    AutoAWQ uses the mean |x| per channel; the second moment is used here because it comes for free from
    the X^T X that GPTQ accumulates, and the search's loss is computed exactly from the same H. Without
    `n_tokens` the result is sqrt(diag(H)): proportional to the RMS, which is all `awq_scales` needs (its
    normalisation cancels any common factor).
    """
    d = torch.diagonal(hessian.detach().double()).clamp_min(0.0)
    if n_tokens is not None:
        if n_tokens < 1:
            raise FFNQuantError(f"channel_rms needs a positive token count, got {n_tokens!r}")
        d = d / n_tokens
    return d.sqrt()


def awq_scales(stat: torch.Tensor, alpha: float) -> torch.Tensor:
    """AWQ's per-channel s = stat^alpha, normalised as AutoAWQ does (s / sqrt(max(s) min(s))), float32.

    Channels below max(s) / MAX_SCALE_SPREAD are raised to it; alpha = 0 (or no calibration energy) gives s = 1.
    """
    if not 0.0 <= alpha <= 1.0:
        raise FFNQuantError(f"awq alpha must be in [0, 1], got {alpha!r}")
    stat = stat.detach().double()
    top = float(stat.max()) if stat.numel() else 0.0
    if alpha == 0.0 or not top > 0.0:
        return torch.ones(stat.shape, dtype=torch.float32, device=stat.device)
    s = stat.pow(alpha)
    s = s.clamp_min(float(s.max()) / MAX_SCALE_SPREAD)
    s = s / torch.sqrt(s.max() * s.min())
    return s.float()


def rtn(w: torch.Tensor, group_size: int, symmetric: bool) -> torch.Tensor:
    """The int4 group round-to-nearest image of a [out, in] weight (`primitives.int4_group_rtn`, cropped), float32."""
    return P.int4_group_dequantize(*P.int4_group_rtn(w, group_size, symmetric), w.shape[1])


def output_error(dw: torch.Tensor, hessian: torch.Tensor) -> float:
    """||X dW^T||^2 summed over the calibration tokens, from H = X^T X: tr(dW H dW^T).

    The product runs in float32 (the search evaluates it 20 times per weight; float32 rounding, ~1e-6
    relative, is far below the differences between grid points); the per-row sums add up in float64.
    """
    dw = dw.detach().float()
    return float(((dw @ hessian.float()) * dw).sum(dim=1).double().sum())


def scaled_error(weights: Sequence[torch.Tensor], hessian: torch.Tensor, s: torch.Tensor, group_size: int,
                 symmetric: bool) -> float:
    """The summed output error of `weights` (all reading the input of `hessian`) quantized with input scales `s`:
    sum tr(dW H dW^T), dW = W - Q(W diag(s)) diag(1/s)."""
    total = 0.0
    for w in weights:
        w = w.detach().float()
        dw = w - rtn(w * s[None, :], group_size, symmetric) / s[None, :]
        total += output_error(dw, hessian)
    return total


def _row_errors(dw: torch.Tensor, hessian: torch.Tensor) -> torch.Tensor:
    """Each row's output error dw_r H dw_r^T, float64 [out] (float32 products, as `output_error`)."""
    return ((dw @ hessian) * dw).sum(dim=1).double()


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[out, in] -> [out, ceil(in/g), g], zero-padded along `in` as the int4 grids pad it (zeros stay 0 under a clamp
    and quantize to exactly 0, so padding adds no error)."""
    pad = P.padded_width(w.shape[1], group_size) - w.shape[1]
    wp = torch.nn.functional.pad(w, (0, pad)) if pad else w
    return wp.reshape(wp.shape[0], -1, group_size)


def clip_groups(w: torch.Tensor, ratios: torch.Tensor, group_size: int) -> torch.Tensor:
    """`w` [out, in] with each group clamped to +-ratio * max|w| of the group (`ratios` [out, ceil(in/g)]), float32."""
    w = w.detach().float()
    wg = _grouped(w, group_size)
    m = wg.abs().amax(dim=2, keepdim=True) * ratios[..., None].float()
    return torch.maximum(torch.minimum(wg, m), -m).reshape(w.shape[0], -1)[:, : w.shape[1]]


def clip_search(w: torch.Tensor, hessian: torch.Tensor, group_size: int, symmetric: bool,
                ratios: Sequence[float] = CLIP_RATIOS) -> tuple[torch.Tensor, float, float]:
    """AutoAWQ's weight clipping for one [out, in] weight reading the input of `hessian`: per group the ratio of
    `ratios` whose clamped RTN has the smallest group output error dw_g H_gg dw_g^T (H's diagonal block); a row
    keeps its ratios only if its whole error dw_r H dw_r^T (cross-group terms included) goes down.

    Returns (ratios [out, ceil(in/g)], 1 where unclipped; the weight's error after, and before clipping).
    """
    w = w.detach().float()
    h = hessian.detach().float()
    n_out, k = w.shape
    kp = P.padded_width(k, group_size)
    groups = kp // group_size
    hp = torch.nn.functional.pad(h, (0, kp - k, 0, kp - k))  # padded columns are zero weights: no error
    blocks = torch.stack([hp[i * group_size:(i + 1) * group_size, i * group_size:(i + 1) * group_size]
                          for i in range(groups)])  # [G, g, g]
    wg = _grouped(w, group_size)
    best_err = torch.full((n_out, groups), float("inf"), dtype=torch.float64, device=w.device)
    best = torch.ones(n_out, groups, device=w.device)
    for r in ratios:
        ratio = torch.full((n_out, groups), float(r), device=w.device)
        dw = wg - _grouped(rtn(clip_groups(w, ratio, group_size), group_size, symmetric), group_size)
        err = torch.einsum("ngi,gij,ngj->ng", dw, blocks, dw).double()
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, ratio, best)
    before = _row_errors(w - rtn(w, group_size, symmetric), h)
    after = _row_errors(w - rtn(clip_groups(w, best, group_size), group_size, symmetric), h)
    keep = after < before
    best = torch.where(keep[:, None], best, torch.ones_like(best))
    return best, float(torch.where(keep, after, before).sum()), float(before.sum())


@dataclass(frozen=True)
class SiteSearch:
    """The alpha search of one site: the chosen `alpha` and `scale` s, its `loss` and RTN's (`rtn_loss`, alpha = 0),
    and `losses` per grid value (tr(dW H dW^T) summed over the site's weights, in H's units)."""

    site: str
    alpha: float
    scale: torch.Tensor
    loss: float
    rtn_loss: float
    losses: tuple[float, ...]

    def to_dict(self) -> dict:
        return {
            "alpha": self.alpha,
            "scale_min": float(self.scale.min()),
            "scale_max": float(self.scale.max()),
            "loss": self.loss,
            "rtn_loss": self.rtn_loss,
            "loss_vs_rtn": self.loss / self.rtn_loss if self.rtn_loss > 0 else 1.0,
        }


def search_site(site: str, weights: Sequence[torch.Tensor], hessian: torch.Tensor, group_size: int, symmetric: bool,
                grid: Sequence[float] = ALPHA_GRID) -> SiteSearch:
    """The alpha of `grid` whose scales give the smallest summed output error of `weights` (first one on ties)."""
    if not grid or 0.0 not in grid:
        raise FFNQuantError("the awq alpha grid must hold 0 (plain RTN), so that the search is never worse than RTN")
    stat = channel_rms(hessian)
    h = hessian.detach().float()  # cast once, not per grid point
    losses = []
    best: tuple[float, float, torch.Tensor] | None = None
    for alpha in grid:
        s = awq_scales(stat, float(alpha))
        loss = scaled_error(weights, h, s, group_size, symmetric)
        losses.append(loss)
        if best is None or loss < best[0]:
            best = (loss, float(alpha), s)
    assert best is not None
    return SiteSearch(site, best[1], best[2], best[0], losses[list(grid).index(0.0)], tuple(losses))


@dataclass
class AWQRecord(RemedyRecord):
    """The AWQ fold's `RemedyRecord`, carrying the scales themselves (`scales`: site -> s, float32) and the clipping
    ratios (`clips`: weight -> [out, groups]) so that the same fold and clipping can be applied again (`refold`,
    `clip_weights`: the ONNX artifact). `to_dict` stays the RemedyRecord's (no tensors)."""

    scales: dict = field(default_factory=dict, repr=False)
    clips: dict = field(default_factory=dict, repr=False)


def _group(scheme: Scheme, in_features: int) -> int:
    """The scheme's group along a weight's input (per_channel: one group spanning it, as quantize_weight does)."""
    return scheme.group_size if scheme.weight_granularity is Granularity.PER_GROUP else in_features


def _hidden_refusal(model: FFN) -> str | None:
    """Why the hidden site cannot take a scale exactly (None when it can)."""
    spec = model.spec
    if not smooth_exact_for(model)["hidden"]:
        return (f"hidden not scaled (s = 1): {spec.activation.value}(z/s) != {spec.activation.value}(z)/s, "
                "so folding 1/s into w_up would change the function")
    if not isinstance(model.hidden_transform, nn.Identity):
        return "hidden not scaled (s = 1): it is rotated, and the rotation mixes the channels a scale would fold into w_up"
    return None


def apply_scales(model: FFN, scales: Mapping[str, torch.Tensor]) -> FFN:
    """A new FFN with AWQ scales folded in, exactly in float: `input` s into w_up/w_gate columns and 1/s into
    `input_transform` (composed with an existing ChannelScale); `hidden` s into w_down columns and 1/s into w_up's
    output rows and bias."""
    unknown = sorted(set(scales) - {"input", "hidden"})
    if unknown:
        raise FFNQuantError(f"awq scales for unknown site(s) {unknown}; valid: input, hidden")
    new = copy.deepcopy(model)
    with torch.no_grad():
        s = scales.get("input")
        if s is not None:
            if isinstance(model.input_transform, ChannelScale):  # a smoothed model: the scales compose
                prior = model.input_transform.scale
            elif isinstance(model.input_transform, nn.Identity):
                prior = torch.ones_like(s)
            else:
                raise FFNQuantError(f"awq cannot fold into an input transform of type {type(model.input_transform).__name__}")
            new.input_transform = ChannelScale(prior / s)
            for lin in [new.w_up] + ([new.w_gate] if new.w_gate is not None else []):
                lin.weight.mul_(s[None, :])
        s = scales.get("hidden")
        if s is not None:
            why = _hidden_refusal(model)
            if why is not None:
                raise FFNQuantError(f"awq cannot scale the hidden of {model.spec.variant.value}: {why}")
            new.w_up.weight.div_(s[:, None])
            if new.w_up.bias is not None:
                new.w_up.bias.div_(s)
            new.w_down.weight.mul_(s[None, :])
    return new.eval()


def awq_fold(model: FFN, hessians: Mapping[str, torch.Tensor], scheme: Scheme) -> tuple[FFN, AWQRecord]:
    """Search AWQ's scales on `hessians` (`fakequant.input_hessians` of `model`, by weight name) for `scheme`'s
    grid and fold them into a new FFN (exact in float); search each weight's clipping ratios on the scaled
    weights (kept in the record, applied by `clip_weights`). The record states the alpha, scale range and
    losses per site and the clipped groups per weight.

    The input scale is searched on the weights as they are; the hidden one on w_down. w_up then holds both
    (columns times the input s, rows over the hidden s); a row's common factor leaves its groups' RTN and
    clipping the same up to float rounding, so the searches do not interact.
    """
    if scheme.method is not Method.AWQ:
        raise FFNQuantError(f"awq_fold needs an awq scheme, got {scheme.name!r} ({scheme.method.value})")
    missing = [w for w in model.spec.weight_names if w not in hessians]
    if missing:
        raise FFNQuantError(f"scheme {scheme.name!r} (awq) needs calibration data for the input Hessians of {missing}")
    sym = scheme.weight_symmetric
    spec = model.spec
    consumers = [model.w_up] + ([model.w_gate] if model.w_gate is not None else [])
    searches = {"input": search_site("input", [lin.weight for lin in consumers], hessians["w_up"],
                                     _group(scheme, spec.d_model), sym)}
    why_not_hidden = _hidden_refusal(model)
    if why_not_hidden is None:
        searches["hidden"] = search_site("hidden", [model.w_down.weight], hessians["w_down"], _group(scheme, spec.d_ff), sym)
    scales = {site: r.scale for site, r in searches.items()}
    new = apply_scales(model, scales)
    details = {site: r.to_dict() for site, r in searches.items()}
    # Clipping on each weight scaled by its own input's s (H scaled to match: the error is the same number), so
    # the errors are in the search's units; w_up's rows over the hidden s change no ratio (a row's common factor).
    clips: dict[str, torch.Tensor] = {}
    for name in spec.weight_names:
        site = _READS[name]
        weight = getattr(model, name).weight
        s = scales.get(site, torch.ones(weight.shape[1], device=weight.device))
        h = hessians[name].double() / (s.double()[:, None] * s.double()[None, :])
        ratios, after, before = clip_search(getattr(model, name).weight.detach().float() * s[None, :], h,
                                            _group(scheme, s.shape[0]), sym)
        clips[name] = ratios
        details.setdefault("clip", {})[name] = {"groups_clipped": int((ratios < 1).sum()), "groups": ratios.numel(),
                                                "loss": after, "loss_unclipped": before}
    details["input"]["fold"] = ("x * (1/s) before the input tap (fold into the preceding norm's gain); s into w_up"
                                + ("/w_gate" if model.w_gate is not None else "") + " columns")
    if "hidden" in details:
        kind = "linear value branch" if spec.gated else "relu is positively homogeneous"
        details["hidden"]["fold"] = ("1/s into w_up output rows" + (" and bias" if model.w_up.bias is not None else "")
                                     + f" ({kind}); s into w_down input columns")
    record = AWQRecord(
        "awq",
        {"alpha_grid": [ALPHA_GRID[0], ALPHA_GRID[-1], len(ALPHA_GRID)], "statistic": "rms (sqrt(diag(H)/n))",
         "clip_ratios": [CLIP_RATIOS[-1], CLIP_RATIOS[0], len(CLIP_RATIOS)],
         "group_size": scheme.group_size, "symmetric": sym, "sites": list(searches)},
        details,
        note=why_not_hidden or "",
        scales=scales,
        clips=clips,
    )
    return new, record


def refold(model: FFN, record: RemedyRecord) -> FFN:
    """`model` with the scales of an earlier `awq_fold` (its `AWQRecord`) folded in again: bit-identical weights."""
    if not isinstance(record, AWQRecord):
        raise FFNQuantError(f"expected the AWQRecord of awq_fold, got a {record.kind!r} record")
    return apply_scales(model, record.scales)


def clip_weights(folded: FFN, record: AWQRecord, names: Sequence[str]) -> FFN:
    """A copy of the folded FFN with the weights `names` clipped by the record's ratios: what their RTN reads
    (not exact in float: only for weights about to be quantized)."""
    new = copy.deepcopy(folded)
    with torch.no_grad():
        for name in names:
            lin = getattr(new, name)
            g = record.params["group_size"] or lin.in_features
            lin.weight.copy_(clip_groups(lin.weight, record.clips[name], g))
    return new.eval()
