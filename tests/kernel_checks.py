"""What the Triton kernel tests share: reproducible inputs, and the check of an output against its reference
within a bound derived from the float arithmetic (each test file derives its own bound)."""

from __future__ import annotations

import torch


def random_x(m: int, k: int, dtype: torch.dtype, seed: int = 1) -> torch.Tensor:
    """A reproducible [m, k] input in `dtype` (standard normal, rounded to the dtype)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=gen).to(dtype)


def assert_within(y: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor) -> None:
    """Every element of `y` finite and within `bound` of `ref`, elementwise."""
    err = (y.float() - ref.float()).abs()
    assert torch.isfinite(y.float()).all()
    worst = (err - bound).max().item()
    assert worst <= 0, f"max excess over the derived bound {worst:.3g} (max err {err.max().item():.3g})"
