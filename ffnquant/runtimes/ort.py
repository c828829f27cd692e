"""onnxruntime runtimes: the CPU, CUDA and TensorRT execution providers, loading ONNX files.

onnxruntime-gpu asked for CUDA or TensorRT without their libraries logs an error and
quietly runs on the CPU provider. These adapters never accept that: `availability()`
opens a tiny session and reads `session.get_providers()`, quoting onnxruntime's own
"failed to load library" line as the reason, and `load()` re-checks every real session.
On GPU the input and a preallocated output live on the device (I/O binding), so host
copies are outside the timed call.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

from ..backends import ARTIFACT_KINDS, artifact_kind
from ..errors import FFNQuantError
from ..infra.atomic import ScratchFolder, process_scratch
from ..onnx.ortcpu import int8_kernels, saturating, session_entries
from ..schemes import PRESETS, ActDType, Method
from .artifacts import onnx_artifact, onnx_weight_bytes
from .base import Availability, Loaded, ModelCase, Runtime, check_input

if TYPE_CHECKING:  # annotations only
    from ..quantization import Prepared

__all__ = ["OrtRuntime", "PROVIDERS", "ORT_FORMATS", "captured_native_output"]

PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider", "trt": "TensorrtExecutionProvider"}


def _ort_formats(provider: str) -> tuple[str, ...]:
    """The presets this provider runs: those the onnx-artifact backend writes (QDQ int8, MatMulNBits, MatMulBnb4,
    the float exports) by plain rounding (GPTQ, AWQ and HQQ choose other codes on the same grids, which
    `Runtime.serves` maps to these kernels), by artifact kind, symmetric before asymmetric. TensorRT takes
    explicit (QDQ) int8 only with symmetric int8 activations (S8S8), and no contrib ops."""
    rows = []
    for i, (name, scheme) in enumerate(PRESETS.items()):
        kind, _ = artifact_kind(scheme)
        if kind is None or scheme.method is not Method.RTN or scheme.no_reference_reason is not None:
            continue
        if provider == "trt" and not (kind in ("fp32", "fp16") or (kind == "qdq" and scheme.act_dtype is ActDType.INT8)):
            continue
        rows.append((ARTIFACT_KINDS.index(kind), not scheme.weight_symmetric, i, name))
    return tuple(name for *_, name in sorted(rows))


ORT_FORMATS = {provider: _ort_formats(provider) for provider in PROVIDERS}
_NP_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}


@contextlib.contextmanager
def captured_native_output() -> Iterator[list[str]]:
    """Capture what native code writes to fds 1 and 2 (onnxruntime logs there, not via Python).

    Yields a list that holds the captured lines once the block exits.
    """
    import sys

    lines: list[str] = []
    saved = []
    with tempfile.TemporaryFile(mode="w+b") as sink:
        for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
            with contextlib.suppress(Exception):
                stream.flush()
            saved.append((fd, os.dup(fd)))
            os.dup2(sink.fileno(), fd)
        try:
            yield lines
        finally:
            for fd, stream in ((1, sys.stdout), (2, sys.stderr)):
                with contextlib.suppress(Exception):
                    stream.flush()
            for fd, copy in saved:
                os.dup2(copy, fd)
                os.close(copy)
            sink.seek(0)
            lines.extend(sink.read().decode("utf-8", "replace").splitlines())


def _ort_package() -> str:
    """Which onnxruntime distribution is installed ('onnxruntime-gpu 1.31.1', 'onnxruntime 1.30.0')."""
    for dist in ("onnxruntime-gpu", "onnxruntime"):
        try:
            return f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "onnxruntime (unknown distribution)"


def _fallback_reason(provider: str, log: list[str]) -> str:
    """Why onnxruntime did not use `provider`, from its own log lines where it said so."""
    text = "\n".join(log)
    missing = re.findall(r"Failed to load library \S*?(libonnxruntime_providers_\w+)\.so with error: ([^\n\x1b]+)", text)
    details = "; ".join(f"{lib}: {err.strip()}" for lib, err in dict(missing).items())
    if not details:
        found = re.search(r"(Please install [^\n\x1b]+|Require [^\n\x1b]+)", text)
        details = found.group(1).strip() if found else "no reason logged"
    return f"onnxruntime fell back to CPU: {provider} could not be created ({details})"


def _probe_model() -> bytes:
    """A one-MatMul ONNX model in memory (IR 8: onnx's default IR is newer than onnxruntime reads)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.eye(16, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "availability_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def _optimized_op_counts(session_factory, path: Path) -> str:
    """Op types onnxruntime actually runs after its graph fusions (CPU provider), e.g. 'MatMulNBits x3'."""
    import onnx

    with ScratchFolder("ort-optimized") as tmp:
        out = Path(tmp) / "optimized.onnx"
        session_factory(str(out))
        proto = onnx.load(str(out), load_external_data=False)
    counts = collections.Counter(node.op_type for node in proto.graph.node)
    return ", ".join(f"{op} x{n}" for op, n in sorted(counts.items()))


class OrtRuntime(Runtime):
    """onnxruntime with one execution provider: 'cpu', 'cuda' or 'trt'."""

    loads_artifacts = True

    def __init__(self, provider: str = "cpu") -> None:
        if provider not in PROVIDERS:
            raise FFNQuantError(f"unknown onnxruntime provider {provider!r}; valid: {', '.join(PROVIDERS)}")
        self.provider_key = provider
        self.provider = PROVIDERS[provider]
        self.name = f"ort-{provider}"
        self.device = "cpu" if provider == "cpu" else "cuda"
        self.description = f"onnxruntime {self.provider}" + ("" if provider == "cpu" else " with I/O binding on the device")
        self.baseline = "fp32" if provider == "cpu" else "fp16"
        self.timing = "wall"  # run_with_iobinding returns after the device finished
        self._engine_cache: str | None = None

    # --- availability -------------------------------------------------------------------
    def _check_availability(self) -> Availability:
        try:
            import onnxruntime as ort
        except Exception as exc:  # ImportError or a broken native library
            return Availability(False, f"onnxruntime not importable: {type(exc).__name__}: {exc}", self.device)
        package = _ort_package()
        if self.provider_key == "cpu":
            return Availability(True, f"{package}, CPUExecutionProvider", "cpu")
        if self.provider not in ort.get_available_providers():
            return Availability(
                False,
                f"{package} has no {self.provider} (providers: {', '.join(ort.get_available_providers())}); "
                "onnxruntime-gpu with CUDA libraries is needed",
                self.device,
            )
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        try:
            with captured_native_output() as log:
                session = ort.InferenceSession(_probe_model(), opts, providers=self._providers("fp32", 16, None))
                used = session.get_providers()
        except Exception as exc:  # session creation itself failing is also "not usable"
            return Availability(False, f"{package}: {self.provider} session failed: {exc}", self.device)
        if used[0] != self.provider:
            return Availability(False, _fallback_reason(self.provider, log), self.device)
        return Availability(True, f"{package}, {self.provider} ({', '.join(used)})", self.device)

    @property
    def formats(self) -> tuple[str, ...]:
        return ORT_FORMATS[self.provider_key]

    def check(self, case: ModelCase) -> None:
        super().check(case)
        from ..schemes import check_scheme_fits, get_scheme

        # the artifacts are written by ffnquant's quantizer; MatMulNBits pads K to whole blocks
        # (K attribute = the real width, ceil(K / block_size) blocks), so any group size fits
        check_scheme_fits(get_scheme(case.scheme), case.spec)

    # --- sessions -----------------------------------------------------------------------
    def _providers(self, scheme: str, d_model: int, max_tokens: int | None) -> list:
        cuda = ("CUDAExecutionProvider", {"device_id": 0})
        if self.provider_key == "cpu":
            return ["CPUExecutionProvider"]
        if self.provider_key == "cuda":
            return [cuda, "CPUExecutionProvider"]
        if self._engine_cache is None:
            self._engine_cache = str(process_scratch("trt-engine-cache"))
        options: dict[str, Any] = {
            "device_id": 0,
            "trt_fp16_enable": scheme != "fp32",
            "trt_int8_enable": scheme == "w8a8-s8",  # explicit quantization from the QDQ nodes
            "trt_engine_cache_enable": True,
            "trt_engine_cache_path": self._engine_cache,
            "trt_timing_cache_enable": True,
            "trt_timing_cache_path": self._engine_cache,
        }
        if max_tokens is not None:
            # One profile over every token count the sweep uses; built once, then cached.
            options["trt_profile_min_shapes"] = f"input:1x1x{d_model}"
            options["trt_profile_opt_shapes"] = f"input:1x{max_tokens}x{d_model}"
            options["trt_profile_max_shapes"] = f"input:1x{max_tokens}x{d_model}"
        return [("TensorrtExecutionProvider", options), cuda, "CPUExecutionProvider"]

    def load(self, case: ModelCase) -> Loaded:
        import onnxruntime as ort

        self.check(case)
        avail = self.availability()
        if not avail.available:
            raise FFNQuantError(f"runtime {self.name} is unavailable: {avail.reason}")
        path = onnx_artifact(case)
        providers = self._providers(case.scheme, case.spec.d_model, case.max_tokens)

        def make_session(optimized_path: str | None = None):
            opts = ort.SessionOptions()
            opts.log_severity_level = 3
            opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
            # By default onnxruntime turns a weight-only DQ -> MatMul into MatMulNBits at
            # accuracy level 4, which quantizes the activations too: the timed kernel would not
            # compute what the accuracy figures (onnxquant.ort_session) measured. Same setting.
            opts.add_session_config_entry("session.qdq_matmulnbits_accuracy_level", "0")
            # int8 activations on an exact kernel where this CPU's default one saturates (ortcpu), as measured
            for key, value in (session_entries() if self.provider_key == "cpu" else {}).items():
                opts.add_session_config_entry(key, value)
            if optimized_path:
                opts.optimized_model_filepath = optimized_path
            return ort.InferenceSession(str(path), opts, providers=providers)

        with captured_native_output() as log:
            session = make_session()
        used = tuple(session.get_providers())
        if used[0] != self.provider:
            raise FFNQuantError(_fallback_reason(self.provider, log))
        in_type, out_type = session.get_inputs()[0].type, session.get_outputs()[0].type
        if in_type not in _NP_DTYPES or out_type not in _NP_DTYPES:
            raise FFNQuantError(f"{path}: unsupported input/output types {in_type} / {out_type}")
        ops = _optimized_op_counts(make_session, path) if self.provider_key == "cpu" else "graph compiled by the provider"
        in_dtype = np.dtype(_NP_DTYPES[in_type]).name
        out_dtype = np.dtype(_NP_DTYPES[out_type]).name
        extra: dict[str, Any] = {"onnx_path": str(path)}
        # a u8 artifact on an x86 CPU without VNNI runs a saturating kernel: say so beside its figures
        if self.provider_key == "cpu" and saturating(path):
            extra["int8_kernel"] = int8_kernels().describe()
        return Loaded(
            runtime=self.name,
            case=case,
            handle=session,
            device=self.device,
            label=f"{_ort_package()} {used[0]}: {ops}",
            weight_bytes=onnx_weight_bytes(path),
            input_dtype=in_dtype,
            output_dtype=out_dtype,
            file_bytes=os.path.getsize(path),
            providers=used,
            extra=extra,
        )

    # --- running ------------------------------------------------------------------------
    def prepare(self, loaded: Loaded, x: np.ndarray) -> Any:
        x = check_input(x, loaded.spec).astype(loaded.input_dtype)
        if x.ndim == 2:
            x = x[None]  # the exported graph takes (batch, seq, d)
        if self.provider_key == "cpu":
            return {loaded.handle.get_inputs()[0].name: x}
        import onnxruntime as ort

        session = loaded.handle
        x_dev = ort.OrtValue.ortvalue_from_numpy(x, "cuda", 0)
        y_dev = ort.OrtValue.ortvalue_from_shape_and_type(list(x.shape), np.dtype(loaded.output_dtype).type, "cuda", 0)
        binding = session.io_binding()
        binding.bind_ortvalue_input(session.get_inputs()[0].name, x_dev)
        binding.bind_ortvalue_output(session.get_outputs()[0].name, y_dev)
        return {"binding": binding, "input": x_dev, "output": y_dev}

    def run(self, loaded: Loaded, prepared: Prepared) -> Any:
        if self.provider_key == "cpu":
            return loaded.handle.run(None, prepared)[0]
        loaded.handle.run_with_iobinding(prepared["binding"])
        return prepared["output"]

    def synchronize(self, loaded: Loaded) -> None:
        """run_with_iobinding already waits for the device (onnxruntime's default run option)."""

    def to_numpy(self, loaded: Loaded, output: Any) -> np.ndarray:
        arr = output if isinstance(output, np.ndarray) else output.numpy()
        return arr.astype(np.float32)

    def release(self, loaded: Loaded) -> None:
        loaded.handle = None

    def __del__(self) -> None:
        if self._engine_cache:
            shutil.rmtree(self._engine_cache, ignore_errors=True)
