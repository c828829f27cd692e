"""Quantized ONNX artifacts from the fp32 export, and onnxruntime's default quantizer as a baseline.

- int8 (`write_qdq`): QuantizeLinear/DequantizeLinear nodes written directly with onnx.helper
  around the three FFN matmuls, carrying OUR calibrated activation scales (the SiteRanges of
  the torch reference) and the reference's own int8 codes (`QuantizedFFN.linears`: nothing is
  quantized twice, the matmuls are found by name), so the artifact and the reference
  compute the same thing. Writing the QDQ nodes ourselves (rather than quantize_static with
  TensorQuantOverrides) also leaves every other op (the gate's Sigmoid/Mul, a remedy's
  channel scale or Hadamard rotation) in float, exactly as in the reference.
- 4-bit (`write_nbits`): MatMulNBits nodes from the quantized model's own codes, scales and zero
  points (RTN, GPTQ, HQQ's float zero points, AWQ on its folded model's export, whose scales are a
  Mul before the matmuls); nf4/fp4 as MatMulBnb4 from bitsandbytes' own packed codes and block absmax
  (onnxruntime's bnb4 layout is bitsandbytes': the same bytes, checked by the artifact tests).
- baseline (`ort_default_static`): `quantize_static` with its defaults (QDQ, MinMax,
  U8 activations / S8 weights) plus per_channel=True, on the same fp32 model and tokens.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np
import torch

from ..backends import ARTIFACT_KINDS, artifact_kind  # the onnx-artifact backend's decision, re-exported
from ..errors import FFNQuantError
from ..infra.atomic import ScratchFolder, atomic_path
from ..measure.timing import time_calls
from ..model import FFN
from .export import export_onnx
from .onnxmatmul import MS_DOMAIN, MatmulRewriter, bnb4_node, check_and_save, matmul_kind, nbits_node, write_matmul
from .ortcpu import exact_session_options, session_entries

if TYPE_CHECKING:  # annotations only: onnxquant reads a QuantizedFFN, it never builds one
    from ..methods.fakequant import QuantizedFFN

__all__ = [
    "ARTIFACT_KINDS",
    "artifact_kind",
    "matmul_weights",
    "write_qdq",
    "write_nbits",
    "write_artifact",
    "ort_default_static",
    "ort_session",
    "run_onnx",
    "ort_latency_ms",
]





def _load(path: str | os.PathLike):
    import onnx

    return onnx.load(str(path))


def matmul_weights(proto, names: Sequence[str]) -> dict[str, tuple[Any, Any]]:
    """{weight name: (MatMul node, initializer)} of the FFN's matmuls `names` in an exported graph, found by name.

    torch's exporter renames initializers (val_2, ...) but records on every node the module it came from
    (`pkg.torch.onnx.name_scopes`, e.g. ['', 'w_up', 'linear']): the matmul of weight `w_up` is the MatMul whose
    scopes name `w_up`. Other matmuls (a remedy's rotation, scoped `hidden_transform`) are left alone.
    """
    import ast

    inits = {i.name: i for i in proto.graph.initializer}
    wanted = set(names)
    found: dict[str, tuple[Any, Any]] = {}
    for node in proto.graph.node:
        if node.op_type != "MatMul" or node.input[1] not in inits:
            continue
        meta = {p.key: p.value for p in node.metadata_props}
        try:
            scopes = ast.literal_eval(meta.get("pkg.torch.onnx.name_scopes", "[]"))
        except (ValueError, SyntaxError):
            scopes = []
        hits = [s for s in scopes if s in wanted and s not in found]
        if hits:
            found[hits[0]] = (node, inits[node.input[1]])
    missing = sorted(wanted - set(found))
    if missing:
        raise FFNQuantError(f"could not find the matmul(s) of {missing} in the exported graph: its MatMul nodes carry "
                            "no pkg.torch.onnx.name_scopes naming them (export with ffnquant.onnx.export.export_onnx)")
    for i, node in enumerate(proto.graph.node):
        if not node.name:
            node.name = f"node_{node.op_type}_{i}"
    return found


def write_qdq(fp32_path: str | os.PathLike, out_path: str | os.PathLike, qmodel: "QuantizedFFN",
              source_model: FFN | None = None) -> Path:
    """An int8 QDQ model: `qmodel`'s int8 codes and grids (its `QuantizedLinear`s) and its calibrated activation
    scales around each FFN matmul of the fp32 export `fp32_path` (of the float model `qmodel` was quantized from).

    Nothing is quantized here: the codes are the ones the torch reference decodes (w8a16: weights only).
    `source_model` is not read (kept for callers that pass it).
    """
    kind, why = artifact_kind(qmodel.scheme)
    if kind != "qdq":
        raise FFNQuantError(f"scheme {qmodel.scheme.name!r} has no QDQ artifact: {why}")
    return _write_from_codes(fp32_path, out_path, qmodel)


def _write_from_codes(fp32_path: str | os.PathLike, out_path: str | os.PathLike, qmodel: "QuantizedFFN") -> Path:
    """The FFN matmuls of the fp32 export rewritten from `qmodel`'s codes, grids and input ranges by the one writer
    of quantized matmuls (`onnxmatmul`, which the whole-model graph uses too); HQQ's float zero points as
    MatMulNBits' float zero points."""
    from onnx import helper

    scheme = qmodel.scheme
    proto = _load(fp32_path)
    found = matmul_weights(proto, qmodel.spec.weight_names)
    position = {id(n): i for i, n in enumerate(proto.graph.node)}
    rw = MatmulRewriter(proto.graph)
    kinds = []
    # in graph order: a shared input's quantizer goes before its first reader (w_gate or w_up)
    for name, (node, init) in sorted(found.items(), key=lambda item: position[id(item[1][0])]):
        ql = qmodel.linears[name] if name in qmodel.quantized_weights else None
        site = qmodel.input_site(name)
        mode = None
        if site in qmodel.quantized_sites and not scheme.act_dtype.is_float:
            mode = "static" if scheme.static_activations else "dynamic"
        rng = qmodel.ranges.get(site) if mode == "static" else None
        if ql is not None and str(ql.scheme.weight_dtype) in ("nf4", "fp4"):  # bitsandbytes' packed codes
            rw.removed.add(init.name)
            rw.replace[id(node)] = [bnb4_node(rw, node, name, ql)]
            kinds.append("bnb4")
            continue
        if ql is not None and ql.zero_float is not None:  # HQQ: codes 0..15 with float zero points
            group = ql.codes.shape[1] // ql.scale_float.shape[1]
            new, inits = nbits_node(node, name, ql.codes, ql.scale_float, ql.zero_float, group, ql.weight.shape[1])
            rw.removed.add(init.name)
            rw.replace[id(node)] = [new]
            rw.add(inits)
            kinds.append("nbits")
            continue
        grid = None if ql is None else ql.grid
        kind = matmul_kind(scheme, grid, mode, rng, f"{name} ({scheme.name})")
        write_matmul(rw, node, init, kind, scheme=scheme, grid=grid, codes=None if ql is None else ql.codes,
                     input_mode=mode, input_range=rng, prefix=name,
                     in_features=ql.weight.shape[1] if ql is not None else 0)
        kinds.append(kind)
    rw.finish()
    _relu_after_matmul_as_max(proto.graph)
    if {"nbits", "bnb4"} & set(kinds) and not any(o.domain == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    proto.ir_version = min(proto.ir_version, 10)  # onnx.helper writes an IR newer than onnxruntime reads; torch's exporters write 8-10
    helper.set_model_props(proto, {**{p.key: p.value for p in proto.metadata_props}, "ffnquant_scheme": scheme.name})
    return check_and_save(proto, out_path)


def _relu_after_matmul_as_max(graph) -> None:
    """Rewrite Relu(MatMul(..)) as Max(MatMul(..), 0), in place: the same function, bit for bit.

    onnxruntime's QDQ selector (1.31) leaves DQ -> MatMul -> Relu unfused when the Relu's output
    is not requantized (ReGLU's gate branch): that MatMul then runs in float on weights
    dequantized at every call, 2.4x slower than the whole int8 FFN otherwise (9.2 vs 3.8 ms,
    d=512, 256 tokens, one thread). With Max it fuses into MatMulIntegerToFloat like the others.
    """
    from onnx import numpy_helper

    producers = {out: n.op_type for n in graph.node for out in n.output}
    zero = None
    for node in graph.node:
        if node.op_type == "Relu" and producers.get(node.input[0]) == "MatMul":
            if zero is None:
                zero = "ffnquant_relu_zero"
                graph.initializer.append(numpy_helper.from_array(np.zeros((), np.float32), zero))
            node.op_type = "Max"
            node.input.append(zero)


def write_nbits(fp32_path: str | os.PathLike, out_path: str | os.PathLike, qmodel: "QuantizedFFN") -> Path:
    """A 4-bit weight-only model: MatMulNBits (int4: RTN, GPTQ, AWQ, HQQ) from `qmodel`'s own codes and grids, or
    MatMulBnb4 (nf4, fp4) for the FFN matmuls `qmodel` quantizes (the others stay float MatMuls, as a
    `+float=SITE` recipe has them). `fp32_path` is the export of the float model `qmodel` was quantized from."""
    scheme = qmodel.scheme
    kind, why = artifact_kind(scheme)
    if kind not in ("nbits", "bnb4"):
        raise FFNQuantError(f"scheme {scheme.name!r} has no 4-bit artifact: {why}")
    return _write_from_codes(fp32_path, out_path, qmodel)


def write_artifact(
    fp32_path: str | os.PathLike | None,
    out_path: str | os.PathLike,
    qmodel: "QuantizedFFN",
    source_model: FFN | None = None,
    hessians: Mapping[str, torch.Tensor] | None = None,
) -> Path:
    """The ONNX artifact of `qmodel` (QDQ int8 or 4-bit) written from its own codes; FFNQuantError says why a
    scheme has none. `fp32_path` is the fp32 export of the float model `qmodel` was quantized from (AWQ exports its
    folded model itself); `source_model` and `hessians` are not read (nothing is quantized again)."""
    kind, why = artifact_kind(qmodel.scheme)
    if kind == "qdq":
        return write_qdq(fp32_path, out_path, qmodel)
    if kind == "nbits" and any(getattr(r, "kind", None) == "awq" for r in qmodel.remedies):
        return _write_folded(out_path, qmodel)
    if kind in ("nbits", "bnb4"):
        return write_nbits(fp32_path, out_path, qmodel)
    raise FFNQuantError(f"scheme {qmodel.scheme.name!r}: {why}")


def _write_folded(out_path: str | os.PathLike, qmodel: "QuantizedFFN") -> Path:
    """The artifact of a method that folds the whole FFN first (AWQ: its input ChannelScale becomes a Mul before the
    matmuls): `qmodel`'s own folded model exported, then its matmuls replaced by its codes."""
    with ScratchFolder("folded") as tmp:
        fp32 = Path(tmp) / "folded.fp32.onnx"
        export_onnx(qmodel.model, fp32)
        return write_nbits(fp32, out_path, qmodel)


class _Reader:
    """onnxruntime CalibrationDataReader over token batches ([1, n, d], as the exported graph takes (batch, seq, d))."""

    def __init__(self, batches: Sequence[torch.Tensor]) -> None:
        self._batches = [b.reshape(1, -1, b.shape[-1]).numpy().astype(np.float32) for b in batches]
        self._i = 0

    def get_next(self):
        if self._i >= len(self._batches):
            return None
        self._i += 1
        return {"input": self._batches[self._i - 1]}

    def rewind(self) -> None:
        self._i = 0


def ort_default_static(fp32_path: str | os.PathLike, out_path: str | os.PathLike, calib_batches: Sequence[torch.Tensor],
                       calibrate: str = "minmax") -> Path:
    """onnxruntime's quantize_static with its defaults (QDQ, QUInt8 activations, QInt8 weights), per_channel=True,
    and its calibration method `calibrate` (minmax, its default; percentile, entropy: `ortbaseline`)."""
    import io

    from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                          quantize_static)

    class Reader(_Reader, CalibrationDataReader):
        pass

    method = {"minmax": CalibrationMethod.MinMax, "percentile": CalibrationMethod.Percentile,
              "entropy": CalibrationMethod.Entropy}[calibrate]
    # quantize_static logs a "consider pre-processing" warning on the root logger every call (advice for image
    # models, not a fact about this one) and the histogram calibrators print progress: a library prints nothing.
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    with contextlib.ExitStack() as stack:
        stack.callback(root.setLevel, level)
        stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
        tmp = stack.enter_context(atomic_path(out_path))
        quantize_static(str(fp32_path), str(tmp), Reader(calib_batches), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8, calibrate_method=method)
        import onnx

        onnx.checker.check_model(str(tmp), full_check=True)
    return Path(out_path)


def ort_session(path: str | os.PathLike, threads: int | None = None, exact_weight_only: bool = True,
                as_written: bool = False):
    """A CPU-provider InferenceSession; raises if onnxruntime silently picked another provider.

    With the default options onnxruntime fuses a weight-only DequantizeLinear -> MatMul into
    MatMulNBits with accuracy_level 4, which quantizes the ACTIVATIONS to int8 on the fly
    (measured: w8a16 swiglu 33.0 dB instead of 38.3 dB). `exact_weight_only` sets
    accuracy_level 0 so a w8a16 artifact computes what it says; QDQ w8a8 and the MatMulNBits
    artifacts written here are unaffected by this entry. The int8 entries of `ortcpu.session_entries`
    (measured on this CPU) keep int8 activations on an exact kernel where the default one saturates.
    `as_written` turns graph optimizations off: the graph's own value, with no integer kernel fused in.
    """
    import onnxruntime as ort

    opts = exact_session_options() if as_written else ort.SessionOptions()
    opts.log_severity_level = 3
    for key, value in session_entries().items():
        opts.add_session_config_entry(key, value)
    if exact_weight_only:
        opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
    if threads:
        opts.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    if session.get_providers()[0] != "CPUExecutionProvider":
        raise FFNQuantError(f"{path}: expected the CPU provider, got {session.get_providers()}")
    return session


def run_onnx(path_or_session: Any, tokens: torch.Tensor, batch_size: int = 4096, dtype: str = "fp32") -> torch.Tensor:
    """Run an ONNX FFN on [n, d] tokens (as [1, n, d] batches) on the CPU provider; float32 [n, d]."""
    session = ort_session(path_or_session) if isinstance(path_or_session, (str, os.PathLike)) else path_or_session
    np_dtype = np.float16 if dtype == "fp16" else np.float32
    outs = []
    for i in range(0, tokens.shape[0], batch_size):
        x = tokens[i : i + batch_size].reshape(1, -1, tokens.shape[-1]).numpy().astype(np_dtype)
        outs.append(torch.from_numpy(session.run(None, {"input": x})[0].astype(np.float32)).reshape(-1, tokens.shape[-1]))
    return torch.cat(outs)


def ort_latency_ms(
    path: str | os.PathLike, d_model: int, tokens: int = 256, repeats: int = 30, dtype: str = "fp32", warmup: int = 5,
    exact_weight_only: bool = True, threads: int | None = None,
) -> float:
    """Median wall time (ms) of one session.run on a [1, tokens, d_model] input, CPU provider."""
    session = ort_session(path, threads=threads, exact_weight_only=exact_weight_only)
    x = np.random.default_rng(0).standard_normal((1, tokens, d_model)).astype(np.float16 if dtype == "fp16" else np.float32)
    times = time_calls(lambda: session.run(None, {"input": x}), repeats, warmup=warmup)
    return float(np.median(times) * 1e3)
