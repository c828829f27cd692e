"""torch runtimes: eager float (fp32, fp16, bf16) and torch's own quantized kernels, on CPU or CUDA.

The quantized formats use kernels that ship inside torch, no extra package, each registered
under the preset whose numerics it computes (`ffnquant.schemes`):
- w8a8-dynamic-s8: per-token symmetric int8 activations (quantized per call), per-channel
  symmetric int8 weights, `torch._int_mm` (int32 accumulate), rescale in float (not
  `w8a8-dynamic`, whose activations are asymmetric uint8);
- w8a16: per-channel int8 weights, `torch._weight_int8pack_mm`;
- w4a16-g32/64/128-asym: the preset's asymmetric 4-bit codes, scales and integer zero points
  in tinygemm's layout, `torch.ops.aten._weight_int4pack_mm` (CUDA, bf16 activations) or its
  CPU twin (the symmetric `w4a16-g*` run on ffnquant's Triton kernel, `triton-cuda`);
- fp8-e4m3: per-tensor scaled e4m3 weights and activations, the activation scale of each
  matmul input calibrated once at load like the preset's static range (the reference's own
  Gaussian calibration, `runtimes.artifacts.gaussian_calibration`), `torch._scaled_mm`
  (CUDA compute capability >= 8.9, or torch's CPU implementation);
- fp8-e4m3-dynamic: e4m3 weights with a scale per output channel and activations with a
  scale per token, `torch._scaled_mm` with row-wise scales (bf16 output).
On CUDA each runtime also exists in a `graph` mode (every call replayed from a CUDA graph
captured per input shape) and a `compile` mode (torch.compile, then a CUDA graph).
Each kernel's availability is probed with a tiny call, because their signatures and
device coverage changed across torch 2.4 .. 2.14.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..errors import FFNQuantError, unknown_choice
from ..methods import QuantizedLinear, quantize_linear
from ..methods.fakequant import WEIGHT_INPUT_SITE, quantize_model
from ..numerics.primitives import FP8_E4M3_MAX, fp8_rowwise, fp8_tensorwise, int8_symmetric_rows
from ..schemes import get_scheme, int4_group_scheme
from .artifacts import gaussian_calibration
from .base import Availability, Loaded, ModelCase, Runtime, check_input

if TYPE_CHECKING:  # annotations only
    from ..quantization import Prepared

__all__ = [
    "TorchRuntime",
    "FP8_E4M3_MAX",
    "int8_symmetric_rows",
    "int4_groupwise_affine",
    "dequantize_int4_groupwise",
    "fp8_tensorwise",
    "fp8_rowwise",
    "unfused_ffn",
    "Int8DynamicLinear",
    "Int8WeightOnlyLinear",
    "Int4WeightOnlyLinear",
    "Fp8Linear",
    "Fp8RowwiseLinear",
    "CapturedCall",
    "MODES",
]

_INT4_GROUPS = {"w4a16-g32-asym": 32, "w4a16-g64-asym": 64, "w4a16-g128-asym": 128}
_FLOAT_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


# --- pure quantization math in the kernels' conventions -------------------------------
def int4_groupwise_affine(w, group_size: int):
    """The `w4a16-g*-asym` preset's 4-bit groups along the input dimension, in tinygemm's convention.

    Returns (q int32 in [0, 15] shaped like w, scales [n, k/g], zeros [n, k/g]) with
    w ~ (q - 8) * scale + zero: the preset's codes and scales (its method handler's)
    and zero = (8 - zp) * scale, so (q - 8) * scale + zero = (q - zp) * scale, the preset's value.
    """
    n, k = w.shape
    if k % group_size:
        raise FFNQuantError(f"4-bit groups of {group_size} need the input dimension divisible by it, got {k}")
    ql = quantize_linear(w.detach().float(), int4_group_scheme(group_size, symmetric=False))
    scale, zp = ql.grid.scale, (ql.grid.zero_point + 8).float()  # [n, k/g]; the unsigned zero points
    zeros = (8.0 - zp) * scale
    return ql.unsigned_codes().to(torch.int32), scale.reshape(n, -1), zeros.reshape(n, -1)


def dequantize_int4_groupwise(q, scales, zeros, group_size: int):
    """Inverse of `int4_groupwise_affine`: (q - 8) * scale + zero, float32 [n, k]."""
    n, k = q.shape
    qg = q.float().reshape(n, k // group_size, group_size)
    return ((qg - 8.0) * scales.unsqueeze(-1) + zeros.unsqueeze(-1)).reshape(n, k)


def _torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


# --- quantized linear modules (each replaces one nn.Linear of the FFN) ----------------
class _QuantLinear(torch.nn.Module):
    """Shared plumbing: flatten leading dims, add the bias, restore the shape."""

    def __init__(self, in_features: int, out_features: int, bias) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def _matmul(self, x2d):  # (tokens, in) -> (tokens, out)
        raise NotImplementedError

    def forward(self, x):
        lead = x.shape[:-1]
        y = self._matmul(x.reshape(-1, self.in_features))
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y.reshape(*lead, self.out_features)


def _linear_codes(linear, scheme: str) -> QuantizedLinear:
    """The weight of `linear` quantized by its preset's method handler: the codes and grid every kernel here stores."""
    return quantize_linear(linear.weight.detach().float().cpu(), get_scheme(scheme))


