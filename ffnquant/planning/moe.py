"""A mixture-of-experts layer as one unit of a plan: every routed expert of a decoder layer under one recipe.

What the layer's experts module receives is kept as `Routed`: its input tokens, each token's chosen experts and
their weights (the router stays float and is the model's own). The layer's output is the weighted sum of the
experts each token was routed to (`routed_sum`, the model's own arithmetic), so a candidate is scored as any FFN
is: its output error on the search tokens, weighted by the loss gradient at the experts module's output, and its
held-out SQNR. Each expert is quantized on the tokens the router sent it (an expert that got none in a text
takes every token of its layer: a quantizer needs some). Shared experts, routers and the dense layers of other
shapes stay float, as `model inspect` names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from ..errors import FFNQuantError
from ..hf.layers import calibrate_layers
from ..quantization import quantize_recipes
from ..recipe import Recipe
from ..schemes import recipe_weight_bytes
from .scores import CandidateScore, db, scored_rows
from .sensitivity import fisher_noise

__all__ = ["MoELayer", "QuantizedMoE", "Routed", "routed_sum", "score_moe_layer", "quantize_moe_layer", "weight_bytes"]


@dataclass
class Routed:
    """The tokens an experts module receives: inputs [tokens, d_model], each token's experts [tokens, k] and
    their routing weights [tokens, k]. Sliced by rows as a tensor is."""

    x: torch.Tensor
    index: torch.Tensor
    weights: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, rows: slice) -> "Routed":
        return Routed(self.x[rows], self.index[rows], self.weights[rows])

    def to_dict(self) -> dict[str, torch.Tensor]:
        return {"x": self.x, "index": self.index, "weights": self.weights}

    @classmethod
    def cat(cls, parts: Sequence["Routed"] | Sequence[Mapping[str, torch.Tensor]]) -> "Routed":
        parts = [p if isinstance(p, Routed) else Routed(p["x"], p["index"], p["weights"]) for p in parts]
        return cls(torch.cat([p.x for p in parts]), torch.cat([p.index for p in parts]),
                   torch.cat([p.weights for p in parts]))

    def tokens_of(self, expert: int) -> torch.Tensor:
        """The input rows routed to `expert`; every row when the router sent it none."""
        rows = (self.index == expert).any(dim=-1)
        return self.x[rows] if bool(rows.any()) else self.x


def routed_sum(routed: Routed, experts: Mapping[int, Callable[[torch.Tensor], torch.Tensor]]) -> torch.Tensor:
    """The experts module's output: each token's chosen experts (`experts` by id) weighted and summed, in the
    order and arithmetic of transformers' fused experts (`hf.routed.experts_forward`)."""
    x, out = routed.x, torch.zeros_like(routed.x)
    for expert in sorted(experts):
        token, slot = torch.where(routed.index == expert)
        if token.numel() == 0:
            continue
        y = experts[expert](x[token]) * routed.weights[token, slot, None]
        out.index_add_(0, token, y.to(out.dtype))
    return out


class MoELayer:
    """One decoder layer's routed experts (`HFLayer`s, by expert id) as one layer of a plan: its label, index and
    expert spec, and `ffn` computing the float layer's output from `Routed` tokens."""

    def __init__(self, experts: Sequence[Any]) -> None:
        if not experts or any(e.info.expert is None for e in experts):
            raise FFNQuantError("an MoE layer is made of its routed experts")
        self.experts = sorted(experts, key=lambda e: e.info.expert)
        first = self.experts[0]
        self.index, self.spec, self.label = first.index, first.spec, f"L{first.index}"
        self.name = first.name

    @property
    def ffn(self) -> Callable[[Routed], torch.Tensor]:
        return lambda routed: routed_sum(routed, {e.info.expert: e.ffn for e in self.experts})

    def n_params(self) -> int:
        return sum(e.spec.n_params for e in self.experts)


class QuantizedMoE:
    """Every routed expert of an `MoELayer` quantized under one recipe: callable on `Routed` tokens, and the
    replacements the engine puts in the model (`replacements`: expert label -> QuantizedFFN)."""

    def __init__(self, layer: MoELayer, qffns: Mapping[int, Any]) -> None:
        self.labels = {e.info.expert: e.label for e in layer.experts}
        self.qffns = dict(qffns)

    def __call__(self, routed: Routed) -> torch.Tensor:
        return routed_sum(routed, self.qffns)

    def replacements(self) -> dict[str, Any]:
        return {self.labels[e]: q for e, q in self.qffns.items()}


