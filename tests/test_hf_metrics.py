"""hf.metrics: the kept reference, the agreement figures (KL, top-1, the perplexity change's interval)."""

import math

import pytest
import torch

from ffnquant.hf import metrics
from ffnquant.hf.metrics import (Agreement, _NLL, log_normalizer, ratio_interval, reference_batch, summed_nll,
                                 t_quantile)


def _logits(seed: int, shape=(4, 33, 200), scale=3.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _full_kl(ref: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    p = torch.log_softmax(ref[:, :-1].double(), -1)
    q = torch.log_softmax(cand[:, :-1].double(), -1)
    return (p.exp() * (p - q)).sum(-1)


@pytest.mark.parametrize("k", [200, 64, 8], ids=["all-tokens", "top64", "top8"])
def test_kl_over_the_top_k_and_a_rest_bucket_bounds_the_full_kl(k):
    ref, ids = _logits(0), torch.randint(0, 200, (4, 33), generator=torch.Generator().manual_seed(1))
    cand = ref + 0.2 * _logits(2, scale=1.0)
    got = Agreement().update(reference_batch(ref, ids, k=k), cand, ids).figures()["kl"]
    full = _full_kl(ref, cand)
    if k == 200:  # every token kept: the full KL, to the float32 rounding of the kept log-probabilities
        assert got["mean"] == pytest.approx(float(full.mean()), rel=1e-4)
        assert got["max"] == pytest.approx(float(full.max()), rel=1e-4)
    else:  # merging outcomes never increases a KL divergence
        assert got["mean"] <= float(full.mean()) * (1 + 1e-6)
        assert got["mean"] > 0.5 * float(full.mean())


@pytest.mark.parametrize("shape", [(3, 7, 1000), (5, 300), (1000,)], ids=["batch", "rows", "one-row"])
def test_the_normalizer_taken_a_few_rows_at_a_time_is_the_whole_tensors(shape, monkeypatch):
    # chunks of 2 rows of 1000 logits (most rows share a chunk with another, one ends alone): each row's max, shift,
    # exp and sum are the same operations on the same row, so the same bits; against float64 arithmetic, the
    # float32 sum's relative rounding (~1e-7) on a value of order 10
    monkeypatch.setattr(metrics, "_NORMALIZER_CHUNK", 2000)
    x = _logits(5, shape=shape, scale=4.0)
    top = x.amax(dim=-1, keepdim=True)
    whole = top.squeeze(-1).double() + torch.log(torch.exp(x - top).sum(dim=-1).double())
    got = log_normalizer(x)
    assert got.shape == x.shape[:-1] and got.dtype == torch.float64
    assert torch.equal(got, whole)
    assert torch.allclose(got, torch.logsumexp(x.double(), -1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("shape", [(3, 7, 1000), (5, 300), (1000,)], ids=["batch", "rows", "one-row"])
def test_the_normalizer_and_argmax_in_one_pass_are_the_two_taken_apart(shape, monkeypatch):
    """`Agreement` reads each row's argmax from the normalizer's own max reduction: the same index as `argmax`, ties
    (planted) to the first, and the same normalizer bits as `log_normalizer`."""
    monkeypatch.setattr(metrics, "_NORMALIZER_CHUNK", 2000)
    x = _logits(6, shape=shape, scale=4.0)
    flat = x.reshape(-1, x.shape[-1])
    flat[0, 17] = flat[0, 200] = flat[0].max() + 1.0  # a tie: the first index wins
    norm, best = metrics.normalizer_and_argmax(x)
    assert torch.equal(best, x.argmax(-1)) and int(best.reshape(-1)[0]) == 17
    assert torch.equal(norm, log_normalizer(x))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-6), (torch.bfloat16, 2.0 ** -8)],
                         ids=["float32", "bfloat16"])
def test_the_summed_nll_and_its_written_out_gradient_are_float64_autograds(dtype, atol, monkeypatch):
    # the gradient is a probability minus 0 or 1: float32 rounding of a value below 1, or bf16's 2^-8 step
    monkeypatch.setattr(metrics, "_NORMALIZER_CHUNK", 1500)  # chunks of 3 rows of 500
    x = _logits(6, shape=(3, 9, 500)).to(dtype).requires_grad_(True)
    ids = torch.randint(0, 500, (3, 9), generator=torch.Generator().manual_seed(7))
    got = summed_nll(x, ids)
    (grad,) = torch.autograd.grad(got, [x])
    ref = x.detach().double().requires_grad_(True)
    want = -torch.log_softmax(ref[:, :-1], -1).gather(-1, ids[:, 1:, None]).sum()
    (want_grad,) = torch.autograd.grad(want, [ref])
    assert got.dtype == torch.float64 and float(got.detach()) == pytest.approx(float(want.detach()), rel=1e-6)
    assert grad.dtype == dtype and torch.allclose(grad.double(), want_grad, rtol=0, atol=atol)
    assert not grad[:, -1].any()  # a sequence's last position predicts nothing


def test_identical_models_agree_exactly():
    ref, ids = _logits(3), torch.randint(0, 200, (4, 33), generator=torch.Generator().manual_seed(4))
    fig = Agreement().update(reference_batch(ref, ids), ref.clone(), ids).figures()
    assert fig["kl"]["max"] == pytest.approx(0.0, abs=1e-6)
    assert fig["top1_agreement"] == 1.0
    assert fig["perplexity_ratio_paired"] == pytest.approx(1.0, abs=1e-9)
    lo, hi = fig["perplexity_ratio_ci"]
    assert lo == pytest.approx(1.0, abs=1e-9) and hi == pytest.approx(1.0, abs=1e-9)


def test_paired_ratio_equals_the_perplexity_ratio_and_its_interval_covers_it():
    ref, ids = _logits(5, (8, 65, 100)), torch.randint(0, 100, (8, 65), generator=torch.Generator().manual_seed(6))
    cand = ref + 0.5 * _logits(7, (8, 65, 100), scale=1.0)
    a, n_ref, n_cand = Agreement(), _NLL(), _NLL()
    for lo in range(0, 8, 4):  # two batches: the accumulators stream
        a.update(reference_batch(ref[lo:lo + 4], ids[lo:lo + 4]), cand[lo:lo + 4], ids[lo:lo + 4])
        n_ref.update(ref[lo:lo + 4], ids[lo:lo + 4])
        n_cand.update(cand[lo:lo + 4], ids[lo:lo + 4])
    fig = a.figures()
    assert fig["perplexity_ratio_paired"] == pytest.approx(n_cand.perplexity / n_ref.perplexity, rel=1e-9)
    lo, hi = fig["perplexity_ratio_ci"]
    assert lo < fig["perplexity_ratio_paired"] < hi
    assert fig["n_sequences"] == 8 and fig["n_predicted"] == 8 * 64


def test_ratio_interval_is_the_ratio_estimators():
    # hand-derived: units (num, den) = (1, 1), (3, 1): r = 2, residuals -1, +1, se = sqrt(2 * 2) / 2 = 1
    r, lo, hi = ratio_interval([1.0, 3.0], [1.0, 1.0])
    assert r == 2.0
    assert (lo, hi) == pytest.approx((2.0 - 12.706, 2.0 + 12.706))
    assert ratio_interval([1.0], [1.0]) is None


@pytest.mark.parametrize("df, value", [(1, 12.706), (10, 2.228), (30, 2.042), (60, 2.000), (120, 1.980), (10_000, 1.960)],
                         ids=["df1", "df10", "df30", "df60", "df120", "large"])
def test_t_quantile_matches_the_table(df, value):
    assert t_quantile(df) == pytest.approx(value, abs=2e-3)
    assert math.isinf(t_quantile(0))
