"""onnxruntime's best of its own quantizers, the per-layer baseline ffnquant's static recipes must match.

`ort_baselines` quantizes one fp32 FFN export with onnxruntime's `quantize_static` (QDQ, per-channel QInt8
weights, QUInt8 activations, as `onnxquant.ort_default_static`) under each calibration method (MinMax,
Percentile, Entropy) and with `quantize_dynamic`, runs each on the CPU provider on held-out tokens and names
the best; `versus_ort` sets recipes' SQNR against that best; `compare_with_ort` does both for a prepared FFN
(`quantization.prepare`) and a list of recipes on the same calibration and held-out tokens.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch

from ..errors import first_line, unknown_choice
from ..infra.atomic import ScratchFolder, atomic_path, is_output_failure
from ..infra.resources import check_memory
from ..numerics.accuracy import accuracy_of
from ..quantization import prepare, quantize_spec
from ..recipe import as_recipe
from .onnxquant import ort_default_static, ort_session, run_onnx

if TYPE_CHECKING:  # annotations only
    from ..quantization import Prepared

__all__ = ["ORT_METHODS", "ORT_BASELINE_METHODS", "ort_quantize", "ort_baselines", "versus_ort", "compare_with_ort"]

# name -> what runs. Static ones share ort_default_static's settings (QDQ, per-channel QInt8 weights, QUInt8
# activations) and differ only in the calibration method, at quantize_static's defaults for it: Percentile
# 99.999 of |x| in 2048 bins (symmetric), Entropy 128 bins / 128 quantized bins. quantize_static passes
# neither bin count through, and it histograms all calibration outputs in one go (below), so Entropy has a
# single candidate threshold, the whole range: it computes MinMax's ranges.
_STATIC = "per-channel QInt8 weights, QUInt8 activations"
ORT_METHODS: dict[str, str] = {
    "minmax": f"quantize_static QDQ, CalibrationMethod.MinMax, {_STATIC}",
    "percentile": f"quantize_static QDQ, CalibrationMethod.Percentile (99.999 of |x|), {_STATIC}",
    "entropy": f"quantize_static QDQ, CalibrationMethod.Entropy (128 bins), {_STATIC}",
    "dynamic": "quantize_dynamic (MatMulInteger), per-channel QInt8 weights, QUInt8 activations per tensor per run",
}
ORT_BASELINE_METHODS = tuple(ORT_METHODS)


@contextlib.contextmanager
def _quiet_ort_quantizer():
    """quantize_static/_dynamic log a "consider pre-processing" warning on the root logger every call (advice
    for image models) and the histogram calibrators print progress to stdout: a library prints nothing."""
    import io

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)


def _floats_per_token(path: str | os.PathLike) -> tuple[int, int]:
    """(sum, largest) of the per-token widths of the float activations of a graph whose leading dims are
    symbolic (batch, seq): what a histogram calibrator holds per calibration token."""
    import onnx

    graph = onnx.shape_inference.infer_shapes(onnx.load(str(path))).graph
    widths = []
    for t in (vi.type.tensor_type for vi in [*graph.input, *graph.value_info, *graph.output]):
        dims = list(t.shape.dim)  # initializers (weights) have no symbolic dim: not counted
        if t.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) and any(d.dim_param for d in dims):
            widths.append(int(np.prod([d.dim_value for d in dims if not d.dim_param and d.dim_value])))
    return sum(widths), max(widths, default=0)


def ort_quantize(fp32_path: str | os.PathLike, out_path: str | os.PathLike, method: str,
                 calib_batches: Sequence[torch.Tensor]) -> Path:
    """onnxruntime's own quantizer of the fp32 FFN under `method` (`ORT_METHODS`), written atomically to `out_path`.

    Percentile and Entropy keep every calibrated activation of every calibration batch in memory and
    histogram them at the end (onnxruntime issues #10503, PR #14183): about (sum + 2 x largest) activation
    widths x 4 bytes per calibration token (48 kB for a 576-wide SwiGLU FFN: 4096 tokens take 0.2 GB, 64k
    tokens 3 GB), checked against the free memory first. They also need batches of one shape (#18792: they
    `np.asarray` the list of batches), so they get the calibration tokens as one batch.
    """
    from onnxruntime.quantization import QuantType, quantize_dynamic

    if method not in ORT_METHODS:
        raise unknown_choice("onnxruntime quantization method", method, ORT_METHODS)
    batches = list(calib_batches)
    if method in ("percentile", "entropy") and batches:
        total, largest = _floats_per_token(fp32_path)
        n = sum(int(b.reshape(-1, b.shape[-1]).shape[0]) for b in batches)
        check_memory(n * (total + 2 * largest) * 4, f"onnxruntime's {method} calibration of {n} tokens",
                     "give it fewer calibration tokens", "to hold every activation")
        batches = [torch.cat([b.reshape(-1, b.shape[-1]) for b in batches])]
    if method != "dynamic":
        return ort_default_static(fp32_path, out_path, batches, calibrate=method)
    with _quiet_ort_quantizer(), atomic_path(out_path) as tmp:
        quantize_dynamic(str(fp32_path), str(tmp), per_channel=True, weight_type=QuantType.QInt8)
        import onnx

        onnx.checker.check_model(str(tmp), full_check=True)
    return Path(out_path)


def ort_baselines(
    fp32_path: str | os.PathLike,
    calib_batches: Sequence[torch.Tensor],
    eval_tokens: torch.Tensor,
    reference_out: torch.Tensor,
    out_dir: str | os.PathLike | None = None,
    methods: Sequence[str] = ORT_BASELINE_METHODS,
    *,
    stem: str | None = None,
    run_tokens: int = 4096,
    threads: int | None = None,
) -> dict[str, Any]:
    """onnxruntime's own quantizers of one fp32 FFN, each scored on held-out tokens, and the best of them.

    Per method (`ORT_METHODS`): `ort_quantize` on `calib_batches`, then the CPU provider on `eval_tokens`
    ([n, d]) in runs of `run_tokens` tokens (only dynamic depends on it: its activation range is per run),
    scored against `reference_out` (the float FFN on `eval_tokens`). Returns {"methods": {method: {ok, what,
    sqnr_db, accuracy, size_bytes, seconds, quantize_seconds, path, error}}, "best": {method, sqnr_db} or None,
    calib_tokens, eval_tokens, run_tokens}. A method onnxruntime fails on is recorded with its one-line
    `error`, never raised (a failure to write into `out_dir` still raises). Files are `{stem}.ort-{method}.onnx`
    in `out_dir` (stem default: the fp32 file's name less `.fp32.onnx`), else in a temporary folder removed
    before returning.
    """
    unknown = [m for m in methods if m not in ORT_METHODS]
    if unknown:
        raise unknown_choice("onnxruntime quantization method", unknown[0], ORT_METHODS)
    stem = stem or Path(fp32_path).name.removesuffix(".onnx").removesuffix(".fp32")
    rows: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        folder = Path(out_dir) if out_dir is not None else Path(stack.enter_context(
            ScratchFolder("ort-baseline")))
        for method in methods:
            row: dict[str, Any] = {"ok": False, "what": ORT_METHODS[method], "sqnr_db": None, "accuracy": None,
                                   "size_bytes": None, "path": None, "error": None, "quantize_seconds": None}
            path = folder / f"{stem}.ort-{method}.onnx"
            t0 = time.perf_counter()
            try:
                ort_quantize(fp32_path, path, method, calib_batches)
                row["quantize_seconds"] = time.perf_counter() - t0
                got = run_onnx(ort_session(path, threads=threads), eval_tokens, batch_size=run_tokens)
                acc = accuracy_of(reference_out, got, int(eval_tokens.shape[0]))
                row.update(ok=True, sqnr_db=acc.sqnr_db, accuracy=acc.to_dict(), size_bytes=path.stat().st_size,
                           path=str(path) if out_dir is not None else None)
            except Exception as exc:  # onnxruntime's failure is this method's result, not the caller's
                if is_output_failure(exc):
                    raise
                row["error"] = f"{type(exc).__name__}: {first_line(exc)}"
            row["seconds"] = time.perf_counter() - t0
            rows[method] = row
    ok = [m for m in methods if rows[m]["ok"]]
    best = max(ok, key=lambda m: rows[m]["sqnr_db"]) if ok else None  # ties: the first in `methods`
    return {"methods": rows, "best": {"method": best, "sqnr_db": rows[best]["sqnr_db"]} if best else None,
            "calib_tokens": sum(int(b.reshape(-1, b.shape[-1]).shape[0]) for b in calib_batches),
            "eval_tokens": int(eval_tokens.shape[0]), "run_tokens": int(run_tokens)}


def versus_ort(baselines: Mapping[str, Any], recipe_sqnr: Mapping[str, float]) -> dict[str, dict[str, Any]]:
    """Each recipe's SQNR next to onnxruntime's best (`ort_baselines`): {recipe: {sqnr_db, ort_best, ort_best_db,
    margin_db, matches_or_beats}}; matches_or_beats is sqnr_db >= the best's (None when every ORT method failed)."""
    best = baselines.get("best")
    out = {}
    for recipe, db in recipe_sqnr.items():
        margin = None if best is None else float(db) - best["sqnr_db"]
        out[recipe] = {"sqnr_db": float(db), "ort_best": best["method"] if best else None,
                       "ort_best_db": best["sqnr_db"] if best else None, "margin_db": margin,
                       "matches_or_beats": None if margin is None else margin >= 0.0}
    return out


def compare_with_ort(
    prep: Prepared,
    recipes: Sequence[Any],
    *,
    methods: Sequence[str] = ORT_BASELINE_METHODS,
    out_dir: str | os.PathLike | None = None,
    run_tokens: int = 4096,
    threads: int | None = None,
) -> dict[str, Any]:
    """onnxruntime's best of `methods` next to ffnquant's `recipes` on one prepared FFN (`quantization.prepare`).

    onnxruntime quantizes `prep.reference`'s fp32 export (`prep.onnx_file("reference", ...)`) calibrated on
    `prep.calib`; each recipe is `quantization.quantize_spec(..., onnx=False)` (its torch reference numerics),
    on a calibration with the recipe's remedies: `prep` when it has them, else one prepared from `prep`'s
    reference model and tokens. Both are scored on `prep.eval` against the same float output. Returns
    {"ort": ort_baselines(...), "recipes": versus_ort(...) with each recipe's `calibrators` (per site) added}.
    ONNX files go to `out_dir` when given, else to temporary folders.
    """
    folder = Path(out_dir) if out_dir is not None else prep.scratch()
    fp32 = prep.onnx_file("reference", folder)
    ort = ort_baselines(fp32, prep.calib_batches(), prep.eval, prep.ref_eval(), out_dir=out_dir, methods=methods,
                        stem=prep.stem, run_tokens=run_tokens, threads=threads)
    preps = {prep.transforms: prep}
    sqnr, calibrators = {}, {}
    for item in recipes:
        recipe = as_recipe(item)
        key = recipe.remedies
        if key not in preps:
            preps[key] = prepare(prep.spec, recipe=recipe, model=prep.reference, calib_tokens=prep.calib,
                                 eval_tokens=prep.eval, name=prep.name)
        res = quantize_spec(prep.spec, recipe, preps[key], onnx=False, baseline=False, sensitivity=False)
        sqnr[str(recipe)] = res.accuracy.sqnr_db
        calibrators[str(recipe)] = {site: r.calibrator for site, r in res.ranges.items()}
    rows = versus_ort(ort, sqnr)
    for name, row in rows.items():
        row["calibrators"] = calibrators[name]
    return {"ort": ort, "recipes": rows}