def _int8_rows(ql: QuantizedLinear) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes [out, in], float32 scale per output row) of a per-channel symmetric int8 QuantizedLinear."""
    return ql.codes.to(torch.int8), ql.grid.scale.reshape(-1).float()


class Int8DynamicLinear(_QuantLinear):
    """w8a8-dynamic-s8: per-token symmetric int8 activations quantized each call, `torch._int_mm`, float rescale."""

    def __init__(self, linear, min_rows: int = 0) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        wq, w_scale = _int8_rows(_linear_codes(linear, "w8a8-dynamic-s8"))
        # _int_mm wants mat2 as [in, out]; the transposed view of a row-major [out, in]
        # weight is the column-major layout cuBLAS's int8 GEMM takes without a copy.
        self.register_buffer("wq", wq)
        self.register_buffer("w_scale", w_scale)
        # cuBLAS int8 needs more than 16 rows: decode batches are padded up to min_rows.
        self.min_rows = int(min_rows)

    def _matmul(self, x2d):
        rows = x2d.shape[0]
        xq, x_scale = int8_symmetric_rows(x2d)
        if rows < self.min_rows:
            xq = torch.nn.functional.pad(xq, (0, 0, 0, self.min_rows - rows))
        acc = torch._int_mm(xq, self.wq.t())[:rows]  # int32 (tokens, out)
        y = acc.float() * x_scale.unsqueeze(-1) * self.w_scale.unsqueeze(0)
        return y.to(x2d.dtype)


class Int8WeightOnlyLinear(_QuantLinear):
    """w8a16: per-channel int8 weights, `torch._weight_int8pack_mm` with float activations."""

    def __init__(self, linear) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        wq, w_scale = _int8_rows(_linear_codes(linear, "w8a16"))
        self.register_buffer("wq", wq)
        self.register_buffer("w_scale", w_scale)

    def _matmul(self, x2d):
        return torch._weight_int8pack_mm(x2d, self.wq, self.w_scale.to(x2d.dtype))


def _pack_int4(q, device, inner_k_tiles: int):
    """Pack 4-bit values for the int4 mm kernel on `device`; returns (packed, mm op, CPU-twin flag).

    torch >= 2.6 has CPU twins taking the unpacked int32 [n, k]; the generic op takes
    uint8 [n, k/2] (two nibbles, high first) from torch 2.5 and int32 [n, k] before.
    The version picks the first try; the other layout is tried if the kernel rejects it.
    """
    aten = torch.ops.aten
    if device.type == "cpu" and hasattr(aten, "_convert_weight_to_int4pack_for_cpu"):
        return aten._convert_weight_to_int4pack_for_cpu(q.to(device), inner_k_tiles), aten._weight_int4pack_mm_for_cpu
    as_uint8 = (q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8)
    layouts = [as_uint8, q] if _torch_version() >= (2, 5) else [q, as_uint8]
    errors = []
    for layout in layouts:
        try:
            return aten._convert_weight_to_int4pack(layout.to(device), inner_k_tiles), aten._weight_int4pack_mm
        except RuntimeError as exc:
            errors.append(str(exc).splitlines()[0])
    raise FFNQuantError(f"torch {torch.__version__} cannot pack int4 weights on {device}: {'; '.join(errors)}")


class Int4WeightOnlyLinear(_QuantLinear):
    """w4a16-g*-asym: the preset's asymmetric 4-bit groups, tinygemm's `_weight_int4pack_mm` (bf16 activations on CUDA)."""

    def __init__(self, linear, group_size: int, device, act_dtype) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        q, scales, zeros = int4_groupwise_affine(linear.weight, group_size)
        k = linear.in_features
        inner = next((t for t in (8, 4, 2) if k % (t * 16) == 0), 2)
        packed, self._mm = _pack_int4(q, device, inner)
        self.group_size = group_size
        self.act_dtype = act_dtype
        self.register_buffer("packed", packed)
        # [k/g, n, 2]: scale and zero per (group, output channel), in the activation dtype.
        sz = torch.stack([scales, zeros], dim=-1).transpose(0, 1).contiguous()
        self.register_buffer("scales_and_zeros", sz.to(device=device, dtype=act_dtype))

    def _matmul(self, x2d):
        y = self._mm(x2d.to(self.act_dtype).contiguous(), self.packed, self.group_size, self.scales_and_zeros)
        return y.to(x2d.dtype)


class Fp8Linear(_QuantLinear):
    """fp8-e4m3: per-tensor scaled e4m3 weights, activations with a static (calibrated) scale, `torch._scaled_mm`."""

    def __init__(self, linear, act_scale: float) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        ql = _linear_codes(linear, "fp8-e4m3")
        wq, w_scale = ql.codes, ql.grid.scale.float()
        self.register_buffer("wq", wq)  # [out, in] row-major; .t() is the column-major mat2
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("x_scale", torch.tensor(float(act_scale), dtype=torch.float32))

    def _matmul(self, x2d):
        # the preset's static fake quantization: saturate at +-448 steps of the calibrated scale
        xq = (x2d.float() / self.x_scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        y = torch._scaled_mm(xq, self.wq.t(), scale_a=self.x_scale, scale_b=self.w_scale, out_dtype=x2d.dtype)
        return y[0] if isinstance(y, tuple) else y  # torch 2.4 returned (out, amax)


class Fp8RowwiseLinear(_QuantLinear):
    """fp8-e4m3-dynamic: e4m3 weights scaled per output channel, activations per token, `torch._scaled_mm` row-wise."""

    def __init__(self, linear) -> None:
        super().__init__(linear.in_features, linear.out_features, linear.bias)
        ql = _linear_codes(linear, "fp8-e4m3-dynamic")
        wq, w_scale = ql.codes, ql.grid.scale.float()
        self.register_buffer("wq", wq)
        self.register_buffer("w_scale", w_scale.reshape(1, -1).contiguous())  # [1, out], as scale_b wants

    def _matmul(self, x2d):
        rows = x2d.shape[0]
        xq, x_scale = fp8_rowwise(x2d)
        pad = (-rows) % 16  # cuBLASLt's fp8 GEMM wants every dimension a multiple of 16
        if pad:
            xq = torch.nn.functional.pad(xq.view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
            x_scale = torch.nn.functional.pad(x_scale, (0, 0, 0, pad), value=1.0)
        # row-wise scaling needs a bf16 output in torch's implementation
        y = torch._scaled_mm(xq, self.wq.t(), scale_a=x_scale, scale_b=self.w_scale, out_dtype=torch.bfloat16)
        y = y[0] if isinstance(y, tuple) else y
        return y[:rows].to(x2d.dtype)


# --- the runtime ------------------------------------------------------------------------
def _compute_dtype(scheme: str, device: str):
    """The activation dtype each format runs in on each device."""
    if scheme in _FLOAT_DTYPES:
        return getattr(torch, _FLOAT_DTYPES[scheme])
    if device == "cpu":
        return torch.float32  # comparable with the fp32 baseline on CPU
    if scheme.startswith("w4a16") or scheme.startswith("fp8-e4m3"):
        return torch.bfloat16  # tinygemm takes bf16 only; fp8 GEMMs commonly emit bf16
    return torch.float16


def _module_nbytes(module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


MODES = {
    "eager": "",
    "graph": "; replayed from a CUDA graph captured per input shape",
    "compile": "; torch.compile (inductor), replayed from a CUDA graph captured per input shape",
}


class CapturedCall:
    """One forward call of `module` on a static input, captured as a CUDA graph and replayed.

    Warm-up calls run on a side stream first (cuBLAS picks its algorithms and torch.compile
    compiles there, outside the capture), as torch's CUDA-graph notes prescribe. `replay()`
    returns the graph's static output tensor, overwritten by each replay.
    """

    def __init__(self, module, x, warmup: int = 3) -> None:
        self.x = x.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.inference_mode(), torch.cuda.stream(side):
            for _ in range(warmup):
                module(self.x)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.inference_mode(), torch.cuda.graph(self.graph):
            self.y = module(self.x)
        torch.cuda.synchronize()

    def replay(self):
        self.graph.replay()
        return self.y


class TorchModuleRuntime(Runtime):
    """Shared plumbing of runtimes whose loaded handle is a torch module on `self.device`
    (torch's own kernels, bitsandbytes): naming, input transfer, call, sync, peak memory."""

    prefix = ""  # runtime names are f"{prefix}-{device}"
    what = ""  # the description after "... on CPU:"

    def __init__(self, device: str = "cpu", mode: str = "eager") -> None:
        if device not in ("cpu", "cuda"):
            raise FFNQuantError(f"unknown {self.prefix} device {device!r}; valid: cpu, cuda")
        if mode not in MODES:
            raise FFNQuantError(f"unknown {self.prefix} mode {mode!r}; valid: {', '.join(MODES)}")
        if mode != "eager" and device != "cuda":
            raise FFNQuantError(f"{self.prefix} mode {mode!r} replays CUDA graphs: it needs device 'cuda'")
        self.device = device
        self.mode = mode
        self.name = f"{self.prefix}-{device}" + ("" if mode == "eager" else f"-{mode}")
        self.description = f"{self.prefix} on {device.upper()}: {self.what}" + MODES[mode]
        self.baseline = "fp32" if device == "cpu" else "fp16"
        self.timing = "cuda-events" if device == "cuda" else "wall"

    def _compile(self, module):
        """The module as run in compile mode (torch.compile, inductor's default mode, static shapes)."""
        return torch.compile(module, dynamic=False, fullgraph=True)

    def prepare(self, loaded: Loaded, x: np.ndarray) -> Any:
        """The input on the device; in graph/compile mode, a CUDA graph captured for its shape."""
        x = check_input(x, loaded.spec)
        t = torch.from_numpy(x).to(device=self.device, dtype=getattr(torch, loaded.input_dtype))
        if self.mode == "eager":
            return t
        return CapturedCall(loaded.handle, t)

    def run(self, loaded: Loaded, prepared: Prepared) -> Any:
        if isinstance(prepared, CapturedCall):
            return prepared.replay()
        with torch.inference_mode():
            return loaded.handle(prepared)

    def synchronize(self, loaded: Loaded) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()

    def to_numpy(self, loaded: Loaded, output: Any) -> np.ndarray:
        return output.detach().float().cpu().numpy()

    def reset_peak_memory(self) -> None:
        if self.device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated()) if self.device == "cuda" else None

    def release(self, loaded: Loaded) -> None:
        loaded.handle = None
        if self.device == "cuda":
            if self.mode == "compile":
                torch._dynamo.reset()  # drop the compiled code and its cached graphs with the model
            torch.cuda.empty_cache()


