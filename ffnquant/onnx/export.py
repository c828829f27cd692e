"""ONNX export of FFN modules, with metadata and a parity check against torch on onnxruntime's CPU provider."""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from .. import __version__
from ..errors import FFNQuantError
from ..infra.atomic import atomic_path, ensure_writable_dir
from ..model import FFN, build
from ..recipe import Recipe
from ..spec import FFNSpec

__all__ = [
    "DEFAULT_OPSET",
    "PARITY_SHAPES",
    "FP32_TOLERANCE",
    "fp16_tolerance",
    "ParityCheck",
    "ExportResult",
    "export_onnx",
    "onnx_proto",
    "check_parity",
    "export_spec",
    "onnx_path_for",
]

# Opset 20 is the first with a fused `Gelu` op; below it GELU becomes a Pow/Tanh chain.
DEFAULT_OPSET = 20
# (batch, seq) pairs the parity check runs: a single decode token, odd sizes, a prefill block.
PARITY_SHAPES: tuple[tuple[int, int], ...] = ((1, 1), (2, 7), (4, 64))
FP32_TOLERANCE = 1e-4


def fp16_tolerance(ref_absmax: float) -> float:
    """fp16 parity bound: 1e-2 of the output's absmax (at least 1e-2).

    fp16 keeps 11 significant bits (unit roundoff 2^-11 ~ 4.9e-4); weights, inputs and
    intermediates are each rounded and the d_ff-long sums add a few more roundings, so
    ~20 units of roundoff relative to the output's scale is the stated budget.
    """
    return 1e-2 * max(1.0, float(ref_absmax))


@dataclass(frozen=True)
class ParityCheck:
    """ONNX-vs-torch agreement of one exported model on random inputs of several shapes."""

    dtype: str
    shapes: tuple[tuple[int, int], ...]
    max_abs_error: float
    ref_absmax: float
    tolerance: float
    provider: str

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.tolerance

    def to_dict(self) -> dict:
        return {
            "dtype": self.dtype,
            "shapes": [list(s) for s in self.shapes],
            "max_abs_error": self.max_abs_error,
            "ref_absmax": self.ref_absmax,
            "tolerance": self.tolerance,
            "provider": self.provider,
            "passed": self.passed,
        }


@dataclass
class ExportResult:
    spec: FFNSpec
    paths: dict[str, Path] = field(default_factory=dict)
    parity: dict[str, ParityCheck] = field(default_factory=dict)
    exporter: str = ""

    def to_dict(self) -> dict:
        return {
            "spec": self.spec.to_dict(),
            "paths": {k: str(v) for k, v in self.paths.items()},
            "parity": {k: v.to_dict() for k, v in self.parity.items()},
            "exporter": self.exporter,
        }


def onnx_path_for(spec: FFNSpec, out_dir: str | os.PathLike, dtype: str) -> Path:
    """Where the export of `spec` at `dtype` ('fp32'/'fp16') goes: `<out_dir>/<spec.key>.<recipe slug>.onnx`."""
    return Path(out_dir) / f"{spec.key}.{Recipe(dtype).slug}.onnx"


# Per-node metadata the dynamo exporter writes that names this machine's files (each op's Python stack trace, with
# the paths of ffnquant's and torch's sources): an artifact carries no path of the machine that wrote it.
_MACHINE_METADATA = ("pkg.torch.onnx.stack_trace",)


def without_stack_traces(proto: Any) -> Any:
    """`proto` (a ModelProto, changed in place) without the exporter's per-node stack traces; returns it."""
    graphs = [proto.graph] + list(proto.functions)
    for graph in graphs:
        for node in graph.node:
            kept = [p for p in node.metadata_props if p.key not in _MACHINE_METADATA]
            if len(kept) != len(node.metadata_props):
                del node.metadata_props[:]
                node.metadata_props.extend(kept)
            for attr in node.attribute:  # control flow: subgraphs hold nodes too
                graphs += ([attr.g] if attr.HasField("g") else []) + list(attr.graphs)
    return proto


