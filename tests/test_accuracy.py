"""numerics.accuracy: the four error figures from one pass of float64 sums, against hand-derived values."""

import math

import numpy as np
import pytest
import torch

from ffnquant.errors import FFNQuantError
from ffnquant.numerics.accuracy import SQNR_CAP_DB, accuracy_of, cosine, max_abs_error, rel_l2, sqnr_db


def test_hand_derived_figures():
    ref = torch.tensor([[3.0, 4.0]])  # ||ref|| = 5
    got = torch.tensor([[3.0, 3.0]])  # error (0, 1): ||e|| = 1
    assert sqnr_db(ref, got) == pytest.approx(20 * math.log10(5.0))
    assert rel_l2(ref, got) == pytest.approx(0.2)
    assert max_abs_error(ref, got) == pytest.approx(1.0)
    assert cosine(ref, got) == pytest.approx(21.0 / (5.0 * math.sqrt(18.0)))
    acc = accuracy_of(ref, got)
    assert (acc.sqnr_db, acc.rel_l2, acc.max_abs_error, acc.n_tokens) == (
        pytest.approx(20 * math.log10(5.0)), pytest.approx(0.2), pytest.approx(1.0), 1)


def test_identical_and_zero_outputs_are_capped():
    x = torch.randn(4, 8)
    assert sqnr_db(x, x.clone()) == SQNR_CAP_DB
    assert sqnr_db(torch.zeros(3), torch.ones(3)) == -SQNR_CAP_DB
    assert cosine(torch.zeros(3), torch.zeros(3)) == 1.0


def test_an_all_zero_reference_has_no_relative_error_where_the_outputs_agree_and_writes_as_json():
    """An FFN whose output matrix is zero (xLSTM's initialisation): its outputs agree exactly (relative error 0), or
    differ with no relative scale (infinite, written as null so a report stays valid JSON)."""
    import json

    same = accuracy_of(torch.zeros(2, 4), torch.zeros(2, 4))
    assert same.rel_l2 == 0.0 and same.sqnr_db == SQNR_CAP_DB
    off = accuracy_of(torch.zeros(2, 4), torch.ones(2, 4))
    assert off.rel_l2 == math.inf and off.to_dict()["rel_l2"] is None
    json.dumps(off.to_dict(), allow_nan=False)


@pytest.mark.parametrize("chunk_crossing", [False, True], ids=["small", "a million values"])
def test_matches_a_float64_reference(chunk_crossing):
    gen = torch.Generator().manual_seed(0)
    n = (1 << 20) + 37 if chunk_crossing else 1000
    ref = torch.randn(n, generator=gen)
    got = ref + 0.01 * torch.randn(n, generator=gen)
    r, g = ref.double(), got.double()
    want = 20 * math.log10(float(r.norm() / (r - g).norm()))
    acc = accuracy_of(ref, got)
    assert acc.sqnr_db == pytest.approx(want, abs=1e-9)
    assert acc.cosine == pytest.approx(float(r.dot(g) / (r.norm() * g.norm())), abs=1e-12)
    assert acc.max_abs_error == pytest.approx(float((r - g).abs().max()))


def test_numpy_inputs():
    assert sqnr_db(np.array([1.0, 0.0]), np.array([1.0, 0.1])) == pytest.approx(20.0)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_is_refused(bad):
    got = torch.ones(10)
    got[3] = bad
    with pytest.raises(FFNQuantError, match="non-finite"):
        accuracy_of(torch.ones(10), got)


def test_size_mismatch_is_refused():
    with pytest.raises(FFNQuantError, match="differ in size"):
        sqnr_db(torch.ones(3), torch.ones(4))
