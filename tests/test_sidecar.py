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
    from types import SimpleNamespace

    from ffnquant.model import build
    from ffnquant.planning.floor import floor_args, ort_best, ort_floor
    from ffnquant.spec import FFNSpec, Variant

    spec = FFNSpec(Variant.SWIGLU, d_model=32, d_ff=64)
    gen = torch.Generator().manual_seed(0)
    settings = SimpleNamespace(seq_len=64, batch_size=4)
    layers = [(SimpleNamespace(label=f"L{k}", ffn=build(spec, seed=k)), torch.randn(512, 32, generator=gen),
               torch.randn(128, 32, generator=gen)) for k in range(2)]
    args = [floor_args(*layer, settings) for layer in layers]  # made in this process, as the plan does
    alone = dict(side_by_side(ort_floor, range(2), lambda k: args[k], helper=False))
    shared = dict(side_by_side(ort_floor, range(2), lambda k: args[k], helper=True))
    assert alone == shared and all(v["methods"] for v in alone.values())
    assert alone == {k: ort_best(*layers[k], settings) for k in range(2)}


def _makes_a_lock(x: int) -> int:
    import multiprocessing

    global _LOCK  # kept alive in the helper, as a library's module-level lock is (tqdm's)
    _LOCK = multiprocessing.get_context("spawn").RLock()
    return x


def test_a_finished_helper_leaves_no_semaphore_behind():
    """The helper exits on its own once the work is done, so what its libraries registered with multiprocessing's
    resource tracker is released (a killed helper made Python warn of a 'leaked semaphore' at the plan's exit)."""
    import subprocess
    import sys
    from pathlib import Path

    script = ("import sys; sys.path[:0] = [{tests!r}, {repo!r}]\n"
              "from ffnquant.infra.sidecar import side_by_side\n"
              "from test_sidecar import _makes_a_lock\n"
              "if __name__ == '__main__':\n"
              "    print(sorted(side_by_side(_makes_a_lock, [1, 2, 3], lambda x: (x,), helper=True)))\n")
    here = Path(__file__).resolve().parent
    proc = subprocess.run([sys.executable, "-c", script.format(tests=str(here), repo=str(here.parent))],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[(1, 1), (2, 2), (3, 3)]" and "leaked" not in proc.stderr, proc.stderr