def _export_proto(model: torch.nn.Module, example: torch.Tensor, opset: int):
    """Export to an in-memory ModelProto; dynamo exporter where available, TorchScript otherwise."""
    import onnx

    quiet = contextlib.ExitStack()
    # The exporter logs a warning per missing torchvision op and prints progress lines;
    # neither says anything about this model.
    onnx_logger = logging.getLogger("torch.onnx")
    quiet.callback(onnx_logger.setLevel, onnx_logger.level)
    onnx_logger.setLevel(logging.ERROR)
    quiet.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    quiet.enter_context(contextlib.redirect_stdout(io.StringIO()))
    with quiet, torch.no_grad():
        try:
            batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq")
            program = torch.onnx.export(
                model,
                (example,),
                dynamo=True,
                opset_version=opset,
                dynamic_shapes={"x": {0: batch, 1: seq}},
                input_names=["input"],
                output_names=["output"],
                verbose=False,
            )
            return without_stack_traces(program.model_proto), "torch.onnx dynamo"
        except TypeError:
            # torch < 2.5 has no dynamo= keyword: fall back to the TorchScript exporter.
            buf = io.BytesIO()
            torch.onnx.export(
                model,
                (example,),
                buf,
                opset_version=opset,
                input_names=["input"],
                output_names=["output"],
                dynamic_axes={"input": {0: "batch", 1: "seq"}, "output": {0: "batch", 1: "seq"}},
            )
            return onnx.load_from_string(buf.getvalue()), "torch.onnx torchscript"


# Exported graphs by model structure (spec, remedy slots, dtype, opset): torch.onnx.export takes ~1.6 s per call
# while an FFN of the same structure differs only in its weights, so a real model's 30 layers export once and
# re-use the graph with their own weights put in (`_Template.fill`). Bounded: each entry holds one FFN's weights.
_TEMPLATES: "dict[tuple, _Template | None]" = {}
_MAX_TEMPLATES = 8


@dataclass
class _Template:
    """An exported graph and, per initializer that is one of the model's tensors, which one (and transposed?)."""

    proto: object  # onnx.ModelProto
    exporter: str
    sources: dict  # initializer name -> (state_dict key, transposed)

    @classmethod
    def build(cls, proto, exporter: str, state: dict) -> "_Template | None":
        """Map initializers to state tensors by value; None when any weight-sized initializer is not one of them
        (the exporter folded a weight into something else, so filling in new weights would leave it stale)."""
        from onnx import numpy_helper

        sources, used = {}, set()
        arrays = {k: v.detach().cpu().numpy() for k, v in state.items()}
        for init in proto.graph.initializer:
            value = numpy_helper.to_array(init)
            found = None
            for key, arr in arrays.items():
                for transposed, cand in ((False, arr), (True, arr.T if arr.ndim == 2 else None)):
                    if cand is not None and cand.shape == value.shape and cand.dtype == value.dtype \
                            and np.array_equal(cand, value):
                        if found is not None and found[0] != key:
                            return None  # two tensors with equal values: ambiguous, export every time
                        found = (key, transposed)
            if found is not None:
                sources[init.name] = found
                used.add(found[0])
            elif value.size > 1 and value.dtype.kind == "f":
                return None
        if used != set(arrays):  # a tensor the graph holds in some other form (folded): its copy would go stale
            return None
        return cls(proto, exporter, sources)

    def fill(self, state: dict):
        """A copy of the graph with `state`'s tensors in place of the template's."""
        import onnx
        from onnx import numpy_helper

        proto = onnx.ModelProto()
        proto.CopyFrom(self.proto)
        for init in proto.graph.initializer:
            if init.name in self.sources:
                key, transposed = self.sources[init.name]
                arr = state[key].detach().cpu().numpy()
                init.CopyFrom(numpy_helper.from_array(np.ascontiguousarray(arr.T if transposed else arr), init.name))
        return proto


def _structure_key(model: FFN, dtype: str, opset: int) -> tuple:
    """What the exported graph depends on besides the weights' values."""

    def slot(m: torch.nn.Module) -> tuple:
        return (type(m).__name__, tuple((k, tuple(v.shape)) for k, v in m.state_dict().items()), m.extra_repr())

    return (repr(model.spec), slot(model.input_transform), slot(model.hidden_transform), dtype, opset,
            tuple((k, tuple(v.shape)) for k, v in model.state_dict().items()))


def _export_cached(work: FFN, example: torch.Tensor, dtype: str, opset: int):
    key = _structure_key(work, dtype, opset)
    state = work.state_dict()
    template = _TEMPLATES.get(key)
    if template is not None:
        return template.fill(state), template.exporter
    proto, exporter = _export_proto(work, example, opset)
    if key not in _TEMPLATES:
        if len(_TEMPLATES) >= _MAX_TEMPLATES:
            _TEMPLATES.pop(next(iter(_TEMPLATES)))
        import onnx

        copy_ = onnx.ModelProto()
        copy_.CopyFrom(proto)
        _TEMPLATES[key] = _Template.build(copy_, exporter, state)
    return proto, exporter


def export_onnx(
    model: FFN,
    path: str | os.PathLike,
    dtype: str = "fp32",
    opset: int = DEFAULT_OPSET,
    extra_metadata: dict[str, str] | None = None,
) -> tuple[Path, str]:
    """Export `model` to `path` as fp32 or fp16 ONNX with dynamic (batch, seq) axes; returns (path, exporter)."""
    import onnx

    proto, exporter = onnx_proto(model, dtype, opset, extra_metadata)
    with atomic_path(path) as tmp:
        onnx.save_model(proto, str(tmp))
    return Path(path), exporter


