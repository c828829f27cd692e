"""plan.toml: a recipe per layer of one model, what it was planned for, and how it verified.

The file names the model it was made for (architecture, layer count, widths, variant): a plan applied to
another model is refused with what differs. Layers are keyed by index; each carries a `Recipe` text
(`SCHEME[@CALIBRATOR][+smooth[=ALPHA]][+rotate][+float=SITE]`), so one layer can keep a site in float.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..errors import FFNQuantError
from ..recipe import Recipe

__all__ = ["PLAN_VERSION", "Plan", "load_plan", "model_fingerprint"]

PLAN_VERSION = 1
_FINGERPRINT = ("model_type", "variant", "n_layers", "d_model", "d_ff")


def model_fingerprint(info: Any) -> dict[str, Any]:
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

    def check_model(self, info: Any) -> None:
        """Raise FFNQuantError naming every difference between the plan's model and `info`'s."""
        have = model_fingerprint(info)
        diffs = [f"{k} {self.model[k]!r} (plan) != {have[k]!r} (model)" for k in _FINGERPRINT if self.model[k] != have[k]]
        if diffs:
            raise FFNQuantError(f"plan was made for another model: {'; '.join(diffs)}")
        for index, recipe in self.layers.items():
            recipe.check_fits(info.spec)

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
        version = data.get("version")
        if version != PLAN_VERSION:
            raise FFNQuantError(f"{where}: plan version {version!r} is not supported (this ffnquant reads {PLAN_VERSION})")
        unknown = sorted(set(data) - {"version", "model", "target", "objective", "layers", "summary"})
        if unknown:
            raise FFNQuantError(f"{where}: unknown key(s) {', '.join(unknown)}; valid: model, target, objective, layers")
        if not isinstance(data.get("model"), Mapping):
            raise FFNQuantError(f"{where}: a [model] table is needed ({', '.join(_FINGERPRINT)})")
        rows = data.get("layers")
        if not isinstance(rows, list) or not rows:
            raise FFNQuantError(f"{where}: [[layers]] entries are needed, each with index and recipe")
        layers: dict[int, Recipe] = {}
        for row in rows:
            if not isinstance(row, Mapping) or set(row) - {"index", "recipe", "note"} or not {"index", "recipe"} <= set(row):
                raise FFNQuantError(f"{where}: each [[layers]] entry has index and recipe, got {dict(row) if isinstance(row, Mapping) else row!r}")
            index = row["index"]
            if index in layers:
                raise FFNQuantError(f"{where}: layer {index} is given twice")
            try:
                layers[index] = Recipe.parse(row["recipe"])
            except FFNQuantError as exc:
                raise FFNQuantError(f"{where}: layer {index}: {exc}") from None
        try:
            return cls(dict(data["model"]), layers, data.get("target"), data.get("objective"), data.get("summary") or {})
        except FFNQuantError as exc:
            raise FFNQuantError(f"{where}: {str(exc).removeprefix('plan: ')}") from None


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
