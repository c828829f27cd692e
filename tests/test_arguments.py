"""`infra.arguments`: the one check per kind of argument that the command line and the Python API share."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from ffnquant.commands.common import memory_size, positive_int
from ffnquant.errors import FFNQuantError
from ffnquant.infra import arguments


@pytest.mark.parametrize("check, message", [
    (lambda: arguments.count(0, "rounds"), "rounds must be a positive integer, got 0"),
    (lambda: arguments.count(True, "rounds"), "rounds must be a positive integer, got True"),
    (lambda: arguments.count("3", "rounds"), "rounds must be a positive integer, got '3'"),
    (lambda: arguments.count(-1, "decode_tokens", minimum=0), "decode_tokens must be an integer of at least 0, got -1"),
    (lambda: arguments.size("8 parsecs", "max_memory"), "max_memory: '8 parsecs' is not a memory size"),
    (lambda: arguments.size(8.5, "max_memory"), "max_memory must be a size such as '8GB'"),
    (lambda: arguments.size(0, "max_memory"), "max_memory: memory size 0 must be at least 1 byte"),
    (lambda: arguments.flag(1, "force"), "force must be True or False, got 1"),
    (lambda: arguments.text_source(b"abc", "text"), "text must be a file path or shipped corpus name"),
    (lambda: arguments.text_source(["a.txt", 3], "text"), "it holds int 3"),
    (lambda: arguments.text_source(" ", "text"), "it holds str ' '"),
    (lambda: arguments.out_path(None, "out"), "out must be a folder path"),
    (lambda: arguments.recipe_list(("fp32", None), "candidates"), "it holds NoneType None"),
], ids=["count-0", "count-bool", "count-str", "count-minimum", "size-unit", "size-float", "size-0", "flag-int",
        "text-bytes", "text-list-int", "text-blank", "out-none", "recipes-none"])
def test_a_bad_argument_is_one_line_naming_it(check, message):
    with pytest.raises(FFNQuantError) as info:
        check()
    assert message in str(info.value) and "\n" not in str(info.value)


def test_good_arguments_come_back_in_their_canonical_form():
    assert arguments.count(3, "n") == 3 and arguments.count(None, "n", optional=True) is None
    assert arguments.size("8GB", "m") == 8 * 10**9 and arguments.size(None, "m") is None
    assert arguments.text_source(["a.txt", Path("b.jsonl")], "text") == ["a.txt", Path("b.jsonl")]
    assert arguments.recipe_list("default", "c") == "default"
    assert arguments.out_path(Path("x"), "out") == Path("x")


@pytest.mark.parametrize("text", ["0", "-2"], ids=["zero", "negative"])
def test_the_command_line_counts_are_the_same_check(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer"):
        positive_int(text)
    with pytest.raises(FFNQuantError, match="must be a positive integer"):
        arguments.count(int(text), "rounds")


def test_the_command_line_sizes_are_the_same_check():
    assert memory_size("6GiB") == arguments.size("6GiB", "max_memory") == 6 * 2**30
