"""infra.blas: a wide matmul on the faster BLAS, equal to torch's up to the rounding of the sums."""

from __future__ import annotations

import pytest
import torch

import ffnquant.infra.blas as blas

U = 2.0 ** -24  # float32's unit roundoff


def _bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two float32 sums of k products differ by at most 2 * k * u * sum |a_i b_i| (each within k * u of exact)."""
    k = a.shape[-1]
    return 2 * k * U * (a.abs() @ b.abs()) + 1e-30


@pytest.fixture
def numpy_path(monkeypatch):
    """Every product through numpy's BLAS, whatever the timing says."""
    monkeypatch.setattr(blas, "MIN_FLOPS", 0.0)
    monkeypatch.setattr(blas, "numpy_faster", lambda x, w: True)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("shape", [(7, 16), (2, 5, 16)], ids=["2d", "3d"])
def test_linear_is_torchs_up_to_rounding_forward_and_backward(numpy_path, shape, bias):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(33, 16, generator=gen, requires_grad=True)
    b = torch.randn(33, generator=gen, requires_grad=True) if bias else None
    x = torch.randn(*shape, generator=gen, requires_grad=True)
    g = torch.randn(*shape[:-1], 33, generator=gen)
    got = blas.linear(x, w, b)
    want = torch.nn.functional.linear(x, w, b)
    assert got.shape == want.shape
    assert ((got - want).abs() <= _bound(x.detach(), w.detach().T) + 1e-6).all()
    gx, gw, *gb = torch.autograd.grad((got * g).sum(), [x, w] + ([b] if bias else []))
    wx, ww, *wb = torch.autograd.grad((want * g).sum(), [x, w] + ([b] if bias else []))
    assert ((gx - wx).abs() <= _bound(g, w.detach())).all()
    assert torch.allclose(gw, ww, rtol=1e-5, atol=1e-5) and all(torch.allclose(p, q) for p, q in zip(gb, wb))


def test_small_or_non_float32_products_stay_in_torch(monkeypatch):
    called = []
    monkeypatch.setattr(blas, "numpy_faster", lambda x, w: called.append(1) or True)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    assert torch.equal(blas.linear(x, w), torch.nn.functional.linear(x, w))  # under MIN_FLOPS
    monkeypatch.setattr(blas, "MIN_FLOPS", 0.0)
    assert torch.equal(blas.linear(x.double(), w.double()), torch.nn.functional.linear(x.double(), w.double()))
    assert not called


def test_the_choice_is_timed_once_per_shape(monkeypatch):
    monkeypatch.setattr(blas, "_FASTER", {})
    x, w = torch.randn(8, 16), torch.randn(32, 16)
    first = blas.numpy_faster(x, w)
    assert list(blas._FASTER) == [(16, 32, torch.float32)]
    monkeypatch.setattr(blas, "_best_of", lambda fn, runs=2: pytest.fail("timed again"))
    assert blas.numpy_faster(x, w) is first


def test_fast_linear_routes_a_linear_while_active_and_leaves_others(numpy_path, monkeypatch):
    seen = []
    real = blas._NumpyLinear.apply
    monkeypatch.setattr(blas._NumpyLinear, "apply", lambda *a: seen.append(1) or real(*a))
    lin = torch.nn.Linear(16, 8)
    x = torch.randn(3, 16)
    with blas.fast_linear(lin):
        inside = lin(x)
    assert seen and "forward" not in vars(lin)  # restored
    assert torch.allclose(inside, lin(x), atol=1e-6)

    class Scaled(torch.nn.Linear):  # a subclass may compute otherwise: left alone
        def forward(self, x):
            return 2 * super().forward(x)

    sub = Scaled(16, 8)
    seen.clear()
    with blas.fast_linear(sub):
        assert torch.equal(sub(x), 2 * torch.nn.functional.linear(x, sub.weight, sub.bias))
    assert not seen


def test_bf16_products_switch_onednn_and_restore_it(monkeypatch):
    from ffnquant.infra import blas

    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    monkeypatch.setitem(blas._BF16, "cpu", True)
    with blas.bf16_products() as on:
        assert on and matmul.fp32_precision == "bf16"
    assert matmul.fp32_precision == before
    monkeypatch.setitem(blas._BF16, "cpu", False)  # a CPU without native bf16: float32 products, untouched
    with blas.bf16_products() as on:
        assert not on and matmul.fp32_precision == before


@pytest.mark.parametrize("numpy_side", [False, True], ids=["torch", "numpy"])
def test_linear_into_a_kept_buffer_is_linear(monkeypatch, numpy_side):
    """With `out`, the product is written into the buffer `out(shape)` gives (no fresh allocation to fault in), the
    same figures up to the sums' rounding; a product a gradient is taken through computes as without it."""
    monkeypatch.setattr(blas, "MIN_FLOPS", 0.0)
    monkeypatch.setattr(blas, "numpy_faster", lambda x, w: numpy_side)
    gen = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(2, 5, 16, generator=gen), torch.randn(33, 16, generator=gen), torch.randn(33, generator=gen)
    buffer = torch.full((400,), float("nan"))
    shapes = []

    def into(shape):
        shapes.append(shape)
        return buffer[: 2 * 5 * 33].view(shape)

    got = blas.linear(x, w, b, out=into)
    assert shapes == [(2, 5, 33)] and got.data_ptr() == buffer.data_ptr()
    want = torch.nn.functional.linear(x, w, b)
    assert bool(((got - want).abs() <= _bound(x, w.T) + 1e-6).all())
    w.requires_grad_(True)
    traced = blas.linear(x, w, b, out=into)
    assert shapes == [(2, 5, 33)] and traced.requires_grad  # not written into the buffer
