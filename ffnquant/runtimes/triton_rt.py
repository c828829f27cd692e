"""triton runtime: ffnquant's own Triton W4A16 kernel (`ffnquant.kernels.w4a16_tiled`) on CUDA.

The kernel (weights repacked once at load into the tiled layout of `kernels.w4a16_repack`) fuses
the int4 dequantization into the matmul and implements ffnquant's `w4a16-g*` presets exactly
(symmetric groups, the extreme of each group on code 0) and the asymmetric `w4a16-g*-asym` presets
(an integer zero point per group: the kernel's ASYM form), so its accuracy rows and the quantization
stage's reference describe the same numerics (tinygemm on `torch-cuda` runs the asymmetric presets
too, its scales and float zeros in its activation dtype). Every call is replayed from a CUDA
graph (decode-size FFNs are a few microseconds per kernel: launch overhead would
otherwise dominate); `fp16` runs the plain torch FFN the same way, as the baseline. The older
kernel (`kernels.w4a16`) stays importable: `benchmarks/w4a16_kernels.py` compares against it.

`w8a8-dynamic-s8` and `fp8-e4m3-dynamic` run `kernels.actquant_ffn`: torch's int8 / fp8 GEMMs (gate and up as
one) with every per-token activation quantization fused into one Triton kernel (x's, and the hidden's together
with act(gate) * up), bit for bit the numerics of torch_rt's unfused modules of the same presets.
"""

from __future__ import annotations

import copy

import torch

from ..errors import FFNQuantError, first_line
from ..kernels.tritonenv import interpreting
from .base import Availability, Loaded, ModelCase
from .torch_rt import MODES, TorchModuleRuntime, _compute_dtype, _module_nbytes

__all__ = ["TritonRuntime"]

_GROUPS = {"w4a16-g32": 32, "w4a16-g64": 64, "w4a16-g128": 128,
           "w4a16-g32-asym": 32, "w4a16-g64-asym": 64, "w4a16-g128-asym": 128}  # the same kernel, zero points on
# per-token int8 / fp8: activations quantized by one fused kernel each (kernels.actquant), the act*up product and
# the hidden's quantization in one more; the GEMMs are torch's (_int_mm, _scaled_mm)
_FUSED = {"w8a8-dynamic-s8": ("int8", 8), "fp8-e4m3-dynamic": ("fp8", 16)}
_FORMATS = ("fp16", *_GROUPS, *_FUSED)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class GatedW4FFN(torch.nn.Module):
    """A gated FFN without biases on the Triton kernels: act(x Wg) * (x Wu) in ONE launch, then W_down.

    Reading both weights in one program saves a launch and the round trip of the two [M, d_ff]
    intermediates through memory; at one token that is a visible share of a decode FFN. Gate and up
    are repacked alike (same tiles), as the fused kernel requires.
    """

    def __init__(self, model, group_size: int, symmetric: bool = True) -> None:
        from ..kernels.w4a16_tiled import TiledW4A16Linear

        super().__init__()
        spec = model.spec
        self.spec = spec
        self.act = spec.activation.value
        self.w_gate = TiledW4A16Linear(model.w_gate, group_size=group_size, symmetric=symmetric)
        self.w_up = TiledW4A16Linear(model.w_up, group_size=group_size, symmetric=symmetric)
        self.w_down = TiledW4A16Linear(model.w_down, group_size=group_size, symmetric=symmetric)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from ..kernels.w4a16_tiled import tiled_gated

        lead = x.shape[:-1]
        hidden = tiled_gated(x.reshape(-1, self.spec.d_model), self.w_gate.weight_tiled, self.w_up.weight_tiled,
                             self.act)
        return self.w_down(hidden).reshape(*lead, self.spec.d_model)