def _quantize_experts(layer: MoELayer, recipe: Recipe, calib: Routed, held: Routed, bins: int | None):
    """Each expert quantized under `recipe` on its routed tokens: (QuantizedMoE, None) or (None, the error)."""
    qffns = {}
    for e in layer.experts:
        expert = e.info.expert
        outcome = next(iter(quantize_recipes(
            e.spec, [recipe], collect_errors=True, onnx=False, baseline=False, sensitivity=False, model=e.ffn,
            calib_tokens=calib.tokens_of(expert), eval_tokens=held.tokens_of(expert), name=e.label, bins=bins)))
        if not outcome.ok:
            return None, f"{e.label}: {str(outcome.error).splitlines()[0]}"
        qffns[expert] = outcome.result.qmodel
    return QuantizedMoE(layer, qffns), None


def _sqnr_db(ref: torch.Tensor, got: torch.Tensor) -> float | None:
    import math

    signal, noise = float(ref.double().square().sum()), float((got.double() - ref.double()).square().sum())
    if signal <= 0:
        return None
    return 200.0 if noise <= 0 else min(200.0, 10 * math.log10(signal / noise))


def weight_bytes(layer: Any, recipe: Recipe) -> int:
    """The stored bytes of one layer's FFN weights under `recipe` (a layer of routed experts: all its experts'), as
    its score says them; none for a layer calling an earlier layer's FFN (its weights shared)."""
    if isinstance(layer, MoELayer):
        return sum(recipe_weight_bytes(e.spec, recipe) for e in layer.experts)
    if getattr(getattr(layer, "info", None), "shares", None) is not None:  # another layer's FFN called again
        return 0  # its weights are stored once, counted at the first layer holding them
    return recipe_weight_bytes(layer.spec, recipe)


def score_moe_layer(layer: MoELayer, recipes: Sequence[Recipe], calib: Routed, held: Routed, grad: torch.Tensor,
                    keep: Sequence[Recipe] = (), bins: int | None = None):
    """`planning.candidates.score_layer` for an MoE layer: (scores in recipe order, {recipe: QuantizedMoE} for those in
    `keep`). A recipe is quantized for every expert in turn and scored on the layer's output."""
    try:  # the quantizers calibrate on every routed token; the error is summed over those the gradients cover
        rows, grad = scored_rows(calib, grad)
    except FFNQuantError as exc:
        raise FFNQuantError(f"{layer.label}: {exc}") from None
    with torch.no_grad():
        ref, ref_held = layer.ffn(rows), layer.ffn(held)
    signal = float(ref.double().square().sum())
    scores, kept = [], {}
    for recipe in recipes:
        q, error = _quantize_experts(layer, recipe, calib, held, bins)
        if q is None:
            scores.append(CandidateScore(str(recipe), error=error))
            continue
        with torch.no_grad():
            got, got_held = q(rows), q(held)
        noise = float((got.double() - ref.double()).square().sum())
        scores.append(CandidateScore(
            str(recipe), layer_sqnr_db=_sqnr_db(ref_held, got_held), search_noise=noise,
            search_sqnr_db=db(signal, noise), fisher=fisher_noise(grad, ref, got),
            bytes=weight_bytes(layer, recipe), search_rows=len(rows)))
        if recipe in keep:
            kept[recipe] = q
    return scores, kept


def quantize_moe_layer(layer: MoELayer, recipe: Recipe, calib: Routed, held: Routed, bins: int | None = None):
    """The QuantizedMoE of one layer under one recipe (what `score_moe_layer` scored), and its held-out SQNR."""
    q, error = _quantize_experts(layer, recipe, calib, held, bins)
    if q is None:
        raise FFNQuantError(f"{layer.label}: {recipe}: {error}")
    with torch.no_grad():
        return q, _sqnr_db(layer.ffn(held), q(held))


def moe_table(layer: MoELayer, calib: Routed, bins: int) -> Any:
    """The layer's range table: its experts' tables, each on its routed tokens, merged (the atlas's row)."""
    tables, _ = calibrate_layers(layer.experts, ({e.label: calib.tokens_of(e.info.expert)} for e in layer.experts),
                                 bins)
    merged = None
    for e in layer.experts:
        merged = tables[e.label] if merged is None else merged.merge(tables[e.label])
    return merged