def onnx_proto(model: FFN, dtype: str = "fp32", opset: int = DEFAULT_OPSET,
               extra_metadata: dict[str, str] | None = None) -> tuple[Any, str]:
    """`export_onnx`'s checked ModelProto and exporter name, in memory (a caller that hands the graph on as bytes)."""
    import onnx

    if dtype not in ("fp32", "fp16"):
        raise FFNQuantError(f"unknown export dtype {dtype!r}; valid: fp32, fp16")
    if opset < 17:
        raise FFNQuantError(f"opset must be >= 17, got {opset}")
    torch_dtype = torch.float32 if dtype == "fp32" else torch.float16
    spec = model.spec
    work = build(spec)  # a copy, so the caller's module keeps its dtype
    # remedies (ffnquant.numerics.remedies) put a channel scale / rotation in these slots: carry them over
    work.input_transform = copy.deepcopy(model.input_transform)
    work.hidden_transform = copy.deepcopy(model.hidden_transform)
    own = model.own_activation()
    if own is not None:  # the model's own activation module: exported as torch traces it, its tensors with it
        work.activation = own
    work = work.to(torch_dtype)
    work.load_state_dict({k: v.to(torch_dtype) for k, v in model.state_dict().items()})
    example = torch.randn(2, 3, spec.d_model, dtype=torch_dtype)
    proto, exporter = _export_cached(work.eval(), example, dtype, opset)
    meta = {
        "ffnquant_version": __version__,
        "variant": spec.variant.value,
        "d_model": str(spec.d_model),
        "d_ff": str(spec.d_ff),
        "bias": str(bool(spec.bias)).lower(),
        "dtype": dtype,
        "exporter": exporter,
    }
    meta.update(extra_metadata or {})
    del proto.metadata_props[:]
    onnx.helper.set_model_props(proto, meta)
    onnx.checker.check_model(proto, full_check=True)
    return proto, exporter


def check_parity(
    model: FFN,
    onnx_path: str | os.PathLike,
    dtype: str = "fp32",
    shapes: Sequence[tuple[int, int]] = PARITY_SHAPES,
    seed: int = 1234,
) -> ParityCheck:
    """Run the ONNX file on onnxruntime's CPU provider and compare with fp32 torch on random inputs."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    session = ort.InferenceSession(str(onnx_path), opts, providers=["CPUExecutionProvider"])
    provider = session.get_providers()[0]
    np_dtype = np.float32 if dtype == "fp32" else np.float16
    gen = torch.Generator().manual_seed(seed)
    worst, ref_max = 0.0, 0.0
    with torch.no_grad():
        for batch, seq in shapes:
            x = torch.randn(batch, seq, model.spec.d_model, generator=gen)
            if dtype == "fp16":
                x = x.half().float()  # both sides see the same fp16-representable input
            ref = model.float()(x).numpy()
            got = session.run(None, {"input": x.numpy().astype(np_dtype)})[0].astype(np.float32)
            if got.shape != ref.shape:
                raise FFNQuantError(f"{onnx_path}: output shape {got.shape} != torch {ref.shape}")
            worst = max(worst, float(np.max(np.abs(got - ref))))
            ref_max = max(ref_max, float(np.max(np.abs(ref))))
    tol = FP32_TOLERANCE if dtype == "fp32" else fp16_tolerance(ref_max)
    return ParityCheck(dtype, tuple(tuple(s) for s in shapes), worst, ref_max, tol, provider)


def export_spec(
    spec: FFNSpec,
    out_dir: str | os.PathLike = "export",
    dtypes: Sequence[str] = ("fp32", "fp16"),
    seed: int = 0,
    opset: int = DEFAULT_OPSET,
    model: FFN | None = None,
) -> ExportResult:
    """Build (or take) the FFN for `spec`, export it at each dtype and check parity; raise if parity fails."""
    ensure_writable_dir(out_dir)
    model = model if model is not None else build(spec, seed=seed)
    result = ExportResult(spec)
    for dtype in dtypes:
        path, exporter = export_onnx(model, onnx_path_for(spec, out_dir, dtype), dtype=dtype, opset=opset)
        result.paths[dtype] = path
        result.exporter = exporter
        check = check_parity(model, path, dtype=dtype)
        result.parity[dtype] = check
        if not check.passed:
            raise FFNQuantError(
                f"{path}: {dtype} parity failed, max abs error {check.max_abs_error:.3g} > {check.tolerance:.3g}"
            )
    return result
