"""Quantize an FFN under a Recipe and measure it: calibrate once, quantize, ONNX artifact, accuracy.

`prepare` builds (or takes) the float FFN, applies a recipe's remedies and profiles the calibration
tokens; `quantize_spec(spec, recipe, prepared)` quantizes under the recipe's Scheme (torch reference
numerics from `ffnquant.methods.fakequant`, re-exported here), writes the ONNX artifact `{stem}.{recipe.slug}.onnx`
(`ffnquant.onnx.onnxquant`) and measures both against the float reference; `sensitivity` is the per-site
SQNR of one quantized FFN; `quantize_recipes` runs many recipes on one FFN, calibrating once per
remedy set.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from .backends import supports
from .data import TokenSource, calibration_and_eval, parse_source
from .errors import FFNQuantError
from .infra.atomic import is_output_failure
from .infra.envinfo import environment
from .model import FFN, build
from .numerics.accuracy import accuracy_of, run_batched, sqnr_db
from .numerics.primitives import all_finite
from .methods.fakequant import (QuantizedFFN, SiteRange, input_hessians, quantize_model, quantize_weight,
                                 search_calibrators)
from .numerics.observe import DEFAULT_BINS, profile
from .onnx import onnxquant as OQ
from .onnx.export import export_onnx
from .onnx.ortcpu import int8_kernels, saturating
from .recipe import Recipe, Rotate, Smooth, Transform, as_recipe, canonical_transforms, remedy_slug
from .schemes import Method, Scheme, check_scheme_fits

if TYPE_CHECKING:  # annotations only
    from .spec import FFNSpec

__all__ = [
    "RESULT_SCHEMA_VERSION",
    "Prepared",
    "prepare",
    "QuantResult",
    "sensitivity",
    "quantize_spec",
    "RecipeOutcome",
    "quantize_recipes",
]


# =====================================================================================
# End to end: calibrate once per (variant, remedies), quantize per scheme, measure
# =====================================================================================

RESULT_SCHEMA_VERSION = 1


@dataclass
class Prepared:
    """Everything a scheme needs that does not depend on the scheme: reuse it across schemes.

    `model` is the float model after remedies (what gets quantized), `reference` the original
    float model (what accuracy is measured against), `table` the RangeTable of `model` over the
    calibration tokens (profiled on first use: a scheme with no static activation range never reads it),
    `calib` / `eval` disjoint token sets, `remedies` the remedy records and `transforms` the remedies as a
    recipe states them, in the order applied (what a recipe must match to use it; `smooth` / `rotate` read them).
    """

    spec: Any
    reference: FFN
    model: FFN
    _table: Any  # a RangeTable, or a function making it (`table`)
    calib: torch.Tensor
    eval: torch.Tensor
    source_label: str
    remedies: list = field(default_factory=list)
    _hessians: dict | None = None
    _ref_eval: torch.Tensor | None = None
    _search: dict = field(default_factory=dict)
    _folds: dict = field(default_factory=dict)  # the method handlers' fold searches on `model` (AWQ's), per scheme
    _files: dict = field(default_factory=dict)
    _scratch: Any = None
    name: str | None = None  # file-name stem of the ONNX files (default the spec key)
    transforms: tuple[Transform, ...] = ()

    @property
    def table(self) -> Any:
        """The RangeTable of `model` over the calibration tokens, profiled on first use."""
        if callable(self._table):
            self._table = self._table()
        return self._table

    @property
    def smooth(self) -> float | None:
        return next((t.alpha for t in self.transforms if isinstance(t, Smooth)), None)

    @property
    def rotate(self) -> bool:
        return any(isinstance(t, Rotate) for t in self.transforms)

    @property
    def stem(self) -> str:
        """What ONNX file names start with: `name` (e.g. a real model's layer) or the spec key."""
        return self.name or self.spec.key

    @property
    def remedy_slug(self) -> str:
        """The remedies as a file-name part ('' or e.g. 'smooth0.5-rotate'): the rule Recipe.remedy_slug follows,
        so the remedied fp32 export and the artifacts share one name."""
        return remedy_slug(self.transforms)

    def matches(self, recipe: Recipe) -> bool:
        """True when this calibration was prepared with exactly `recipe`'s remedies."""
        return self.transforms == recipe.remedies

    def scratch(self) -> Path:
        """A temporary folder for ONNX files nobody asked to keep (removed with this object)."""
        from .infra.atomic import ScratchFolder

        if self._scratch is None:
            self._scratch = ScratchFolder("quantize")
        return Path(self._scratch.name)

    def onnx_file(self, which: str, folder: Path) -> Path:
        """The fp32 export of the `reference` or remedied `model`, or the ORT-default baseline, made once per folder.

        Names: `{stem}.fp32.onnx` (reference, and the model without remedies), `{stem}.{remedy_slug}.fp32.onnx`
        (the remedied model), `{stem}.ort-default-static.onnx` (the baseline)."""
        from .onnx.export import export_onnx

        key = (which, str(folder))
        path = self._files.get(key)
        if path is not None and path.exists():
            return path
        if which == "reference" or (which == "model" and not self.remedy_slug):
            path = folder / f"{self.stem}.{Recipe('fp32').slug}.onnx"
            export_onnx(self.reference, path)
        elif which == "model":
            path = folder / f"{self.stem}.{self.remedy_slug}.{Recipe('fp32').slug}.onnx"
            export_onnx(self.model, path)
        elif which == "baseline":
            path = folder / f"{self.stem}.ort-default-static.onnx"
            OQ.ort_default_static(self.onnx_file("reference", folder), path, self.calib_batches())
        else:
            raise FFNQuantError(f"unknown prepared file {which!r}")
        self._files[key] = path
        return path

    def share_files(self, other: "Prepared") -> None:
        """Reuse `other`'s reference export and ORT-default baseline, and its float reference's outputs on the same
        evaluation tokens (they do not depend on the remedies)."""
        self._files.update({k: p for k, p in other._files.items() if k[0] in ("reference", "baseline")})
        if self._ref_eval is None and other.reference is self.reference and other.eval is self.eval:
            self._ref_eval = other._ref_eval

    def calib_batches(self, batch_size: int = 1024) -> list[torch.Tensor]:
        return [self.calib[i : i + batch_size] for i in range(0, self.calib.shape[0], batch_size)]

    def hessians(self) -> dict[str, torch.Tensor]:
        if self._hessians is None:
            self._hessians = input_hessians(self.model, self.calib_batches())
        return self._hessians

    def ref_eval(self) -> torch.Tensor:
        from .numerics.accuracy import run_batched

        if self._ref_eval is None:
            self._ref_eval = run_batched(self.reference, self.eval)
        return self._ref_eval


def _check_tokens(x: torch.Tensor, d_model: int, what: str) -> torch.Tensor:
    x = torch.as_tensor(x).float()
    if x.ndim < 2 or x.shape[-1] != d_model:
        raise FFNQuantError(f"{what} tokens have shape {tuple(x.shape)}; expected (..., {d_model})")
    x = x.reshape(-1, d_model)
    if not all_finite(x):
        n_bad = int((~torch.isfinite(x)).sum())
        raise FFNQuantError(f"{what} tokens contain {n_bad} NaN/Inf values")
    return x


def calibration_batches(calib: torch.Tensor) -> list[torch.Tensor]:
    """Calibration rows [n, d] in the batches `prepare` runs them in."""
    return [calib[i : i + 1024] for i in range(0, calib.shape[0], 1024)]


def site_profile(model: FFN, calib: torch.Tensor, bins: int | None = None) -> Any:
    """The range profile `prepare` takes of a model's input and hidden sites over calibration rows: what a caller
    that has it (a plan's float figures, a shared FFN's calls merged) hands `prepare` as `profiles`."""
    return profile(model, calibration_batches(calib), sites=["input", "hidden"], weights=False,
                   bins=DEFAULT_BINS if bins is None else bins)


def prepare(
    spec: FFNSpec,
    source: Any = "llm_like",
    calib_tokens: int | torch.Tensor = 4096,
    eval_tokens: int | torch.Tensor = 2048,
    seed: int = 0,
    smooth: float | None = None,
    smooth_sites: Sequence[str] | None = None,
    rotate: bool = False,
    model: FFN | None = None,
    name: str | None = None,
    *,
    recipe: Recipe | None = None,
    bins: int | None = None,
    profiles: dict | None = None,
    reference_eval: torch.Tensor | None = None,
    hessians: Mapping[str, torch.Tensor] | None = None,
) -> Prepared:
    """Build (or take) the FFN, apply remedies, profile `input`/`hidden` over the calibration tokens.

    `source`: 'gaussian', 'llm_like', a token file path, or a data.TokenSource; or pass the
    tokens themselves as `calib_tokens` / `eval_tokens` tensors ([n, d]). Remedies that need
    ranges (smooth) are computed from a profile of the original model. `recipe`: take the remedies
    (smooth strength, rotate) from this Recipe instead of `smooth` / `rotate` (giving both is an
    error); `smooth_sites` still chooses where smoothing applies. `name`: the stem of the ONNX files
    made from it (default the spec key; a real model's layer passes its own). `bins`: histogram bins
    of the range profiles (default observe's). `profiles`: a dict the calls of one `quantize_recipes` share, of
    the range profiles already taken by remedy steps done (all calls there prepare the same model on the same
    tokens: the plain model's profile is the one smoothing reads). `reference_eval`: the float model's outputs on
    the evaluation tokens, when the caller has them (`run_batched` of the same model on the same tokens).
    `hessians`: GPTQ's Hessians to quantize with, when the caller has them (the calls of one shared FFN: every
    call's summed, `hf.layers`); else taken from the calibration tokens when first needed.
    """
    if recipe is not None:
        if smooth is not None or rotate:
            raise FFNQuantError(f"prepare: give the remedies once, in the recipe ({recipe}) or as smooth/rotate, not both")
        steps = recipe.remedies
    else:
        steps = canonical_transforms(([Smooth(smooth)] if smooth is not None else []) + ([Rotate()] if rotate else []))
    bins = DEFAULT_BINS if bins is None else bins

    d = spec.d_model
    ref = model if model is not None else build(spec, seed=seed)
    if isinstance(calib_tokens, torch.Tensor) and isinstance(eval_tokens, torch.Tensor):
        calib = _check_tokens(calib_tokens, d, "calibration")
        ev = _check_tokens(eval_tokens, d, "evaluation")
        label = "in-memory tokens"
    else:
        if isinstance(calib_tokens, torch.Tensor) or isinstance(eval_tokens, torch.Tensor):
            raise FFNQuantError("pass both calibration and evaluation tokens as tensors, or neither")
        src = source if isinstance(source, TokenSource) else parse_source(str(source), seed=seed)
        cal_src, ev = calibration_and_eval(src, int(calib_tokens), int(eval_tokens), d)
        calib = _check_tokens(cal_src.tokens(int(calib_tokens), d), d, "calibration")
        ev = _check_tokens(ev, d, "evaluation")
        label = src.label
    if calib.shape[0] == 0:
        raise FFNQuantError("no calibration tokens: static schemes, smooth and gptq need calibration data")
    if ev.shape[0] == 0:
        raise FFNQuantError("no evaluation tokens: accuracy is measured on held-out data")
    batches = calibration_batches(calib)
    def ranges_of(done: tuple, model: FFN):
        """The range profile of `model` (`ref` after the steps `done`): from `profiles` when it has it."""
        if profiles is not None and done in profiles:
            return profiles[done]
        table = site_profile(model, calib, bins)
        if profiles is not None:
            profiles[done] = table
        return table

    work, records = ref, []
    for k, step in enumerate(steps):  # in the recipe's order: each remedy sees the model the steps before it left
        work, rec = step.apply(work, batches, original=ref, smooth_sites=smooth_sites, bins=bins,
                               ranges=lambda done=tuple(steps[:k]), model=work: ranges_of(done, model))
        records.append(rec)
    table = functools.partial(ranges_of, tuple(steps), work)  # profiled when a static range is first asked for
    prepared = Prepared(spec, ref, work, table, calib, ev, label, records, name=name, transforms=tuple(steps))
    if reference_eval is not None:
        if tuple(reference_eval.shape) != (ev.shape[0], spec.d_model):
            raise FFNQuantError(f"reference_eval is {tuple(reference_eval.shape)}, the evaluation tokens give "
                                f"{(ev.shape[0], spec.d_model)}")
        prepared._ref_eval = reference_eval
    if hessians is not None:
        if steps:
            raise FFNQuantError("prepare: given Hessians are of the model without remedies; a recipe with remedies "
                                "takes its own")
        prepared._hessians = dict(hessians)
    return prepared


@dataclass
class QuantResult:
    """One (variant, recipe) measurement: ranges, accuracy in torch and ONNX, sizes, sensitivity."""

    spec: Any
    scheme: Scheme
    calibrator: str | None
    source: str
    n_calib: int
    n_eval: int
    remedies: list
    ranges: dict[str, SiteRange]
    accuracy: Any  # Accuracy (torch reference)
    sensitivity: dict[str, float]
    artifact: dict[str, Any] = field(default_factory=dict)
    baseline: dict[str, Any] = field(default_factory=dict)
    fp32: dict[str, Any] = field(default_factory=dict)
    environment: dict[str, Any] = field(default_factory=dict)
    qmodel: QuantizedFFN | None = None
    recipe: Recipe | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": RESULT_SCHEMA_VERSION,
            "recipe": str(self.recipe) if self.recipe is not None else None,
            "spec": self.spec.to_dict(),
            "scheme": self.scheme.to_dict(),
            "calibrator": self.calibrator,
            "source": self.source,
            "n_calib_tokens": self.n_calib,
            "n_eval_tokens": self.n_eval,
            "remedies": [r.to_dict() for r in self.remedies],
            "ranges": {s: r.to_dict() for s, r in self.ranges.items()},
            "accuracy_torch": self.accuracy.to_dict(),
            "sensitivity_sqnr_db": self.sensitivity,
            "artifact": self.artifact,
            "ort_default_baseline": self.baseline,
            "fp32": self.fp32,
            "environment": self.environment,
        }


