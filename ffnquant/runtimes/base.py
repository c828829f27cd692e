"""The runtime protocol: availability with a reason, supported formats, load, prepare, run.

A runtime is an adapter around one backend on one device (onnxruntime's CPU provider,
torch on CUDA, bitsandbytes on CPU, ...). Adapters import their backend lazily, so this
package imports on a machine without any optional package, and a runtime that is not
really there says so in `availability()` instead of quietly running somewhere else.
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from ..errors import FFNQuantError, unknown_choice
from ..schemes import PRESETS, ActDType, ActMode, Compute, Method, Scheme, WeightDType
from ..spec import FFNSpec

if TYPE_CHECKING:  # annotations only
    from ..quantization import Prepared
    from ..recipe import Recipe

__all__ = [
    "Compute",
    "Format",
    "FORMATS",
    "get_format",
    "parse_formats",
    "Availability",
    "ModelCase",
    "Loaded",
    "Runtime",
    "check_input",
    "tensor_nbytes",
    "RUNTIMES",
    "runtime_names",
    "get_runtime",
    "available_runtimes",
]


@dataclass(frozen=True)
class Format:
    """A scheme as the runtimes see it: what the weights are stored in and what the matmuls compute in.

    A view of one `ffnquant.schemes` preset (the one registry of scheme names), built by
    `Format.of`; `scheme` is that preset. A runtime lists a format only for a kernel that
    computes the preset's numerics.
    """

    name: str
    weight: str  # storage of the weight matrices
    activation: str  # what the matmul reads for activations
    compute: Compute
    description: str
    group_size: int | None = None
    scheme: Scheme | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, scheme: Scheme) -> "Format":
        """The runtime view of `scheme`."""
        return cls(scheme.name, _weight_storage(scheme), _activation_kind(scheme), scheme.compute,
                   scheme.description, scheme.group_size, scheme)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "scheme"}
        d["compute"] = self.compute.value
        return d


def _weight_storage(s: Scheme) -> str:
    return s.weight_dtype.value.replace("_", "-")


def _activation_kind(s: Scheme) -> str:
    ad = s.act_dtype
    if ad is ActDType.NONE:
        return "fp32" if s.weight_dtype is WeightDType.FP32 else "float"
    kind = ad.value.replace("_", "-") + (" dynamic" if s.act_mode is ActMode.DYNAMIC else "")
    return kind + (" + fp16 outliers" if s.outlier_threshold else "")


FORMATS: Mapping[str, Format] = {name: Format.of(s) for name, s in PRESETS.items()}


def get_format(name: str) -> Format:
    """The format called `name`; an unknown name raises an error listing the valid ones."""
    key = str(name).strip().lower()
    if key not in FORMATS:
        raise unknown_choice("scheme", name, FORMATS)
    return FORMATS[key]


def parse_formats(names: str | list[str] | None) -> list[str]:
    """Comma-separated or listed format names, validated and de-duplicated in order; None -> all."""
    if names is None:
        return list(FORMATS)
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    out: list[str] = []
    for n in names:
        fmt_name = get_format(n).name
        if fmt_name not in out:
            out.append(fmt_name)
    if not out:
        raise FFNQuantError("no schemes given")
    return out


@dataclass(frozen=True)
class Availability:
    """Whether a runtime can run here; `reason` says why not (or what it found), `device` where it runs."""

    available: bool
    reason: str
    device: str

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class ModelCase:
    """What to load: one FFN (spec and float weights) in one format.

    `model` carries the float weights (built from `seed` when absent); ONNX runtimes read
    `onnx_path` when given and otherwise build the artifact under `workdir`. `max_tokens`
    bounds the token counts the loaded model will see (TensorRT's shape profile).
    """

    spec: FFNSpec
    scheme: str
    seed: int = 0
    max_tokens: int = 2048
    model: Any = field(default=None, compare=False, repr=False)  # ffnquant.model.FFN
    onnx_path: Path | None = None
    workdir: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "scheme", get_format(self.scheme).name)
        if self.onnx_path is not None:
            object.__setattr__(self, "onnx_path", Path(self.onnx_path))
        if self.workdir is not None:
            object.__setattr__(self, "workdir", Path(self.workdir))
        if self.max_tokens <= 0:
            raise FFNQuantError(f"max_tokens must be positive, got {self.max_tokens}")

    @property
    def format(self) -> Format:
        return FORMATS[self.scheme]

    def float_model(self):
        """The float32 FFN this case quantizes (the given one, else built from the seed)."""
        from ..model import build

        return self.model if self.model is not None else build(self.spec, seed=self.seed)


@dataclass
class Loaded:
    """A model loaded by a runtime, ready to run; `handle` is the runtime's own object.

    `label` says what actually runs (kernel, providers), `weight_bytes` counts the stored
    weights, scales and biases in this format, `file_bytes` the artifact's size if any.
    """

    runtime: str
    case: ModelCase
    handle: Any
    device: str
    label: str
    weight_bytes: int
    input_dtype: str
    output_dtype: str
    file_bytes: int | None = None
    providers: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def spec(self) -> FFNSpec:
        return self.case.spec


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1, "float8_e4m3fn": 1}


def tensor_nbytes(dtype: str, numel: int) -> int:
    """Bytes of `numel` elements of a dtype named as numpy/torch name it ('float16', 'bfloat16', ...)."""
    return _DTYPE_BYTES[dtype] * int(numel)


def check_input(x: np.ndarray, spec: FFNSpec) -> np.ndarray:
    """Validate a host input for `spec`: (tokens, d) or (batch, tokens, d), finite float; returns it as float32."""
    if not isinstance(x, np.ndarray):
        raise FFNQuantError(f"input must be a numpy array, got {type(x).__name__}")
    if x.ndim not in (2, 3):
        raise FFNQuantError(f"input must be (tokens, d_model) or (batch, tokens, d_model), got shape {x.shape}")
    if x.shape[-1] != spec.d_model:
        raise FFNQuantError(f"input last dimension {x.shape[-1]} does not match the model's d_model {spec.d_model}")
    if 0 in x.shape:
        raise FFNQuantError(f"input has an empty dimension: shape {x.shape}")
    return np.ascontiguousarray(x, dtype=np.float32)


def _same_grid(scheme: Scheme, formats: Sequence[str]) -> str | None:
    """The format storing `scheme`'s grid by plain rounding: GPTQ, AWQ or HQQ choose other codes on the same grid
    (scales, zero points, group), which the same kernel runs; None when no format has that grid."""
    grid = lambda s: (s.weight_dtype, s.weight_granularity, s.group_size, s.weight_symmetric, s.act_dtype,  # noqa: E731
                      s.act_mode, s.act_symmetric)
    return next((f for f in formats if f in PRESETS and PRESETS[f].method is Method.RTN
                 and grid(PRESETS[f]) == grid(scheme)), None)


class Runtime(abc.ABC):
    """One backend on one device. Subclasses set `name`, `device`, `description`, `baseline`."""

    name: str = ""
    device: str = "cpu"
    description: str = ""
    # The float format every other format on this runtime is compared with.
    baseline: str = "fp32"
    # True when the runtime runs ffnquant's ONNX artifacts (`ModelCase.onnx_path`); the others quantize the
    # float FFN themselves, so a recipe's remedies (folded into its artifact) never reach them.
    loads_artifacts: bool = False

    def availability(self) -> Availability:
        """Whether this runtime really runs here, with the reason; probed once, then remembered."""
        cached = getattr(self, "_availability", None)
        if cached is None:
            cached = self._availability = self._check_availability()
        return cached

    @abc.abstractmethod
    def _check_availability(self) -> Availability:
        """Probe the backend (import it, open a tiny session, ...) and say whether it runs here and why."""

    @property
    @abc.abstractmethod
    def formats(self) -> tuple[str, ...]:
        """Format names this runtime can load (on this machine's backend version)."""

    def serves(self, recipe: Recipe) -> tuple[str | None, str]:
        """(the format whose kernel serves `recipe` here, a note) or (None, why this runtime cannot serve it): this
        runtime's answer in the backend registry (`ffnquant.backends.supports`), from the recipe alone.

        Remedies that fold into the weights or the preceding norm (smooth, AWQ, a calibrator) run the scheme's
        kernel; GPTQ, AWQ or HQQ weights run the kernel of the plain-rounding preset on the same grid."""
        if recipe.rotate:
            return None, f"+rotate needs an online Hadamard transform of the hidden, which {self.name} does not run"
        if recipe.keep_float:
            return None, (f"+float={recipe.keep_float} mixes a float projection with quantized ones; {self.name} "
                          "runs one format per FFN")
        fmt = recipe.scheme
        if recipe.is_float and self.device == "cuda":
            fmt = "bf16"  # a GPU serves the float model in bf16, not float32: the baseline a quantized kernel must beat
        method = None
        if fmt not in self.formats:
            fmt, method = _same_grid(recipe.resolve(), self.formats), str(recipe.resolve().method)
            if fmt is None:
                return None, f"{self.name} has no kernel for {recipe.scheme} (its formats: {', '.join(self.formats)})"
        folded = [part for part, on in (("smooth", recipe.smooth is not None), (f"@{recipe.calibrator}", recipe.calibrator),
                                        (method, method)) if on]
        note = f"timed as {fmt}" + (f" ({', '.join(folded)}: other stored values, the same kernel)" if folded else "")
        return fmt, note

    def check(self, case: ModelCase) -> None:
        """Raise FFNQuantError if `case` cannot run here (format, sizes) before any heavy work."""
        if case.scheme not in self.formats:
            raise FFNQuantError(
                f"runtime {self.name!r} does not support scheme {case.scheme!r}; it supports: {', '.join(self.formats)}"
            )

    @abc.abstractmethod
    def load(self, case: ModelCase) -> Loaded:
        """Build or read the model in `case.scheme` and put it on the device."""

    @abc.abstractmethod
    def prepare(self, loaded: Loaded, x: np.ndarray) -> Any:
        """Turn a host float32 input into what `run` takes (on the device, in the input dtype)."""

    @abc.abstractmethod
    def run(self, loaded: Loaded, prepared: Prepared) -> Any:
        """One forward call; may return before the device finishes (see `synchronize`)."""

    def synchronize(self, loaded: Loaded) -> None:
        """Wait for queued device work (no-op on CPU)."""

    @abc.abstractmethod
    def to_numpy(self, loaded: Loaded, output: Any) -> np.ndarray:
        """The output of `run` as a host float32 array."""

    def reset_peak_memory(self) -> None:
        """Start a fresh peak-memory window (no-op where the runtime cannot measure it)."""

    def peak_memory_bytes(self) -> int | None:
        """Peak device memory since `reset_peak_memory`, or None where it is not measurable."""
        return None

    def release(self, loaded: Loaded) -> None:
        """Drop the loaded model's device memory."""
        loaded.handle = None

    def __call__(self, loaded: Loaded, x: np.ndarray) -> np.ndarray:
        """Convenience: prepare, run, synchronize and return the output on the host."""
        out = self.run(loaded, self.prepare(loaded, x))
        self.synchronize(loaded)
        return self.to_numpy(loaded, out)

    def describe(self) -> dict[str, Any]:
        avail = self.availability()
        return {
            "name": self.name,
            "device": self.device,
            "description": self.description,
            "baseline": self.baseline,
            "formats": list(self.formats),
            "availability": avail.to_dict(),
        }


# The registry: runtime name -> (module, class, keyword arguments). Entries are resolved
# lazily so that naming a runtime never imports its backend until it is used.
RUNTIMES: Mapping[str, tuple[str, str, Mapping[str, Any]]] = {
    "ort-cpu": ("ffnquant.runtimes.ort", "OrtRuntime", {"provider": "cpu"}),
    "ort-cuda": ("ffnquant.runtimes.ort", "OrtRuntime", {"provider": "cuda"}),
    "ort-trt": ("ffnquant.runtimes.ort", "OrtRuntime", {"provider": "trt"}),
    "torch-cpu": ("ffnquant.runtimes.torch_rt", "TorchRuntime", {"device": "cpu"}),
    "torch-cuda": ("ffnquant.runtimes.torch_rt", "TorchRuntime", {"device": "cuda"}),
    # The same kernels replayed from a CUDA graph per input shape: at decode sizes an FFN is a
    # few tens of microseconds, so launch overhead is a large share of the eager figure.
    "torch-cuda-graph": ("ffnquant.runtimes.torch_rt", "TorchRuntime", {"device": "cuda", "mode": "graph"}),
    # torch.compile (inductor fuses the activation, the quantize-per-token steps and the
    # epilogues), then replayed from a CUDA graph like torch-cuda-graph.
    "torch-cuda-compile": ("ffnquant.runtimes.torch_rt", "TorchRuntime", {"device": "cuda", "mode": "compile"}),
    # ffnquant's own Triton kernels (W4A16 on the tiled layout, fused int8/fp8 activation quantization),
    # replayed from a CUDA graph.
    "triton-cuda": ("ffnquant.runtimes.triton_rt", "TritonRuntime", {"device": "cuda"}),
    # The same kernels in Triton's interpreter (TRITON_INTERPRET=1): numerics checks on a CPU, not latency.
    "triton-cpu": ("ffnquant.runtimes.triton_rt", "TritonRuntime", {"device": "cpu"}),
    "bnb-cpu": ("ffnquant.runtimes.bnb", "BnbRuntime", {"device": "cpu"}),
    "bnb-cuda": ("ffnquant.runtimes.bnb", "BnbRuntime", {"device": "cuda"}),
}


def runtime_names() -> tuple[str, ...]:
    """Every registered runtime name."""
    return tuple(RUNTIMES)


def get_runtime(name: str) -> Runtime:
    """A fresh adapter for the runtime called `name`; an unknown name raises an error listing the valid ones."""
    import importlib

    key = str(name).strip().lower()
    if key not in RUNTIMES:
        raise unknown_choice("runtime", name, RUNTIMES)
    module_name, cls_name, kwargs = RUNTIMES[key]
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(**kwargs)


def available_runtimes() -> dict[str, Availability]:
    """Availability of every registered runtime, by name (probes each backend cheaply)."""
    return {name: get_runtime(name).availability() for name in RUNTIMES}
