"""bitsandbytes runtimes: LLM.int8 (`Linear8bitLt`) and 4-bit NF4/FP4 (`Linear4bit`), on CPU or CUDA.

The FFN's `w_up`, `w_gate` and `w_down` are replaced by bitsandbytes modules built from
its float weights. What runs is labelled as what it is: LLM.int8 quantizes activations
row-wise per call and, with threshold 6.0, computes input columns holding any |x| > 6 in
fp16 (outlier decomposition); it is not calibrated W8A8. Its 4-bit formats are NF4/FP4
with an absmax per block of 64, not affine int4. `fp32`/`fp16` load the plain FFN, so
every bitsandbytes format has its float baseline on the same runtime.
"""

from __future__ import annotations

import copy

import torch

from ..errors import FFNQuantError, first_line
from ..schemes import PRESETS
from ..infra.thirdparty import quiet_bitsandbytes
from .base import Availability, Loaded, ModelCase
from .torch_rt import TorchModuleRuntime

__all__ = ["BnbRuntime", "LLM_INT8_THRESHOLDS", "BNB_4BIT_BLOCKSIZE", "bnb_linear"]

# The LLM.int8 presets' thresholds, from the scheme registry (llm-int8: 6.0, llm-int8-t0: 0.0).
LLM_INT8_THRESHOLDS = {name: s.outlier_threshold for name, s in PRESETS.items() if s.outlier_threshold is not None}
BNB_4BIT_BLOCKSIZE = 64
_FLOATS = {"fp32": torch.float32, "fp16": torch.float16}
_FORMATS = ("fp32", "fp16", "llm-int8", "llm-int8-t0", "nf4", "fp4")


def _import_bnb():
    """bitsandbytes, or FFNQuantError saying why it cannot be used."""
    quiet_bitsandbytes()
    try:
        import bitsandbytes  # noqa: F401  (optional dependency)
    except Exception as exc:  # ImportError, or a broken native library raising at import
        raise FFNQuantError(f"bitsandbytes not importable: {type(exc).__name__}: {exc}") from None
    return bitsandbytes


def bnb_linear(linear: torch.nn.Linear, scheme: str, device: str, compute_dtype: torch.dtype) -> torch.nn.Module:
    """The bitsandbytes replacement of one float `nn.Linear` in `scheme`, quantized on `device`."""
    bnb = _import_bnb()
    weight = linear.weight.detach().float().cpu().clone()
    bias = None if linear.bias is None else linear.bias.detach().to(compute_dtype).cpu().clone()
    if scheme in LLM_INT8_THRESHOLDS:
        module = bnb.nn.Linear8bitLt(
            linear.in_features,
            linear.out_features,
            bias=bias is not None,
            has_fp16_weights=False,
            threshold=LLM_INT8_THRESHOLDS[scheme],
        )
        # Int8Params quantizes row-wise when moved to the device.
        module.weight = bnb.nn.Int8Params(weight.to(compute_dtype), requires_grad=False, has_fp16_weights=False)
    elif scheme in ("nf4", "fp4"):
        module = bnb.nn.Linear4bit(
            linear.in_features,
            linear.out_features,
            bias=bias is not None,
            compute_dtype=compute_dtype,
            quant_type=scheme,
        )
        module.weight = bnb.nn.Params4bit(
            weight.to(compute_dtype), requires_grad=False, quant_type=scheme, blocksize=BNB_4BIT_BLOCKSIZE
        )
    else:
        raise FFNQuantError(f"bitsandbytes has no quantized module for {scheme!r}")
    if bias is not None:
        module.bias = torch.nn.Parameter(bias, requires_grad=False)
    return module.to(device)


def _nbytes(module: torch.nn.Module) -> int:
    """Stored bytes: parameters, buffers and bitsandbytes' quantization state (scales, absmax)."""
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        total += t.numel() * t.element_size()
        for attr in ("SCB",):  # LLM.int8's per-row scales
            extra = getattr(t, attr, None)
            if isinstance(extra, torch.Tensor):
                total += extra.numel() * extra.element_size()
        state = getattr(t, "quant_state", None)
        if state is not None:  # 4-bit: absmax per block (itself quantized with double quant)
            for value in vars(state).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
                nested = getattr(value, "absmax", None)
                if isinstance(nested, torch.Tensor):
                    total += nested.numel() * nested.element_size()
    return total


