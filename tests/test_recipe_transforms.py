"""Recipes as data: a scheme, a calibrator and an ordered tuple of transforms, whose one text form is GRAMMAR.

Each transform class declares its token, grammar fragment, rank, text, label, slug and JSON in one place; these
tests pin the forms committed reports store (text, file names, JSON), the canonical order, the one-line errors,
the grammar in the help texts and README, and that a new transform is one registered class."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from ffnquant import recipe as recipe_module
from ffnquant.errors import FFNQuantError
from ffnquant.recipe import (TRANSFORMS, KeepFloat, Recipe, Rotate, Smooth, Transform, register_transform,
                             unregister_transform)

ROOT = Path(__file__).resolve().parents[1]
GRAMMAR_TEXT = "SCHEME[@CALIBRATOR][+smooth[=ALPHA]][+rotate][+float=SITE]"


def test_grammar_is_generated_from_the_registry_in_rank_order():
    assert recipe_module.GRAMMAR == GRAMMAR_TEXT
    assert list(TRANSFORMS) == ["smooth", "rotate", "float"]
    assert [c.rank for c in TRANSFORMS.values()] == sorted(c.rank for c in TRANSFORMS.values())


# --- the forms committed reports store ---------------------------------------------------------------------------

@pytest.mark.parametrize("text, slug, label, data", [
    ("w8a8", "w8a8", "w8a8", {"scheme": "w8a8", "calibrator": None, "smooth": None, "rotate": False}),
    ("w8a8@search+smooth+rotate", "w8a8-search.smooth0.5-rotate", "w8a8 (search) + smooth 0.5 + rotate",
     {"scheme": "w8a8", "calibrator": "search", "smooth": 0.5, "rotate": True}),
    ("w8a8@percentile:99.9+smooth=0.3+float=hidden", "w8a8-percentilep99.9.smooth0.3.float-hidden",
     "w8a8 (percentile:99.9) + smooth 0.3, hidden in float",
     {"scheme": "w8a8", "calibrator": "percentile:99.9", "smooth": 0.3, "rotate": False, "keep_float": "hidden"}),
    ("w4a16-g128+rotate+float=input", "w4a16-g128.rotate.float-input", "w4a16-g128 + rotate, input in float",
     {"scheme": "w4a16-g128", "calibrator": None, "smooth": None, "rotate": True, "keep_float": "input"}),
    ("w8a8+smooth=0.1234567", "w8a8.smooth0.1234567", "w8a8 + smooth 0.123457",
     {"scheme": "w8a8", "calibrator": None, "smooth": 0.1234567, "rotate": False}),
], ids=["plain", "search-smooth-rotate", "percentile-smooth0.3-float-hidden", "w4-rotate-float-input", "exact-alpha"])
def test_text_slug_label_and_json_are_those_committed_reports_store(text, slug, label, data):
    r = Recipe.parse(text)
    assert (r.name, r.slug, r.label) == (text, slug, label)
    assert list(r.to_dict().items()) == list(data.items())  # key order too: JSON files are compared as text
    assert Recipe.from_dict(data) == r


CHOICES = {"smooth": [None, "smooth", "smooth=0.3"], "rotate": [None, "rotate"], "float": [None, "float=input", "float=hidden"]}
COMBOS = [tuple(m for m in combo if m) for combo in itertools.product(*CHOICES.values())]


@pytest.mark.parametrize("mods", COMBOS, ids=lambda mods: "+".join(mods) or "none")
@pytest.mark.parametrize("head", ["w8a8@search", "w4a16-g128"])
def test_every_combination_round_trips_in_any_order(head, mods):
    canonical = "+".join([head, *mods])
    r = Recipe.parse(canonical)
    assert r.name == canonical and str(r) == canonical
    assert Recipe.from_dict(r.to_dict()) == r
    assert Recipe(r.scheme, r.calibrator, transforms=r.transforms) == r
    assert Recipe(r.scheme, r.calibrator, r.smooth, r.rotate, r.keep_float) == r  # the keywords are the same value
    for order in itertools.permutations(mods):
        typed = Recipe.parse("+".join([head.upper(), *(m.upper() for m in order)]))
        assert typed == r and typed.name == canonical and typed.slug == r.slug


def test_transforms_are_kept_in_the_order_they_apply():
    r = Recipe("w8a8", transforms=(KeepFloat("hidden"), Rotate(), Smooth(0.3)))
    assert r.transforms == (Smooth(0.3), Rotate(), KeepFloat("hidden"))
    assert r.remedies == (Smooth(0.3), Rotate())
    assert Recipe.parse("w8a8+rotate+smooth") == Recipe.parse("w8a8+smooth+rotate")
    assert hash(Recipe.parse("w8a8+rotate+smooth")) == hash(Recipe.parse("w8a8+smooth+rotate"))


def test_the_keywords_read_and_set_the_transforms():
    r = Recipe("w8a8", "auto", smooth=0.5, rotate=True, keep_float="hidden")
    assert r == Recipe("w8a8", "auto", transforms=(Smooth(0.5), Rotate(), KeepFloat("hidden")))
    assert (r.smooth, r.rotate, r.keep_float, r.has_remedies) == (0.5, True, "hidden", True)
    assert dataclasses.replace(r, calibrator="mse").transforms == r.transforms
    assert dataclasses.replace(r, keep_float=None) == Recipe("w8a8", "auto", smooth=0.5, rotate=True)
    assert dataclasses.replace(r, smooth=0.2).name == "w8a8@auto+smooth=0.2+rotate+float=hidden"
    assert r.plain() == Recipe("w8a8", "auto", keep_float="hidden") and not r.plain().has_remedies


# --- validation: one line, naming what is valid --------------------------------------------------------------------

ALL_FORMS = ", ".join(form for cls in TRANSFORMS.values() for form in cls.forms)


@pytest.mark.parametrize("make, message", [
    (lambda: Smooth(1.5), "smooth strength must be in [0, 1], got 1.5"),
    (lambda: Smooth("half"), "smooth strength must be a number in [0, 1], got 'half'"),
    (lambda: KeepFloat("gate"), "unknown float site 'gate'; valid: input, hidden"),
    (lambda: Recipe.parse("w8a8+smooth=half"), "smooth strength must be a number, got 'half'"),
    (lambda: Recipe.parse("w8a8+smooth=nan"), "smooth strength must be in [0, 1], got nan"),
    (lambda: Recipe.parse("w8a8+rotate=yes"), "unknown remedy 'rotate=yes'; valid: rotate"),
    (lambda: Recipe.parse("w8a8+float=gate"), "unknown remedy 'float=gate'; valid: float=input, float=hidden"),
    (lambda: Recipe.parse("w8a8+bogus"), f"unknown remedy in 'w8a8+bogus' 'bogus'; valid: {ALL_FORMS}"),
    (lambda: Recipe.parse("w8a8+rotate+rotate"), "remedy 'rotate' is given twice"),
    (lambda: Recipe.parse("fp16+rotate"), "remedies apply to quantized schemes, not fp16"),
    (lambda: Recipe.parse("fp32+float=input"), "fp32 is float already; +float=SITE keeps one site"),
    (lambda: Recipe("w8a8", rotate="yes"), "rotate must be true or false, got 'yes'"),
    (lambda: Recipe("w8a8", transforms=(Rotate(), Rotate())), "remedy 'rotate' is given twice"),
    (lambda: Recipe("w8a8", transforms=("rotate",)), "transforms must be registered Transform objects (smooth, rotate, float)"),
    (lambda: Recipe("w8a8", colour="red"), "keyword 'colour'; valid: scheme, calibrator, transforms, smooth, rotate, keep_float"),
], ids=["smooth-range", "smooth-type", "float-site", "text-smooth-not-a-number", "text-smooth-nan", "text-rotate-value",
        "text-float-site", "text-unknown", "text-twice", "remedy-on-float-scheme", "float-site-on-float-scheme",
        "keyword-rotate", "transforms-twice", "transforms-not-objects", "unknown-keyword"])
def test_each_refusal_is_one_line_naming_what_is_valid(make, message):
    with pytest.raises(FFNQuantError) as info:
        make()
    assert message in str(info.value) and "\n" not in str(info.value)


# --- the grammar, written once --------------------------------------------------------------------------------------

def _helps(parser: argparse.ArgumentParser, prog: str = "ffnquant"):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _helps(sub, f"{prog} {name}")
        elif action.help:
            yield f"{prog} {'/'.join(action.option_strings)}", action.help


def test_help_texts_state_the_grammar_as_generated():
    from ffnquant.cli import build_parser

    helps = dict(_helps(build_parser()))
    stated = {where: re.findall(r"SCHEME\[[^\s,()]*", text) for where, text in helps.items()}
    stated = {where: found for where, found in stated.items() if found}
    assert all(found == [recipe_module.GRAMMAR] for found in stated.values()), stated
    for where in ["ffnquant run --schemes", "ffnquant quantize --recipe", "ffnquant model eval --schemes",
                  "ffnquant plan --candidates"]:
        assert where in stated, f"{where}'s help does not state the recipe grammar"


def test_readme_states_the_grammar_once_and_as_generated():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert re.findall(r"`(SCHEME\[[^`]*)`", text) == [recipe_module.GRAMMAR]


def test_no_other_source_restates_the_grammar():
    """The transforms' fragments are declared by their classes only; every other text refers to GRAMMAR."""
    files = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "ffnquant").rglob("*.py"))]
    offenders = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        if f.name == "README.md":
            text = text.replace(f"`{recipe_module.GRAMMAR}`", "", 1)  # its one statement (the test above)
        if "+smooth[=" in text and f != ROOT / "ffnquant" / "recipe.py":
            offenders.append(str(f.relative_to(ROOT)))
    assert offenders == []