def sensitivity(prep: Prepared, qmodel: QuantizedFFN, hessians: Mapping[str, torch.Tensor] | None = None) -> dict[str, float]:
    """Per-site sensitivity: the output SQNR (dB, on `prep`'s held-out tokens against its float reference)
    with only one weight or one activation site of `qmodel` quantized as in `qmodel`, everything else float.

    Keys are `qmodel.quantized_weights` then `qmodel.quantized_sites`. Weights are requantized under
    `qmodel.scheme` (a GPTQ scheme with `hessians`, default `prep.hessians()`: the Hessians of
    `prep.model` over its calibration tokens); sites reuse `qmodel`'s own static ranges.

    No copy of the FFN is made: each quantized weight stands in for its float one in `prep.model` (and each
    site's fake-quantizer is hooked onto it) while the held-out tokens run, then the float one is put back;
    the numbers are those of `quantize_model(prep.model, ..., weights=[w])` / `(..., sites=[s])`, a whole copy
    each. AWQ weights (the searched scales folded into a new FFN) are made so, one copy at a time.
    """
    if hessians is None and qmodel.scheme.needs_hessians and qmodel.quantized_weights:
        hessians = prep.hessians()
    out: dict[str, float] = {}
    ref, model, scheme = prep.ref_eval(), prep.model, qmodel.scheme
    for w in qmodel.quantized_weights:
        if scheme.method is Method.AWQ:
            one = quantize_model(model, scheme, weights=[w], sites=[], hessians=hessians)
            out[w] = sqnr_db(ref, run_batched(one, prep.eval))
            del one
            continue
        lin = getattr(model, w)
        original = lin.weight
        with torch.no_grad():  # into a tensor laid out as the float one, as quantize_model copies it
            deq = quantize_weight(original, scheme, hessians.get(w) if hessians is not None else None)
            lin.weight = torch.nn.Parameter(torch.empty_like(original).copy_(deq), original.requires_grad)
        del deq
        try:
            out[w] = sqnr_db(ref, run_batched(model, prep.eval))
        finally:
            lin.weight = original
    for s in qmodel.quantized_sites:
        one = QuantizedFFN(model, scheme, {k: r for k, r in qmodel.ranges.items() if k == s}, [], [s])
        try:
            out[s] = sqnr_db(ref, run_batched(one, prep.eval))
        finally:
            one.remove_hooks()
    return out


