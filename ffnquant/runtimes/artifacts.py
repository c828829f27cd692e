"""ONNX artifacts for the onnxruntime adapters: which file a case runs, built once per run folder.

fp32/fp16 come from `ffnquant.onnx.export`; the int8 QDQ and 4-bit MatMulNBits models come
from `ffnquant.onnx.onnxquant` (the quantization stage), so latency is measured on the very
files the accuracy figures describe.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..backends import supports
from ..errors import FFNQuantError
from ..infra.atomic import process_scratch
from ..methods.fakequant import quantize_model
from ..onnx import onnxquant
from ..quantization import prepare
from ..recipe import Recipe
from ..schemes import get_scheme
from .base import ModelCase

__all__ = ["CALIBRATION_TOKENS", "artifact_path", "onnx_artifact", "onnx_weight_bytes"]

_FLOAT = ("fp32", "fp16")
CALIBRATION_TOKENS = 1024


def artifact_path(case: ModelCase, workdir: str | os.PathLike) -> Path:
    """`<workdir>/<spec.key>.s<seed>.<recipe slug>.onnx`."""
    return Path(workdir) / f"{case.spec.key}.s{case.seed}.{Recipe(case.scheme).slug}.onnx"


def onnx_artifact(case: ModelCase) -> Path:
    """The ONNX file for `case`: `case.onnx_path` if given, else built under `case.workdir` (reused if present)."""
    if case.onnx_path is not None:
        if not case.onnx_path.is_file():
            raise FFNQuantError(f"ONNX file {str(case.onnx_path)!r} does not exist")
        return case.onnx_path
    workdir = case.workdir if case.workdir is not None else process_scratch("onnx-artifacts")
    path = artifact_path(case, workdir)
    if path.is_file():
        return path
    model = case.float_model()
    if case.scheme in _FLOAT:
        from ..onnx.export import export_onnx

        export_onnx(model, path, dtype=case.scheme)
        return path
    return _quantized_artifact(case, model, path)


def _quantized_artifact(case: ModelCase, model, path: Path) -> Path:
    """int8 QDQ / MatMulNBits / MatMulBnb4 through `ffnquant.onnx.onnxquant`, from this run's fp32 export.

    Static int8 schemes are calibrated on `CALIBRATION_TOKENS` seeded Gaussian tokens:
    latency depends on the graph, not on the scale values, and the accuracy figures of
    record come from the quantization stage's own artifacts (pass them as `onnx_path`).
    """
    scheme = get_scheme(case.scheme)
    support = supports("onnx-artifact", scheme)
    kind, why = support.kind, support.note
    if kind is None:
        raise FFNQuantError(f"scheme {case.scheme!r} has no onnxruntime artifact: {why}")
    fp32_path = onnx_artifact(dataclasses.replace(case, scheme="fp32", onnx_path=None, workdir=path.parent))
    if scheme.static_activations and scheme.quantizes_activations:
        prep = gaussian_calibration(model, case.seed)
        qmodel = quantize_model(prep.model, scheme, prep.table)
        source = prep.model
    else:
        qmodel, source = quantize_model(model, scheme), model
    return onnxquant.write_artifact(fp32_path, path, qmodel, source)


def gaussian_calibration(model, seed: int):
    """The `quantization.Prepared` that static schemes of timed artifacts and of the bench's references are
    calibrated from: `CALIBRATION_TOKENS` seeded Gaussian tokens through `model`."""
    return prepare(model.spec, source="gaussian", calib_tokens=CALIBRATION_TOKENS, eval_tokens=64, seed=seed,
                   model=model)


def onnx_weight_bytes(path: str | os.PathLike) -> int:
    """Bytes of every initializer (weights, scales, zero points, biases) of an ONNX file."""
    import onnx
    from onnx import helper

    proto = onnx.load(str(path), load_external_data=False)
    total = 0
    for init in proto.graph.initializer:
        numel = 1
        for d in init.dims:
            numel *= int(d)
        if init.data_type in (onnx.TensorProto.UINT4, onnx.TensorProto.INT4):
            total += (numel + 1) // 2
        else:
            total += numel * helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    return total
