"""plan.toml: a recipe per layer of one model, what it was planned for, and how it verified.

The file names the model it was made for (architecture, layer count, widths, variant): a plan applied to
another model is refused with what differs. Layers are keyed by index; each carries a `Recipe` text
(`ffnquant.recipe.GRAMMAR`), so one layer can keep a site in float (`+float=SITE`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ..errors import FFNQuantError
from ..recipe import Recipe
from .target import Target

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo

__all__ = ["PLAN_VERSION", "Plan", "check_plan_data", "load_plan", "model_fingerprint"]

PLAN_VERSION = 1
_FINGERPRINT = ("model_type", "variant", "n_layers", "d_model", "d_ff")


def model_fingerprint(info: ModelInfo) -> dict[str, Any]:
    """What a plan must match in a model: architecture, variant, layer count and FFN widths."""
    return {"model_type": info.model_type, "variant": info.spec.variant.value, "n_layers": int(info.n_layers),
            "d_model": int(info.spec.d_model), "d_ff": int(info.spec.d_ff)}


@dataclass(frozen=True)
class Plan:
    """A Recipe per layer index of one model (`model`: its fingerprint and, informational, its path)."""

    model: Mapping[str, Any]
    layers: Mapping[int, Recipe]
    target: str | None = None
    objective: str | None = None
    summary: Mapping[str, Any] = field(default_factory=dict)  # predicted and measured figures, for the reader

    def __post_init__(self) -> None:
        missing = [k for k in _FINGERPRINT if k not in self.model]
        if missing:
            raise FFNQuantError(f"plan: the model section lacks {', '.join(missing)}")
        n = int(self.model["n_layers"])
        layers = {}
        for index, recipe in self.layers.items():
            if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < n:
                raise FFNQuantError(f"plan: layer {index!r} is not a layer index of a {n}-layer model (0..{n - 1})")
            if not isinstance(recipe, Recipe):
                raise FFNQuantError(f"plan: layer {index} needs a Recipe, got {type(recipe).__name__}")
            layers[index] = recipe
        if not layers:
            raise FFNQuantError("plan: no layers")
        object.__setattr__(self, "layers", dict(sorted(layers.items())))

    def recipe_for(self, index: int) -> Recipe:
        try:
            return self.layers[index]
        except KeyError:
            raise FFNQuantError(f"plan has no recipe for layer {index}; it covers {_ranges(self.layers)}") from None

    def check_model(self, info: ModelInfo) -> None:
        """Raise FFNQuantError naming every difference between the plan's model and `info`'s, or a recipe that does
        not fit it (a layer's, or two for the calls of one shared FFN)."""
        have = model_fingerprint(info)
        diffs = [f"{k} {self.model[k]!r} (plan) != {have[k]!r} (model)" for k in _FINGERPRINT if self.model[k] != have[k]]
        if diffs:
            raise FFNQuantError(f"plan was made for another model: {'; '.join(diffs)}")
        for index, recipe in self.layers.items():
            recipe.check_fits(info.spec)
        for calls in info.shared_groups():  # one FFN, one quantization: one recipe for all its calls
            recipes = {str(self.layers[i]) for i in calls if i in self.layers}
            if len(recipes) > 1:
                raise FFNQuantError(f"the plan gives layers {', '.join(f'L{i}' for i in calls)} the recipes "
                                    f"{', '.join(sorted(recipes))}, but they call one FFN (its weights shared): plan "
                                    "one recipe for them (ffnquant's plans do)")
        if info.calls_differ():  # each group's own recipes: a layer calling no shared FFN may take any
            from ..hf.layers import per_call_refusal

            for calls in info.shared_groups():
                per_call_refusal([f"L{i}" for i in calls], [self.layers[i] for i in calls if i in self.layers])

    # --- TOML ---------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"version": PLAN_VERSION, "model": dict(self.model)}
        if self.target:
            out["target"] = self.target
        if self.objective:
            out["objective"] = self.objective
        out["layers"] = [{"index": i, "recipe": str(r)} for i, r in self.layers.items()]
        if self.summary:
            out["summary"] = dict(self.summary)
        return out

    def to_toml(self, command: str | None = None) -> str:
        import tomli_w  # the well-kept TOML writer; tomllib only reads

        head = "# ffnquant plan: a recipe per FFN layer; use it with --plan THIS_FILE (quantize, export, run)\n"
        if command:
            head += f"# made by: {command}\n"
        return head + tomli_w.dumps(_drop_none(self.to_dict()))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "plan") -> "Plan":
        """A Plan from parsed TOML, every field checked as data first (`check_plan_data`): one line naming the entry."""
        check_plan_data(data, where)
        layers = {row["index"]: Recipe.parse(row["recipe"]) for row in data["layers"]}
        try:
            return cls(dict(data["model"]), layers, data.get("target"), data.get("objective"), dict(data.get("summary") or {}))
        except FFNQuantError as exc:
            raise FFNQuantError(f"{where}: {str(exc).removeprefix('plan: ')}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # TOML's true is no count


def check_plan_data(data: Any, where: str = "plan") -> None:
    """The plan file's schema: version, the model's fingerprint, target and objective, one entry per layer index
    with a known recipe. Raises a one-line FFNQuantError naming the first bad entry; a hand-edited file never
    reaches the code that uses it."""
    if not isinstance(data, Mapping):
        raise FFNQuantError(f"{where}: a plan is a TOML table, got {type(data).__name__}")
    version = data.get("version")
    if not _is_int(version) or version != PLAN_VERSION:
        raise FFNQuantError(f"{where}: plan version {version!r} is not supported (this ffnquant reads {PLAN_VERSION})")
    unknown = sorted(set(data) - {"version", "model", "target", "objective", "layers", "summary"})
    if unknown:
        raise FFNQuantError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: model, target, objective, layers")
    model = data.get("model")
    if not isinstance(model, Mapping):
        raise FFNQuantError(f"{where}: a [model] table is needed ({', '.join(_FINGERPRINT)})")
    missing = [k for k in _FINGERPRINT if k not in model]
    if missing:
        raise FFNQuantError(f"{where}: the model section lacks {', '.join(missing)}")
    for key in ("model_type", "variant"):
        if not isinstance(model[key], str) or not model[key].strip():
            raise FFNQuantError(f"{where}: model.{key} must be a name, got {model[key]!r}")
    for key in ("n_layers", "d_model", "d_ff"):
        if not _is_int(model[key]) or model[key] <= 0:
            raise FFNQuantError(f"{where}: model.{key} must be a positive integer, got {model[key]!r}")
    target = data.get("target")
    if target is not None:
        if not isinstance(target, str):
            raise FFNQuantError(f"{where}: target must be text such as \"ppl+1%\", got {target!r}")
        try:
            Target.parse(target)
        except FFNQuantError as exc:
            raise FFNQuantError(f"{where}: target: {exc}") from None
    objective = data.get("objective")
    if objective is not None and not isinstance(objective, str):  # informational ("weight bytes", "latency on ...")
        raise FFNQuantError(f"{where}: objective must be text, got {objective!r}")
    if data.get("summary") is not None and not isinstance(data["summary"], Mapping):
        raise FFNQuantError(f"{where}: summary must be a table, got {type(data['summary']).__name__}")
    rows = data.get("layers")
    if not isinstance(rows, list) or not rows:
        raise FFNQuantError(f"{where}: [[layers]] entries are needed, each with index and recipe")
    n = model["n_layers"]
    seen: set[int] = set()
    for k, row in enumerate(rows, 1):
        entry = f"[[layers]] entry {k}"
        if not isinstance(row, Mapping):
            raise FFNQuantError(f"{where}: {entry} must be a table with index and recipe, got {row!r}")
        extra, absent = sorted(set(row) - {"index", "recipe", "note"}), sorted({"index", "recipe"} - set(row))
        if extra or absent:
            raise FFNQuantError(f"{where}: {entry} has index and recipe (and an optional note); "
                                + (f"unknown: {', '.join(extra)}" if extra else f"missing: {', '.join(absent)}"))
        index = row["index"]
        if not _is_int(index) or not 0 <= index < n:
            raise FFNQuantError(f"{where}: {entry}: index {index!r} is not a layer index of a {n}-layer model "
                                f"(an integer 0..{n - 1})")
        entry = f"layer {index}"
        if index in seen:
            raise FFNQuantError(f"{where}: {entry} is given twice")
        seen.add(index)
        if not isinstance(row["recipe"], str):
            raise FFNQuantError(f"{where}: {entry}: recipe must be text such as \"w8a8@search\", got {row['recipe']!r}")
        if "note" in row and not isinstance(row["note"], str):
            raise FFNQuantError(f"{where}: {entry}: note must be text, got {row['note']!r}")
        try:
            Recipe.parse(row["recipe"])
        except FFNQuantError as exc:
            raise FFNQuantError(f"{where}: {entry}: {exc}") from None


def load_plan(path: str | os.PathLike, info: Any | None = None) -> Plan:
    """Read plan.toml (and, given a ModelInfo, check it fits that model); one-line errors on bad files."""
    import tomllib

    p = Path(path)
    if not p.is_file():
        raise FFNQuantError(f"plan file {p} does not exist (make one with: ffnquant plan --model DIR --target ppl+1%)")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise FFNQuantError(f"plan file {p} is not valid TOML: {str(exc).splitlines()[0]}") from None
    plan = Plan.from_dict(data, where=f"plan file {p}")
    if info is not None:
        try:
            plan.check_model(info)
        except FFNQuantError as exc:
            raise FFNQuantError(f"plan file {p}: {exc}") from None
    return plan


def _ranges(layers: Mapping[int, Any]) -> str:
    idx = sorted(layers)
    return f"layers {idx[0]}..{idx[-1]}" if idx == list(range(idx[0], idx[-1] + 1)) else "layers " + ", ".join(map(str, idx))


def _drop_none(value: Any) -> Any:
    """TOML has no null: leave None values out."""
    if isinstance(value, Mapping):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value if v is not None]
    return value
