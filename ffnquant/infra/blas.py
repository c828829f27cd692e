"""A wide float32 matmul (the LM head's) on the faster of the two BLAS libraries this process already has.

torch's CPU wheels compute float32 matmuls with MKL; numpy's wheels ship OpenBLAS. Which is faster depends on the CPU
and the shape. Measured on a 2-core AMD EPYC (AVX2), 512 rows: Gemma 3's head ([640] -> 262,144 logits) ran at 75
GFLOP/s in torch and 134 GFLOP/s in numpy; SmolLM2's ([576] -> 49,152) at 105 and 150; the FFN shapes within 20% either
way, and the head's backward product (summed over the vocabulary) within 8%, so that one stays in torch. At a 262k vocabulary the head is most of a model pass, so `linear` times both on the call's own operands the first
time it meets a shape (a few dozen rows, once per process and shape) and uses the faster one from then on.

The two differ only in rounding (the order of the sums): a computation that must reproduce transformers' own forward
bit for bit (the deployment proof's reference) does not use this; the plan's measurements, which compare figures of
its own engine with each other, do (`hf.stream.SequentialModel(fast_head=True)`).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any, Callable, Iterator

import numpy as np
import torch

__all__ = ["MIN_FLOPS", "linear", "numpy_faster", "fast_linear", "bf16_faster", "bf16_products"]

MIN_FLOPS = 4e9  # below this a product is not worth timing: the choice saves less than the timing costs
_PROBE_ROWS = 64  # the rows timed, of the call's own input
_MARGIN = 0.9  # numpy is chosen only when it takes under 90% of torch's time: the choice must beat timing noise
_FASTER: dict[tuple[int, int, torch.dtype], bool] = {}
_BF16_MARGIN = 0.6  # bf16 products are used only where they take under 60% of float32's time
_BF16: dict[str, bool] = {}


def _numpy_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [m, k] @ w[n, k].T in numpy's BLAS, as a torch tensor (no copy of either operand: w.T is a strided view)."""
    return torch.from_numpy(np.matmul(x.detach().numpy(), w.detach().numpy().T))


def _best_of(fn: Any, runs: int = 2) -> float:
    fn()  # warm-up: first calls allocate and start threads
    best = float("inf")
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def numpy_faster(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether numpy's BLAS computes `x @ weight.T` faster than torch's on this CPU, timed once per process for the
    shape (k, n) on up to `_PROBE_ROWS` rows of `x` itself."""
    key = (int(weight.shape[1]), int(weight.shape[0]), weight.dtype)
    if key not in _FASTER:
        rows = x[:_PROBE_ROWS].contiguous()
        with torch.no_grad():
            t_torch = _best_of(lambda: torch.nn.functional.linear(rows, weight))
            t_numpy = _best_of(lambda: _numpy_matmul(rows, weight))
        _FASTER[key] = t_numpy < _MARGIN * t_torch
    return _FASTER[key]


class _NumpyLinear(torch.autograd.Function):
    """`torch.nn.functional.linear` with its forward product in numpy's BLAS; the gradients in torch's."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).contiguous()
        ctx.save_for_backward(flat, weight)
        ctx.shape, ctx.has_bias = x.shape, bias is not None
        out = _numpy_matmul(flat, weight)
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        flat, weight = ctx.saved_tensors
        g = grad.reshape(-1, weight.shape[0]).contiguous()
        # the input's gradient sums over the wide axis: torch's and numpy's BLAS were within 8% of each other there
        gx = (g @ weight.detach()).reshape(ctx.shape) if ctx.needs_input_grad[0] else None
        gw = g.T @ flat if ctx.needs_input_grad[1] else None
        gb = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def _eligible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == weight.dtype == torch.float32
            and x.dim() >= 1 and x.shape[-1] == weight.shape[1] and not weight.is_meta
            and 2.0 * x.numel() * weight.shape[0] >= MIN_FLOPS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           out: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> torch.Tensor:
    """`torch.nn.functional.linear(x, weight, bias)`, computed by numpy's BLAS where that is faster on this CPU for
    this shape (`numpy_faster`): float32 on the CPU, at least `MIN_FLOPS`; else by torch. Differentiable.

    `out(shape)`: a tensor the result is written into, where no gradient is taken (a buffer kept between calls: a
    262k vocabulary's logits of 2,048 tokens are 2 GB, whose pages a fresh allocation faults in each time, about 0.5 s
    of kernel time a call on a 2-core VM)."""
    grad = torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)
    if out is not None and not grad and x.dtype == weight.dtype and x.device == weight.device:
        flat = x.reshape(-1, x.shape[-1])
        result = out((*x.shape[:-1], weight.shape[0]))
        into = result.view(-1, weight.shape[0])
        if _eligible(x, weight) and numpy_faster(flat, weight):
            np.matmul(flat.detach().numpy(), weight.detach().numpy().T, out=into.numpy())
        else:
            torch.mm(flat, weight.t(), out=into)
        if bias is not None:
            into += bias
        return result
    if _eligible(x, weight) and numpy_faster(x.reshape(-1, x.shape[-1]), weight):
        return _NumpyLinear.apply(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)


def bf16_faster() -> bool:
    """Whether this CPU multiplies bf16 matrices natively (oneDNN on AMX or AVX512-BF16): a head-shaped bf16 product
    timed against float32's, once per process, in under `_BF16_MARGIN` of its time. Elsewhere bf16 is emulated, slower
    than float32. Measured on a 2-core Xeon with AMX, [512, 640] x [640, 262144]: 0.21 s in bf16, 0.70 s in float32."""
    if "cpu" not in _BF16:
        x, w = torch.randn(256, 640), torch.randn(16384, 640)
        with torch.no_grad():
            t32 = _best_of(lambda: torch.nn.functional.linear(x, w))
            xb, wb = x.bfloat16(), w.bfloat16()
            t16 = _best_of(lambda: torch.nn.functional.linear(xb, wb))
        _BF16["cpu"] = t16 < _BF16_MARGIN * t32
    return _BF16["cpu"]


@contextlib.contextmanager
def bf16_products() -> Iterator[bool]:
    """While active, float32 matmuls on the CPU multiply in bf16 and sum in float32 (oneDNN's fpmath mode), where
    `bf16_faster`; yields whether it is on. For figures that only weigh others (the loss gradients a candidate's
    error is weighted by: relative errors near 2^-8), never for the figures a plan is verified on."""
    matmul = getattr(getattr(torch.backends, "mkldnn", None), "matmul", None)
    if matmul is None or not hasattr(matmul, "fp32_precision") or not bf16_faster():
        yield False
        return
    before = matmul.fp32_precision
    matmul.fp32_precision = "bf16"
    try:
        yield True
    finally:
        matmul.fp32_precision = before


@contextlib.contextmanager
def fast_linear(module: Any, out: Callable[[tuple[int, ...]], torch.Tensor] | None = None) -> Iterator[None]:
    """`module` (an `nn.Linear`, exactly: a subclass may compute otherwise) computing through `linear` while active
    (into `out(shape)` where given: see `linear`); anything else is left as it is."""
    if type(module) is not torch.nn.Linear:
        yield
        return
    module.forward = lambda x: linear(x, module.weight, module.bias, out)  # an instance attribute shadows the method
    try:
        yield
    finally:
        del module.forward
