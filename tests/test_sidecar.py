"""infra.sidecar: work shared with one spawned helper process gives what this process alone gives."""

from __future__ import annotations

import os

import pytest
import torch

from ffnquant.infra.sidecar import side_by_side


def _square_and_pid(x: int) -> tuple[int, int]:
    return x * x, os.getpid()


def _fails_on_three(x: int) -> int:
    if x == 3:
        raise ValueError("three")
    return x


@pytest.mark.parametrize("helper", [False, True], ids=["this-process-alone", "with-a-helper"])
def test_every_item_once_with_its_own_result(helper):
    items = list(range(7))
    got = list(side_by_side(_square_and_pid, items, lambda x: (x,), helper=helper))
    assert sorted(i for i, _ in got) == items  # each item once
    assert all(result[0] == i * i for i, result in got)
    pids = {result[1] for _, result in got}
    if helper:  # the helper took the last item first, while this process started on the first
        assert len(pids) == 2 and dict(got)[items[-1]][1] != os.getpid() and dict(got)[0][1] == os.getpid()
    else:
        assert pids == {os.getpid()}


def test_a_helper_failure_is_raised_here_and_the_helper_is_gone():
    import multiprocessing

    with pytest.raises(ValueError, match="three"):
        # 3 is the helper's first item (taken from the back of 0..3)
        list(side_by_side(_fails_on_three, [0, 1, 2, 3], lambda x: (x,), helper=True))
    assert not multiprocessing.active_children()


def test_one_item_starts_no_helper():
    got = list(side_by_side(_square_and_pid, [5], lambda x: (x,)))
    assert got == [(5, (25, os.getpid()))]


def test_the_onnxruntime_floor_is_the_same_in_a_helper():
    """`planning.floor.ort_floor` in a helper process gives this process's figures exactly: the same function of the
    same FFN and inputs (the floor's side-by-side measurement changes only the time)."""
    pytest.importorskip("onnxruntime")
    from ffnquant.model import build
    from ffnquant.planning.floor import ort_floor
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    gen = torch.Generator().manual_seed(0)
    layers = [(f"L{k}", build(spec, seed=k), torch.randn(512, 32, generator=gen), torch.randn(128, 32, generator=gen), 256)
              for k in range(2)]
    alone = dict(side_by_side(ort_floor, range(2), lambda k: layers[k], helper=False))
    shared = dict(side_by_side(ort_floor, range(2), lambda k: layers[k], helper=True))
    assert alone == shared and all(v["methods"] for v in alone.values())
