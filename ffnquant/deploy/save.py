"""A model quantized as planned (`PlannedModel`), written as one deployment format into a folder, with the
document that says what was written and what it measures (`ffnquant-deploy.json` / `.md`).

`format_refusal` says, before any work, why a format cannot take a plan of a model; `write_deployment` does
the work inside a folder the caller stages (`atomic_folder.staged_folder`): the fold check against the original
float model, the files, the proof (compressed-tensors: loaded back with transformers; onnx: the whole-model
graph scored on onnxruntime), the sizes and the document. `ffnquant.save` and `ffnquant export --plan` call it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..errors import FFNQuantError

__all__ = ["DEPLOY_DOC", "DeployReport", "format_refusal", "layer_rows", "write_deployment"]

DEPLOY_DOC = "ffnquant-deploy.json"  # what an export wrote and measured; its "files" are what --force may replace


@dataclass(frozen=True)
class DeployReport:
    """What `ffnquant.save` wrote: the folder and its document (the contents of ffnquant-deploy.json)."""

    path: Path
    doc: dict[str, Any]

    @property
    def format(self) -> str:
        return self.doc["format"]

    @property
    def proven(self) -> bool | None:
        """compressed-tensors: the loaded folder reproduces the measured model; onnx: the whole graph's score meets
        its bound; None where there is nothing to prove (per-layer artifacts only)."""
        if "proof" in self.doc:
            return bool(self.doc["proof"]["proven"])
        score = (self.doc.get("graph") or {}).get("score")
        return None if not score else bool(score["meets_tolerance"] or score.get("within_resolution"))

    @property
    def weight_bytes(self) -> int:
        return int(self.doc["sizes"]["weights"])


def format_refusal(info: Any, plan: Any, fmt: str) -> tuple[bool, str | None]:
    """(whether the whole model is written, why the whole-model graph is not) for `fmt`; raises FFNQuantError, in
    one line, where the format cannot take this plan of this model at all."""
    from .planned import deployable_refusal

    if fmt == "compressed-tensors":
        from ..planning.sensitivity import check_plannable
        from . import ctensors

        check_plannable(info)
        ok, why_missing = ctensors.ctensors_available()
        for why in (deployable_refusal(info), None if ok else why_missing, ctensors.plan_refusal(plan, info)):
            if why is not None:
                raise FFNQuantError(why)
        return True, None
    from . import onnx_model

    graph_why = onnx_model.graph_refusal(info)
    return graph_why is None, graph_why


def layer_rows(planned: Any, folder: Path) -> list[dict[str, Any]]:
    """Each layer's recipe, its per-layer artifact in `folder` (if any) and its SQNR figures."""
    rows = []
    for r in planned.rows:
        art = r.get("artifact") or {}
        rows.append({"index": r["index"], "label": r["label"], "recipe": r["recipe"],
                     "file": Path(art["path"]).name if art.get("path") else None,
                     "why_no_file": None if art.get("path") else art.get("note"),
                     "inputs": ["input"], "outputs": ["output"], "input_shape": ["batch", "seq", planned.info.spec.d_model],
                     "sqnr_db_torch": r["accuracy_torch"]["sqnr_db"],
                     "sqnr_db_onnx": (art.get("accuracy_onnx") or {}).get("sqnr_db"),
                     # where this CPU's int8 kernel saturates (ortcpu): the graph's own figure, and why
                     **({"sqnr_db_onnx_graph": art["accuracy_onnx_graph"]["sqnr_db"], "int8_kernel": art["int8_kernel"]}
                        if "accuracy_onnx_graph" in art else {})})
    return rows


