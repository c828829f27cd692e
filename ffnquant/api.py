"""The Python API: one verb per step, on a synthetic FFN and a real model's FFN layer alike.

    import ffnquant
    q = ffnquant.quantize(ffnquant.FFNSpec("swiglu", d_model=64), "w8a8@search+smooth", "llm_like")
    print(ffnquant.evaluate(q, tokens).sqnr_db)          # accuracy against the float reference
    ffnquant.export_onnx(q, "swiglu.w8a8.onnx")          # the QDQ / MatMulNBits artifact, written atomically

`quantize` returns the `QuantizedFFN` (a torch module computing the quantized FFN) carrying its
`recipe` and its `prepared` calibration (float reference, remedied float model, tokens, GPTQ
Hessians): `export_onnx` and `evaluate` need nothing else. `profile` gives the RangeTable of a
float FFN; `run` is the whole job (`ffnquant run`) on a `RunConfig`.

Name choice: `ffnquant.run` is the FUNCTION (this module's `run`, re-exported by the package); the
job itself lives in the `ffnquant.pipeline` package, imported lazily inside it, so no submodule named
`run` can shadow the function on the package.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from .backends import supports
from .data import parse_source
from .errors import FFNQuantError, api_boundary
from .infra.atomic import ensure_writable_dir
from .model import FFN, build
from .numerics.accuracy import accuracy_of, run_batched
from .methods.fakequant import QuantizedFFN
from .numerics.observe import DEFAULT_BINS, profile as observe_profile
from .onnx import onnxquant as OQ
from .onnx.export import export_onnx as export_float
from .pipeline import RunConfig
from .quantization import Prepared, _check_tokens, prepare, quantize_spec
from .recipe import Recipe, as_recipe
from .spec import FFNSpec

__all__ = ["QuantizedFFN", "quantize", "export_onnx", "evaluate", "profile", "run"]


def _model_of(layer_or_spec: Any, seed: int = 0) -> tuple[FFNSpec, FFN, str | None]:
    """(spec, float FFN, file-name stem) of an FFNSpec (built with `seed`), an FFN or a real model's layer."""
    if isinstance(layer_or_spec, FFNSpec):
        return layer_or_spec, build(layer_or_spec, seed=seed), None
    if isinstance(layer_or_spec, FFN):
        return layer_or_spec.spec, layer_or_spec, None
    ffn = getattr(layer_or_spec, "ffn", None)  # hf.HFLayer (from ffnquant.hf.load_ffn_layers)
    if isinstance(ffn, FFN):
        return ffn.spec, ffn, getattr(layer_or_spec, "label", None)
    raise FFNQuantError(f"expected an FFNSpec, an ffnquant.FFN or a model layer from ffnquant.hf.load_ffn_layers, "
                        f"got {type(layer_or_spec).__name__}")


def _tokens(x: Any, d_model: int, what: str) -> torch.Tensor:
    return _check_tokens(x if isinstance(x, torch.Tensor) else torch.as_tensor(x), d_model, what)


@api_boundary
def quantize(
    layer_or_spec: Any,
    recipe: Recipe | str,
    calibration: torch.Tensor | str = "llm_like",
    *,
    held_out: torch.Tensor | None = None,
    calib_tokens: int = 4096,
    eval_tokens: int = 2048,
    seed: int = 0,
) -> QuantizedFFN:
    """Quantize one FFN under `recipe` (a Recipe or text like 'w8a8@search+smooth+rotate').

    `layer_or_spec`: an `FFNSpec` (its FFN built with `seed`), an `ffnquant.FFN`, or a real model's FFN
    layer from `ffnquant.hf.load_ffn_layers`. `calibration`: the tokens [n, d_model] the ranges, smoothing
    and GPTQ Hessians are taken from, or a token source name ('llm_like', 'gaussian', a .npy file) from
    which `calib_tokens` calibration and `eval_tokens` held-out tokens are drawn. With a tensor, the
    prepared held-out set (what `evaluate(q)` measures on without tokens) is `held_out`, or the
    calibration tokens themselves when not given. The numbers are those of `quantization.quantize_spec`.
    """
    recipe = as_recipe(recipe)
    spec, model, name = _model_of(layer_or_spec, seed)
    recipe.check_fits(spec)
    if isinstance(calibration, str):
        if held_out is not None:
            raise FFNQuantError("held_out tokens go with calibration tokens; a source name draws both")
        prep = prepare(spec, calibration, calib_tokens, eval_tokens, seed, model=model, name=name, recipe=recipe)
    else:
        calib = _tokens(calibration, spec.d_model, "calibration")
        ev = calib if held_out is None else _tokens(held_out, spec.d_model, "held-out")
        prep = prepare(spec, calib_tokens=calib, eval_tokens=ev, model=model, name=name, recipe=recipe)
    q = quantize_spec(spec, recipe, prep, onnx=False, sensitivity=False).qmodel
    q.prepared = prep
    return q