# --- a new transform is one class ---------------------------------------------------------------------------------

@pytest.fixture
def noop():
    """A toy transform registered for one test: it changes nothing and is not a remedy."""

    @dataclass(frozen=True)
    class Noop(Transform):
        """Does nothing; shows what a new transform declares."""

        token = "noop"
        grammar = "+noop"
        forms = ("noop",)
        rank = 50  # after the remedies, before the float site
        key = "noop"

    before = recipe_module.GRAMMAR
    register_transform(Noop)
    try:
        yield Noop
    finally:
        unregister_transform("noop")
        assert recipe_module.GRAMMAR == before and "noop" not in TRANSFORMS


def test_a_registered_transform_parses_prints_slugs_and_is_in_the_grammar(noop):
    assert recipe_module.GRAMMAR == "SCHEME[@CALIBRATOR][+smooth[=ALPHA]][+rotate][+noop][+float=SITE]"
    r = Recipe.parse("w8a8@auto+float=hidden+NOOP+smooth")
    assert r.transforms == (Smooth(), noop(), KeepFloat("hidden"))
    assert r.name == "w8a8@auto+smooth+noop+float=hidden"
    assert r.label == "w8a8 (auto) + smooth 0.5 + noop, hidden in float"
    assert r.slug == "w8a8-auto.smooth0.5.noop.float-hidden"
    assert r.to_dict()["noop"] is True and Recipe.from_dict(r.to_dict()) == r
    assert Recipe("w8a8", "auto", smooth=0.5, keep_float="hidden", noop=True) == r
    assert "noop" not in Recipe.parse("w8a8").to_dict()  # the JSON of recipes without it is unchanged
    with pytest.raises(FFNQuantError, match=r"valid: smooth, smooth=ALPHA, rotate, noop, float=input, float=hidden$"):
        Recipe.parse("w8a8+bogus")
    with pytest.raises(FFNQuantError, match="unknown remedy 'noop=1'; valid: noop"):
        Recipe.parse("w8a8+noop=1")


def test_a_transform_must_be_new_to_register():
    @dataclass(frozen=True)
    class Twin(Transform):
        token = "rotate"
        grammar = "+rotate"
        forms = ("rotate",)
        rank = 21
        key = "twin"

    with pytest.raises(FFNQuantError, match="Twin's token 'rotate' is taken by Rotate"):
        register_transform(Twin)
    assert TRANSFORMS["rotate"] is Rotate


# --- prepare applies the recipe's remedies, in order -------------------------------------------------------------

def test_prepare_applies_the_remedies_in_the_recipes_order():
    from ffnquant.quantization import prepare
    from ffnquant.spec import FFNSpec

    r = Recipe.parse("w8a8+float=hidden+rotate+smooth=0.3")
    prep = prepare(FFNSpec("relu", d_model=32), "gaussian", 256, 128, recipe=r)
    assert prep.transforms == r.remedies == (Smooth(0.3), Rotate())
    assert [rec.kind for rec in prep.remedies] == ["smooth", "rotate"]
    assert prep.matches(r) and prep.matches(Recipe.parse("w8a8+smooth=0.3+rotate"))
    assert not prep.matches(r.plain())
    assert prep.remedy_slug == r.remedy_slug == "smooth0.3-rotate"