def write_deployment(planned: Any, folder: Path, fmt: str, *, whole: bool, graph_why: str | None = None,
                     command: str | None = None, plan_file: str | None = None,
                     progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Write `planned` as `fmt` into `folder` (staged by the caller), prove it, and write the document; returns
    the document. Raises FFNQuantError where the folded norms do not reproduce the original model."""
    from ..atomic import write_json, write_text
    from ..atomic_folder import folder_files
    from ..envinfo import environment
    from ..report.deploy import deploy_markdown
    from . import proof
    from .ctensors import folder_bytes

    tick = progress or (lambda *a: None)
    t0 = time.perf_counter()
    info, plan = planned.info, planned.plan
    steps = ["fold check on the float model", f"write {fmt}", "load back and prove"]
    tick(f"export: {steps[0]}", 0, len(steps))
    fold = None
    if whole:  # the folded norms against the original float model, before anything is written
        fold = proof.fold_check(planned)
        why = proof.fold_refusal(fold, info)
        if why is not None:
            raise FFNQuantError(why)
    doc = {"format": fmt, "command": command, "plan_file": plan_file, "plan": plan.to_dict(),
           "model": {k: v for k, v in info.to_dict().items() if k != "layers"},
           "texts": {k: planned.settings[k] for k in ("calibration", "evaluation")},
           "token_budgets": planned.settings.get("token_budgets") or {},
           "reference": planned.reference["end_to_end"], "baseline": planned.reference["baseline"],
           "layers": layer_rows(planned, folder)}
    if fold is not None:
        doc["fold"] = fold.to_dict()
    tick(f"export: {steps[1]}", 1, len(steps))
    if fmt == "compressed-tensors":
        from . import ctensors

        doc["written"] = ctensors.write_folder(planned, folder)
        tick(f"export: {steps[2]}", 2, len(steps))
        doc["proof"] = ctensors.verify_folder(folder, planned, plan.summary.get("measured_perplexity_ratio"))
        weights = folder_bytes(folder)
    else:
        weights = _write_onnx(planned, folder, doc, whole, graph_why)
    tick(f"export: {steps[-1]}", len(steps), len(steps))
    doc["sizes"] = {"weights": weights, "float_weights": folder_bytes(info.path)}
    doc["seconds"] = time.perf_counter() - t0
    doc["environment"] = environment()
    # every file this export wrote: what a later --force may replace
    doc["files"] = sorted({*folder_files(folder), DEPLOY_DOC, "ffnquant-deploy.md"})
    write_json(folder / DEPLOY_DOC, doc)
    write_text(folder / "ffnquant-deploy.md", deploy_markdown(doc))
    return doc


def _write_onnx(planned: Any, folder: Path, doc: dict[str, Any], whole: bool, graph_why: str | None) -> int:
    """manifest.json and, where the model allows, the whole-model graph scored on onnxruntime; the weight bytes of
    what was written (the graph, else the per-layer artifacts the caller had written into `folder`)."""
    from ..atomic import write_json
    from ..envinfo import environment
    from . import onnx_model, proof

    write_json(folder / "manifest.json", {"model": doc["model"], "plan": doc["plan"], "plan_file": doc["plan_file"],
                                          "layers": doc["layers"],
                                          "end_to_end": {"status": "ok", "reason": None, **planned.reference},
                                          "evaluation": doc["texts"]["evaluation"], "environment": environment()})
    doc["graph"] = {"status": "skipped", "reason": graph_why}
    if whole:
        try:
            doc["graph"] = {"status": "ok", **onnx_model.write_model_graph(planned, folder)}
        except FFNQuantError as exc:  # a recipe the graph cannot express: the per-layer artifacts stand
            doc["graph"] = {"status": "skipped", "reason": str(exc)}
            whole = False
        score = doc["graph"].get("score")
        if score and not score["meets_tolerance"]:  # how finely the figure can be matched on this text
            res = proof.rounding_allowance(planned)  # on the original, unfolded model
            allowed = proof.GATE_FACTOR * res["spread"]["perplexity_ratio"]
            score.update(resolution=res, within_resolution=res["reproduces_reference"]
                         and abs(score["perplexity_rel_diff"]) <= allowed)
    if whole:
        return (folder / "model.onnx").stat().st_size
    # the planned per-layer artifacts (not the baselines beside them)
    return sum((folder / r["file"]).stat().st_size for r in doc["layers"] if r["file"])