def _prepared(q: Any) -> Prepared:
    prep = getattr(q, "prepared", None)
    if not isinstance(q, QuantizedFFN) or prep is None:
        raise FFNQuantError("expected the QuantizedFFN that ffnquant.quantize returned (it carries its calibration)")
    return prep


@api_boundary
def export_onnx(q: QuantizedFFN, path: str | os.PathLike) -> Path:
    """Write `q`'s ONNX artifact to `path` (atomically: the file appears complete or not at all) and return it.

    QDQ int8 with `q`'s calibrated scales, MatMulNBits (int4: RTN, HQQ, GPTQ) or MatMulBnb4 (nf4, fp4) around
    the FFN matmuls of the (remedied) float model, as `ffnquant quantize` writes them; fp32 / fp16 recipes
    give the float export. A recipe with no onnxruntime artifact (e.g. fp8) raises FFNQuantError saying why.
    """
    prep = _prepared(q)
    path = Path(path)
    support = supports("onnx-artifact", q.scheme)
    kind, why = support.kind, support.note
    if kind is None:
        raise FFNQuantError(f"recipe {q.recipe or q.scheme.name}: no ONNX artifact: {why}")
    ensure_writable_dir(path.parent)
    if kind in ("fp32", "fp16"):
        export_float(prep.model, path, dtype=kind)
        return path
    hessians = prep.hessians() if q.scheme.needs_hessians else None
    return OQ.write_artifact(prep.onnx_file("model", prep.scratch()), path, q, prep.model, hessians)


@api_boundary
def evaluate(q: QuantizedFFN, tokens: torch.Tensor | None = None):
    """The `accuracy.Accuracy` (SQNR dB, cosine, relative L2, max abs error) of `q` against its float reference
    (the FFN before remedies) on `tokens` [n, d_model] (default: the held-out tokens of its calibration)."""
    prep = _prepared(q)
    x = prep.eval if tokens is None else _tokens(tokens, q.spec.d_model, "evaluation")
    return accuracy_of(run_batched(prep.reference, x), run_batched(q, x), x.shape[0])


@api_boundary
def profile(model_or_spec: Any, tokens: torch.Tensor | str = "llm_like", *, n_tokens: int = 4096, seed: int = 0,
            bins: int | None = None):
    """The `observe.RangeTable` (every site's range and histogram, weight statistics) of a float FFN.

    `model_or_spec`: an `FFNSpec` (built with `seed`), an `ffnquant.FFN` or a real model's FFN layer;
    `tokens`: [n, d_model] tokens, or a source name from which `n_tokens` are drawn."""
    spec, model, _ = _model_of(model_or_spec, seed)
    if isinstance(tokens, str):
        x = parse_source(tokens, seed=seed).tokens(n_tokens, spec.d_model)
    else:
        x = _tokens(tokens, spec.d_model, "profile")
    batches = [x[i : i + 1024] for i in range(0, x.shape[0], 1024)]
    return observe_profile(model, batches, bins=DEFAULT_BINS if bins is None else bins)


@api_boundary
def run(config: Any, **kwargs: Any):
    """The whole job of `ffnquant run` on a `pipeline.RunConfig` (or a dict of its fields): profile, quantize,
    export, benchmark and report. Returns the pipeline's `RunResult`."""
    from .pipeline import run as _run

    if isinstance(config, dict):
        config = RunConfig(**config)
    return _run(config, **kwargs)