_site_sensitivity = sensitivity  # quantize_spec's `sensitivity` flag shadows the name inside it

# What `quantize_spec` passes to `prepare` when no `prepared` is given.
_PREPARE_KEYS = ("source", "calib_tokens", "eval_tokens", "seed", "smooth_sites", "model", "name", "bins",
                 "reference_eval", "hessians")


# Calibration rows the calibrator search scores its ranges on: evenly strided over the calibration text, so every
# sequence and position (the first token's massive activations too) is represented, not only the leading sequences.
SEARCH_ROWS = 512


def _search_rows(calib: torch.Tensor, limit: int = SEARCH_ROWS) -> torch.Tensor:
    if calib.shape[0] <= limit:
        return calib
    return calib[:: -(-calib.shape[0] // limit)].contiguous()


def quantize_spec(
    spec: FFNSpec,
    recipe: Recipe | str,
    prepared: Prepared | None = None,
    *,
    out_artifacts: str | os.PathLike | None = None,
    onnx: bool = True,
    baseline: bool = True,
    sensitivity: bool = True,
    latency: bool = False,
    **prepare_kw: Any,
) -> QuantResult:
    """Quantize one FFN under one recipe and measure it (torch reference, ONNX artifact, ORT default baseline).

    `recipe`: a `Recipe` (or its text, parsed here once: `w8a8@search+smooth+rotate`); its Scheme is
    resolved once. `prepared` (from `prepare`, with the recipe's remedies) reuses the model, remedies,
    RangeTable and tokens across recipes; without it `prepare(spec, recipe=recipe, **prepare_kw)` makes one
    (`prepare_kw`: source, calib_tokens, eval_tokens, seed, smooth_sites, model, name, bins; giving them
    beside `prepared` is an error, they would be ignored). With `out_artifacts` the ONNX files are kept
    there (else in a temporary folder, sizes still reported): `{stem}.{recipe.slug}.onnx`, the fp32
    exports `{stem}.fp32.onnx` / `{stem}.{recipe.remedy_slug}.fp32.onnx`. The calibrator 'search' picks
    per site by output SQNR on the calibration tokens (cached per scheme grid in `prepared`).
    """
    recipe = as_recipe(recipe)
    scheme = recipe.resolve()
    check_scheme_fits(scheme, spec)
    unknown = sorted(set(prepare_kw) - set(_PREPARE_KEYS))
    if unknown:
        raise FFNQuantError(f"quantize_spec: unknown argument(s) {', '.join(unknown)}; valid: {', '.join(_PREPARE_KEYS)}")
    if prepared is None:
        prepared = prepare(spec, recipe=recipe, **prepare_kw)
    elif prepare_kw:
        raise FFNQuantError(f"quantize_spec: {', '.join(sorted(prepare_kw))} only apply when it prepares the calibration "
                            "itself; pass them to prepare() instead of beside `prepared`")
    elif not prepared.matches(recipe):
        have = prepared.remedy_slug or "no remedies"
        raise FFNQuantError(f"recipe {recipe} needs a calibration prepared with its remedies "
                            f"({recipe.remedy_slug or 'none'}), got one with {have}")
    prep = prepared
    hessians = prep.hessians() if scheme.needs_hessians else None
    cal: Any = scheme.calibrator
    if scheme.static_activations and scheme.calibrator == "search":
        key = (scheme.act_dtype.value, scheme.act_symmetric, scheme.weight_dtype.value, scheme.weight_granularity.value)
        if key not in prep._search:
            prep._search[key] = search_calibrators(prep.model, prep.table, scheme, _search_rows(prep.calib), hessians=hessians)
        cal = prep._search[key]
    weights, sites = recipe.quantized_parts(spec)  # a `+float=SITE` recipe leaves that site and its matrices float
    table = prep.table if scheme.static_activations else None  # no static range read: none is profiled
    q = quantize_model(prep.model, scheme, table, calibrator=cal, remedies=prep.remedies, hessians=hessians,
                       weights=weights, sites=sites, fold_cache=prep._folds)
    q.recipe = recipe
    ref = prep.ref_eval()
    acc = accuracy_of(ref, run_batched(q, prep.eval), prep.eval.shape[0])
    sens = _site_sensitivity(prep, q, hessians) if sensitivity else {}
    result = QuantResult(
        spec, scheme, scheme.calibrator if scheme.static_activations else None, prep.source_label,
        prep.calib.shape[0], prep.eval.shape[0], q.remedies, q.ranges, acc, sens, environment=environment(), qmodel=q,
        recipe=recipe,
    )
    if not onnx:
        return result

    art_support = supports("onnx-artifact", scheme)
    kind, why = art_support.kind, art_support.note
    keep = out_artifacts is not None
    folder = Path(out_artifacts) if keep else prep.scratch()
    d = spec.d_model
    fp32_ref = prep.onnx_file("reference", folder)
    fp32_work = prep.onnx_file("model", folder)
    result.fp32 = {"path": str(fp32_ref) if keep else None, "size_bytes": fp32_ref.stat().st_size}
    if latency:
        result.fp32["latency_ms"] = OQ.ort_latency_ms(fp32_ref, d)
    art: dict[str, Any] = {"kind": kind, "note": why}
    path = None
    if kind == "fp32":
        path = fp32_work  # the fp32 export itself: `{stem}.fp32.onnx`, as `{stem}.{recipe.slug}.onnx` reads
    elif kind == "fp16":
        path = folder / f"{prep.stem}.{recipe.slug}.onnx"
        export_onnx(prep.model, path, dtype="fp16")
    elif kind is not None:
        path = folder / f"{prep.stem}.{recipe.slug}.onnx"
        OQ.write_artifact(fp32_work, path, q, prep.model, hessians)
    if path is not None:
        got = OQ.run_onnx(path, prep.eval, dtype="fp16" if kind == "fp16" else "fp32")
        onnx_acc = accuracy_of(ref, got, prep.eval.shape[0])
        art.update(
            path=str(path) if keep else None,
            size_bytes=path.stat().st_size,
            accuracy_onnx=onnx_acc.to_dict(),
            sqnr_gap_db=onnx_acc.sqnr_db - acc.sqnr_db,
            provider="CPUExecutionProvider",
        )
        art.update(_as_written(path, prep, ref))
        if kind == "qdq" and not q.quantized_sites:
            # what a default session does with a weight-only QDQ model (int8 activations on the fly)
            default = OQ.run_onnx(OQ.ort_session(path, exact_weight_only=False), prep.eval)
            art["sqnr_db_default_session"] = sqnr_db(ref, default)
        if latency:
            art["latency_ms"] = OQ.ort_latency_ms(path, d, dtype="fp16" if kind == "fp16" else "fp32")
    result.artifact = art
    if baseline and scheme.act_dtype.is_integer and scheme.static_activations:
        bpath = prep.onnx_file("baseline", folder)
        b_acc = accuracy_of(ref, OQ.run_onnx(bpath, prep.eval), prep.eval.shape[0])
        result.baseline = {
            "what": "onnxruntime quantize_static defaults (QDQ, MinMax, QUInt8 activations, QInt8 weights) + per_channel=True",
            "path": str(bpath) if keep else None,
            "size_bytes": bpath.stat().st_size,
            "accuracy_onnx": b_acc.to_dict(),
            **_as_written(bpath, prep, ref),
        }
        if latency:
            result.baseline["latency_ms"] = OQ.ort_latency_ms(bpath, d)
    return result


def _as_written(path: Path, prep: Prepared, ref: torch.Tensor) -> dict[str, Any]:
    """Where this CPU's int8 kernel for the artifact's activations saturates (`ortcpu.saturating`), the graph's own
    accuracy and why.

    The artifact's `accuracy_onnx` is what runs here; `accuracy_onnx_graph` (onnxruntime with no integer
    kernel fused in) is what it computes on an exact kernel: VNNI CPUs, GPUs. Empty where the kernel is exact.
    """
    if not saturating(path):
        return {}
    exact = OQ.run_onnx(OQ.ort_session(path, as_written=True), prep.eval)
    return {"accuracy_onnx_graph": accuracy_of(ref, exact, prep.eval.shape[0]).to_dict(),
            "int8_kernel": int8_kernels().describe()}


# =====================================================================================
# Many recipes on one FFN: one calibration per remedy set, shared across its recipes
# =====================================================================================


@dataclass
class RecipeOutcome:
    """One recipe on one FFN: its `result`, or the `error` that stopped it (with `collect_errors`).

    `prepared` is the calibration the recipe used (its remedies applied): what `sensitivity` needs.
    `label` names the FFN when it is a real model's layer (set by `hf.quantize_layers`)."""

    recipe: Recipe
    result: QuantResult | None
    error: Exception | None
    prepared: Prepared | None
    label: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def quantize_recipes(
    spec: FFNSpec,
    recipes: Sequence[Recipe | str],
    *,
    collect_errors: bool = False,
    out_artifacts: str | os.PathLike | None = None,
    onnx: bool = True,
    baseline: bool = True,
    sensitivity: bool = False,
    latency: bool = False,
    profiles: Mapping[tuple, Any] | None = None,
    **prepare_kw: Any,
):
    """Yield a `RecipeOutcome` per recipe, in order: `quantize_spec` on one FFN under each recipe.

    One `prepare(spec, recipe=..., **prepare_kw)` per remedy set (smooth, rotate), shared by the recipes
    that use it; the reference fp32 export and onnxruntime's default baseline are made once (they do not
    depend on the remedies). `collect_errors`: an exception of one recipe (e.g. a remedy that cannot apply
    exactly) is yielded as its outcome's `error` and the next recipe goes on; a failure to write output
    (full disk) still raises. Without it the first error raises. `profiles`: range profiles already taken, by
    remedy prefix (`()`: the plain model's, `prepare`'s own).
    """
    preps: dict[tuple, Prepared] = {}
    # the range profiles of the model after each remedy prefix (`prepare`); a caller may hand the plain one in
    profiles: dict[tuple, Any] = dict(profiles or {})
    for item in recipes:
        recipe, prep = None, None
        try:
            recipe = as_recipe(item)
            key = recipe.remedies
            if key not in preps:
                preps[key] = prepare(spec, recipe=recipe, profiles=profiles, **prepare_kw)
                plain = preps.get(())
                if plain is not None and key != ():
                    preps[key].share_files(plain)
            prep = preps[key]
            res = quantize_spec(spec, recipe, prep, out_artifacts=out_artifacts, onnx=onnx, baseline=baseline,
                                sensitivity=sensitivity, latency=latency)
        except Exception as exc:
            if not collect_errors or recipe is None or is_output_failure(exc):
                raise
            yield RecipeOutcome(recipe, None, exc, prep)
            continue
        yield RecipeOutcome(recipe, res, None, prep)