class TorchRuntime(TorchModuleRuntime):
    """Eager torch on `device` ('cpu' or 'cuda') with torch's float and quantized kernels."""

    prefix = "torch"
    what = "eager float and torch's built-in int8/int4/fp8 kernels"

    def __init__(self, device: str = "cpu", mode: str = "eager") -> None:
        super().__init__(device, mode)
        self._formats: tuple[str, ...] | None = None

    def _check_availability(self) -> Availability:
        if self.device == "cpu":
            return Availability(True, f"torch {torch.__version__} on CPU, {torch.get_num_threads()} threads", "cpu")
        if not torch.cuda.is_available():
            build = torch.version.cuda or "none (CPU-only build)"
            return Availability(False, f"no CUDA device: torch {torch.__version__}, CUDA build {build}", "cuda")
        name = torch.cuda.get_device_name(0)
        major, minor = torch.cuda.get_device_capability(0)
        return Availability(True, f"torch {torch.__version__} on {name} (sm_{major}{minor})", "cuda")

    # Formats are probed with tiny calls: kernels exist or not per torch version and device.
    def _probe(self, scheme: str) -> bool:
        from torch import nn

        dev = torch.device(self.device)
        dtype = _compute_dtype(scheme, self.device)
        lin = nn.Linear(128, 32, bias=False)
        x = torch.randn(2, 128)
        try:
            with torch.inference_mode():
                module = _quant_module(scheme, lin, dev, dtype, act_scale=1.0).to(dev)
                y = module(x.to(device=dev, dtype=dtype))
                if self.device == "cuda":
                    torch.cuda.synchronize()
            return bool(torch.isfinite(y.float()).all())
        except Exception:  # an absent or unsupported kernel raises many types; absence is the answer
            return False

    @property
    def formats(self) -> tuple[str, ...]:
        if self._formats is None:
            candidates = ["fp32", "fp16", "bf16", "w8a8-dynamic-s8", "w8a16", *_INT4_GROUPS, "fp8-e4m3",
                          "fp8-e4m3-dynamic"]
            if self.mode == "compile":
                # compile time is paid per model and input shape: the float formats and the
                # per-token dynamic ones, whose quantize steps inductor fuses
                candidates = ["fp16", "bf16", "w8a8-dynamic-s8", "fp8-e4m3-dynamic"]
            if not self.availability().available:
                self._formats = tuple(candidates)
            else:
                self._formats = tuple(s for s in candidates if s in _FLOAT_DTYPES or self._probe(s))
        return self._formats

    def check(self, case: ModelCase) -> None:
        super().check(case)
        spec, scheme = case.spec, case.scheme
        dims = (spec.d_model, spec.d_ff)
        if scheme in _INT4_GROUPS:
            g = _INT4_GROUPS[scheme]
            if any(k % g for k in dims):
                raise FFNQuantError(f"{scheme} needs d_model and d_ff divisible by {g}, got {spec.d_model} and {spec.d_ff}")
            if self.device == "cuda" and any(k % 32 for k in dims):
                raise FFNQuantError(f"{scheme} on CUDA (tinygemm) needs d_model and d_ff divisible by 32")
        if self.device == "cuda" and scheme == "w8a8-dynamic-s8" and any(k % 8 for k in dims):
            raise FFNQuantError(f"{scheme} on CUDA (cuBLAS int8) needs d_model and d_ff divisible by 8")
        if self.device == "cuda" and scheme.startswith("fp8-e4m3") and any(k % 16 for k in dims):
            raise FFNQuantError(f"{scheme} on CUDA (cuBLASLt fp8) needs d_model and d_ff divisible by 16")

    def load(self, case: ModelCase) -> Loaded:
        self.check(case)
        dev = torch.device(self.device)
        dtype = _compute_dtype(case.scheme, self.device)
        model = _copy_model(case.float_model())
        with torch.no_grad():
            if case.scheme in _FLOAT_DTYPES:
                model = model.to(device=dev, dtype=dtype)
                kernel = "eager matmul"
            else:
                scales = _static_act_scales(case) if case.scheme in _STATIC else {}
                for name in case.spec.weight_names:
                    linear = getattr(model, name)
                    setattr(model, name, _quant_module(case.scheme, linear, dev, dtype, scales.get(name)))
                model = model.to(dev)
                kernel = _KERNELS[case.scheme]
        model.eval()
        if self.mode == "compile":
            model = self._compile(model)
            kernel = f"torch.compile(inductor) of {kernel}"
        dtype_name = str(dtype).replace("torch.", "")
        label = f"torch {torch.__version__} {self.device}: {kernel}, {dtype_name} activations{MODES[self.mode]}"
        return Loaded(
            runtime=self.name,
            case=case,
            handle=model,
            device=self.device,
            label=label,
            weight_bytes=_module_nbytes(model),
            input_dtype=dtype_name,
            output_dtype=dtype_name,
        )


