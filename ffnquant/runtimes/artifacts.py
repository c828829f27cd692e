"""ONNX artifacts for the onnxruntime adapters: which file a case runs, built once per run folder.

fp32/fp16 come from `ffnquant.export`; the int8 QDQ and 4-bit MatMulNBits models come
from `ffnquant.onnxquant` (the quantization stage), so latency is measured on the very
files the accuracy figures describe.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..errors import FFNQuantError
from .base import ModelCase

__all__ = ["artifact_path", "onnx_artifact", "onnx_weight_bytes"]

_FLOAT = ("fp32", "fp16")


def artifact_path(case: ModelCase, workdir: str | os.PathLike) -> Path:
    """`<workdir>/<spec.key>.s<seed>.<scheme>.onnx`."""
    return Path(workdir) / f"{case.spec.key}.s{case.seed}.{case.scheme}.onnx"


def onnx_artifact(case: ModelCase) -> Path:
    """The ONNX file for `case`: `case.onnx_path` if given, else built under `case.workdir` (reused if present)."""
    if case.onnx_path is not None:
        if not case.onnx_path.is_file():
            raise FFNQuantError(f"ONNX file {str(case.onnx_path)!r} does not exist")
        return case.onnx_path
    workdir = case.workdir if case.workdir is not None else Path(tempfile.mkdtemp(prefix="ffnquant_onnx_"))
    path = artifact_path(case, workdir)
    if path.is_file():
        return path
    model = case.float_model()
    if case.scheme in _FLOAT:
        from ..export import export_onnx

        export_onnx(model, path, dtype=case.scheme)
        return path
    return _quantized_artifact(case, model, path)


def _quantized_artifact(case: ModelCase, model, path: Path) -> Path:
    try:
        from .. import onnxquant
    except ImportError:
        raise FFNQuantError(
            f"scheme {case.scheme!r} on onnxruntime needs ffnquant.onnxquant to build its ONNX model; "
            "it is not in this checkout (pass ModelCase(onnx_path=...) to run a prebuilt file)"
        ) from None
    return onnxquant.build_for_runtime(model, case.scheme, path, seed=case.seed)


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
