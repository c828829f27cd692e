"""commands.common: the progress a long command shows when its stderr is not a terminal."""

import re

import pytest

from ffnquant.commands.common import StageBars


@pytest.mark.parametrize("total", [1, 4, 10, 97], ids=["one", "four", "ten", "many"])
def test_stage_progress_without_a_terminal_is_a_few_lines_with_the_time_left(total, capsys):
    bars = StageBars()
    for done in range(1, total + 1):
        bars(f"capture: batch {done}/{total}", done, total)
    bars("verify round 1: end to end", 1, 4)
    lines = capsys.readouterr().err.strip().splitlines()
    capture = [line for line in lines if line.startswith("capture:")]
    # a line when the stage starts, at each quarter and at its end: never one per step of a long stage
    assert 1 <= len(capture) <= 5
    assert capture[-1].startswith(f"capture: {total}/{total}")
    assert all(re.search(r"about \d+ s left", line) for line in capture[:-1])
    assert "left" not in capture[-1]
    assert lines[-1].startswith("verify round 1: 1/4")


def test_a_stage_that_runs_again_shows_its_progress_again(capsys):
    """Each verification round streams through every layer under one stage name: every run is shown, each
    timed from its own start (round 2 once printed nothing: the stage had reached its end in round 1)."""
    bars = StageBars()
    for _ in range(3):
        for j in range(1, 9):
            bars(f"verify: L{j - 1}", j, 8)
    lines = capsys.readouterr().err.strip().splitlines()
    assert sum(line.startswith("verify: 8/8") for line in lines) == 3
    assert sum(line.startswith("verify: 1/8") for line in lines) == 3


def test_disabled_stage_progress_prints_nothing(capsys):
    bars = StageBars(enabled=False)
    bars("capture: batch 1/2", 1, 2)
    assert capsys.readouterr().err == ""