_KERNELS = {
    "w8a8-dynamic-s8": "torch._int_mm (per-token symmetric int8 x per-channel int8)",
    "w8a16": "torch._weight_int8pack_mm (per-channel int8 weights)",
    **{name: f"aten._weight_int4pack_mm (tinygemm int4, asymmetric group {g})" for name, g in _INT4_GROUPS.items()},
    "fp8-e4m3": "torch._scaled_mm (per-tensor scaled e4m3, calibrated static activation scales)",
    "fp8-e4m3-dynamic": "torch._scaled_mm (row-wise: e4m3 weights per channel, activations per token)",
}


# Formats with static activation scales, calibrated at load.
_STATIC = ("fp8-e4m3",)


def _static_act_scales(case: ModelCase) -> dict[str, float]:
    """Each projection's input scale under the case's static preset, calibrated as ffnquant's reference is
    (the same Gaussian calibration the ONNX artifacts and the bench's references use), by weight name."""
    prep = gaussian_calibration(case.float_model(), case.seed)
    ranges = quantize_model(prep.model, get_scheme(case.scheme), prep.table).ranges
    return {name: ranges[WEIGHT_INPUT_SITE[name]].scale for name in case.spec.weight_names}


def _quant_module(scheme: str, linear, device, act_dtype, act_scale: float | None = None):
    """The quantized replacement of one nn.Linear in `scheme` (weights quantized from fp32); `act_scale`
    is the static activation scale of the formats that take one."""
    linear = linear.float().cpu()
    if scheme == "w8a8-dynamic-s8":
        module = Int8DynamicLinear(linear, min_rows=17 if device.type == "cuda" else 0)
    elif scheme == "w8a16":
        module = Int8WeightOnlyLinear(linear)
        module.w_scale = module.w_scale.to(act_dtype)
    elif scheme in _INT4_GROUPS:
        module = Int4WeightOnlyLinear(linear, _INT4_GROUPS[scheme], device, act_dtype)
    elif scheme == "fp8-e4m3":
        if act_scale is None:
            raise FFNQuantError("fp8-e4m3 has static activation scales: a calibrated act_scale is required")
        module = Fp8Linear(linear, act_scale)
    elif scheme == "fp8-e4m3-dynamic":
        module = Fp8RowwiseLinear(linear)
    else:
        raise FFNQuantError(f"torch runtime has no quantized kernel for {scheme!r}")
    if module.bias is not None:
        module.bias = module.bias.to(act_dtype)
    return module.to(device)


def _copy_model(model):
    """A float32 CPU copy of an FFN, so loading never changes the caller's module."""
    import copy

    return copy.deepcopy(model).float().cpu()


_UNFUSED = {"int8": "w8a8-dynamic-s8", "fp8": "fp8-e4m3-dynamic"}


def unfused_ffn(model, kind: str, device="cpu", dtype: torch.dtype = torch.float32):
    """A copy of ffnquant's float FFN `model` with each Linear replaced as this runtime replaces it for per-token
    `kind` ("int8": w8a8-dynamic-s8, `Int8DynamicLinear`; "fp8": fp8-e4m3-dynamic, `Fp8RowwiseLinear`): the
    unfused path `kernels.actquant_ffn`'s fused modules reproduce."""
    if kind not in _UNFUSED:
        raise unknown_choice("activation quantization kind", kind, tuple(_UNFUSED))
    dev = torch.device(device)
    out = _copy_model(model)
    with torch.no_grad():
        for name in out.spec.weight_names:
            setattr(out, name, _quant_module(_UNFUSED[kind], getattr(out, name), dev, dtype))
    return out.to(dev).eval()