class TritonRuntime(TorchModuleRuntime):
    """ffnquant's Triton kernels (W4A16, fused int8/fp8 activation quantization) on `device`: 'cuda', or 'cpu'
    under TRITON_INTERPRET=1 (tests)."""

    prefix = "triton"
    what = ("ffnquant's Triton kernels: W4A16 (fused int4 dequantize + matmul, exact w4a16-g* and w4a16-g*-asym "
            "presets) and fused per-token "
            "int8 / fp8 activation quantization (w8a8-dynamic-s8, fp8-e4m3-dynamic)")

    def __init__(self, device: str = "cuda") -> None:
        # On CUDA every call is a graph replay; the interpreter (CPU) runs eagerly.
        super().__init__(device, "graph" if device == "cuda" else "eager")
        self.name = f"{self.prefix}-{device}"  # one mode per device: no suffix

    def _check_availability(self) -> Availability:
        try:
            from ..kernels.w4a16 import triton_status
        except ImportError as exc:  # a broken install of the package itself: say so, do not crash the sweep
            return Availability(False, f"ffnquant's Triton kernels cannot be imported: {exc}", self.device)
        ok, reason = triton_status()
        if not ok:
            return Availability(False, reason, self.device)
        if self.device == "cuda" and not torch.cuda.is_available():
            return Availability(False, f"no CUDA device: torch {torch.__version__}", "cuda")
        if self.device == "cpu" and not interpreting():
            return Availability(False, "Triton runs on CPU only in its interpreter (TRITON_INTERPRET=1)", "cpu")
        # A tiny call: a Triton install without a working compiler or driver fails only here.
        try:
            from ..kernels.w4a16_tiled import TiledW4A16Linear

            lin = torch.nn.Linear(128, 32, bias=False)
            layer = TiledW4A16Linear(lin, group_size=32).to(self.device)
            y = layer(torch.randn(2, 128, device=self.device, dtype=torch.float16))
            if self.device == "cuda":
                torch.cuda.synchronize()
            if not torch.isfinite(y.float()).all():
                raise RuntimeError("the probe returned non-finite values")
        except Exception as exc:  # any failure of the compiled kernel means "not usable here"
            first = first_line(exc)
            return Availability(False, f"Triton W4A16 kernel fails on {self.device}: {first}", self.device)
        import triton

        where = torch.cuda.get_device_name(0) if self.device == "cuda" else "CPU (Triton interpreter)"
        return Availability(True, f"triton {triton.__version__} on {where}", self.device)

    @property
    def formats(self) -> tuple[str, ...]:
        return _FORMATS

    def check(self, case: ModelCase) -> None:
        super().check(case)
        if case.scheme in _GROUPS:
            g = _GROUPS[case.scheme]
            spec = case.spec
            if spec.d_model % g or spec.d_ff % g:
                raise FFNQuantError(f"{case.scheme} needs d_model and d_ff divisible by {g}, "
                                    f"got {spec.d_model} and {spec.d_ff}")
        if case.scheme in _FUSED:
            kind, multiple = _FUSED[case.scheme]
            if case.spec.d_model % multiple or case.spec.d_ff % multiple:
                raise FFNQuantError(f"{case.scheme} ({kind} GEMMs) needs d_model and d_ff divisible by {multiple}, "
                                    f"got {case.spec.d_model} and {case.spec.d_ff}")

    def load(self, case: ModelCase) -> Loaded:
        from ..kernels.w4a16_tiled import TiledW4A16Linear

        self.check(case)
        model = copy.deepcopy(case.float_model()).float().cpu()
        dtype = torch.float16
        with torch.no_grad():
            if case.scheme in _FUSED:
                from ..kernels.actquant_ffn import fused_ffn

                kind = _FUSED[case.scheme][0]
                dtype = _compute_dtype(case.scheme, self.device)  # as torch's unfused path of the preset computes
                model = fused_ffn(model, kind, device=self.device)
                kernel = (f"ffnquant fused per-token {kind} (one kernel quantizes x, one act*up and the hidden's "
                          f"quantization{', one the int8 rescale' if kind == 'int8' else ''}; torch's "
                          f"{'_int_mm' if kind == 'int8' else '_scaled_mm row-wise'} GEMMs, gate and up as one)")
            elif case.scheme in _GROUPS:
                g = _GROUPS[case.scheme]
                sym = not case.scheme.endswith("-asym")
                if case.spec.gated and not case.spec.bias:
                    model = GatedW4FFN(model, g, sym)
                    fused = "; gate, up and activation fused in one kernel"
                else:
                    for name in case.spec.weight_names:
                        setattr(model, name, TiledW4A16Linear(getattr(model, name), group_size=g, symmetric=sym))
                    fused = ""
                kind = "symmetric int4" if sym else "asymmetric int4, uint8 zero points"
                kernel = f"ffnquant Triton W4A16, tiled layout ({kind}, group {g}, fp16 scales{fused})"
            else:
                kernel = "eager torch matmul"
            model = model.to(device=self.device, dtype=dtype)
        import triton

        return Loaded(
            runtime=self.name,
            case=case,
            handle=model.eval(),
            device=self.device,
            label=f"triton {triton.__version__} {self.device}: {kernel}, {_name(dtype)} activations{MODES[self.mode]}",
            weight_bytes=_module_nbytes(model),
            input_dtype=_name(dtype),
            output_dtype=_name(dtype),
        )