class BnbRuntime(TorchModuleRuntime):
    """bitsandbytes modules on `device` ('cpu' or 'cuda')."""

    prefix = "bnb"
    what = "bitsandbytes LLM.int8 (Linear8bitLt), NF4/FP4 (Linear4bit)"

    def __init__(self, device: str = "cpu") -> None:
        super().__init__(device)

    def _check_availability(self) -> Availability:
        try:
            bnb = _import_bnb()
        except FFNQuantError as exc:
            return Availability(False, str(exc), self.device)
        if self.device == "cuda" and not torch.cuda.is_available():
            return Availability(False, f"no CUDA device (bitsandbytes {bnb.__version__}, torch {torch.__version__})", "cuda")
        # A tiny 4-bit and int8 layer: bitsandbytes imports without its native library
        # for the device and fails only when a kernel is called.
        dtype = torch.float32 if self.device == "cpu" else torch.float16
        try:
            lin = torch.nn.Linear(64, 64)
            x = torch.randn(2, 64, device=self.device, dtype=dtype)
            with torch.inference_mode():
                for scheme in ("nf4", "llm-int8"):
                    y = bnb_linear(lin, scheme, self.device, dtype)(x)
                    if not torch.isfinite(y.float()).all():
                        raise RuntimeError(f"{scheme} probe returned non-finite values")
        except Exception as exc:  # any failure of the native kernels means "not usable here"
            first = first_line(exc)
            return Availability(False, f"bitsandbytes {bnb.__version__} kernels fail on {self.device}: {first}", self.device)
        where = torch.cuda.get_device_name(0) if self.device == "cuda" else "CPU"
        return Availability(True, f"bitsandbytes {bnb.__version__} on {where}", self.device)

    @property
    def formats(self) -> tuple[str, ...]:
        return _FORMATS

    def _compute_dtype(self, scheme: str) -> torch.dtype:
        if scheme in _FLOATS:
            return _FLOATS[scheme]
        if scheme in LLM_INT8_THRESHOLDS:
            return torch.float16  # LLM.int8 quantizes from fp16 (it casts anything else, warning per call)
        return torch.float32 if self.device == "cpu" else torch.float16

    def check(self, case: ModelCase) -> None:
        super().check(case)
        if case.scheme in ("nf4", "fp4"):
            for name, (out_f, in_f) in case.spec.weight_shapes.items():
                if (out_f * in_f) % BNB_4BIT_BLOCKSIZE:
                    raise FFNQuantError(f"{case.scheme}: {name} has {out_f * in_f} weights, not a multiple of 64")

    def load(self, case: ModelCase) -> Loaded:
        self.check(case)
        dtype = self._compute_dtype(case.scheme)
        model = copy.deepcopy(case.float_model()).float().cpu()
        with torch.no_grad():
            if case.scheme in _FLOATS:
                model = model.to(device=self.device, dtype=dtype)
                what = "plain torch nn.Linear (no bitsandbytes module)"
            else:
                bnb = _import_bnb()
                for name in case.spec.weight_names:
                    setattr(model, name, bnb_linear(getattr(model, name), case.scheme, self.device, dtype))
                model = model.to(self.device)
                what = f"bitsandbytes {bnb.__version__} " + _LABELS[case.scheme]
        dtype_name = str(dtype).replace("torch.", "")
        return Loaded(
            runtime=self.name,
            case=case,
            handle=model.eval(),
            device=self.device,
            label=f"{what}, {dtype_name} activations",
            weight_bytes=_nbytes(model),
            input_dtype=dtype_name,
            output_dtype=dtype_name,
        )


_LABELS = {
    "llm-int8": "Linear8bitLt threshold=6.0 (LLM.int8: row-wise dynamic int8, fp16 outlier columns)",
    "llm-int8-t0": "Linear8bitLt threshold=0.0 (row-wise dynamic int8, no outlier split)",
    "nf4": "Linear4bit nf4 (blocks of 64)",
    "fp4": "Linear4bit fp4 (blocks of 64)",
}
