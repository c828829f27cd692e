"""infra.progress: one line per stage at its start, each quarter and its end, with the time left; the API's choices."""

import io

import pytest

from ffnquant.errors import FFNQuantError
from ffnquant.infra.progress import StageLines, progress_callback


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stage_prints_its_quarters_with_the_time_left():
    out, clock = io.StringIO(), Clock()
    lines = StageLines(out, clock)
    for done in range(1, 9):  # 8 steps of 10 s each
        clock.now = 10.0 * done
        lines("candidates: L%d" % done, done, 8)
    text = out.getvalue().splitlines()
    # a line at each quarter (2, 4, 6 of 8) and at the end; the first report starts the stage's clock
    assert [t.split(",")[0] for t in text] == ["candidates: 1/8 (L1)", "candidates: 2/8 (L2)", "candidates: 4/8 (L4)",
                                               "candidates: 6/8 (L6)", "candidates: 8/8 (L8)"]
    assert text[2].endswith("30 s, about 30 s left")  # 30 s since the first report over 4 steps: 7.5 s each, 4 to go
    assert text[-1].endswith("70 s")


def test_a_stage_that_runs_again_is_timed_from_its_own_start():
    out, clock = io.StringIO(), Clock()
    lines = StageLines(out, clock)
    for rnd in range(2):
        for done in (1, 2):
            clock.now += 5.0
            lines("verify: L%d" % done, done, 2)
    assert out.getvalue().count("verify: 2/2 (L2), 5 s") == 2


@pytest.mark.parametrize("value, silent", [(False, True), (None, True), (True, False)], ids=["false", "none", "true"])
def test_progress_choices(value, silent, capsys):
    progress_callback(value)("stage: x", 1, 1)
    assert (capsys.readouterr().err == "") is silent


def test_a_callback_is_used_and_anything_else_is_refused():
    seen = []
    progress_callback(lambda *a: seen.append(a))("stage", 1, 2)
    assert seen == [("stage", 1, 2)]
    with pytest.raises(FFNQuantError, match="progress must be True .* got str"):
        progress_callback("yes")
