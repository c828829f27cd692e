"""Whole models in the Python API: plan, apply, save, on a Hugging Face causal LM folder or a transformers model.

    import ffnquant
    plan = ffnquant.plan("SmolLM2-135M", "ppl+1%", objective="bytes", format="compressed-tensors")
    qmodel = ffnquant.apply("SmolLM2-135M", plan)                 # a plan, or one recipe for every layer
    report = ffnquant.save(qmodel, "SmolLM2-135M-ffnq")           # written, loaded back and proven
    model = transformers.AutoModelForCausalLM.from_pretrained("SmolLM2-135M-ffnq")

`plan` is `ffnquant plan` (a recipe per FFN layer meeting the target at the least cost, verified on held-out
text), `apply` quantizes the model as a plan says (`deploy.PlannedModel`: the deployable model and ffnquant's
reference figures), `save` writes it as compressed-tensors or ONNX and proves it (`deploy.save`). A model object
is saved to a scratch folder first (the engine reads a model a layer at a time from its safetensors), with its
tokenizer: given, or read from the folder the model was loaded from.
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from pathlib import Path
from typing import Any, Callable

from .errors import FFNQuantError

__all__ = ["plan", "apply", "save"]

Progress = Callable[[str, int, int], None]


def _model_info(model: Any, tokenizer: Any = None) -> tuple[Any, Path | None]:
    """(ModelInfo, the scratch folder a model object was saved to, or None for a folder)."""
    from .hf import inspect_model

    if isinstance(model, (str, Path)):
        return inspect_model(model), None
    if not hasattr(model, "save_pretrained") or not hasattr(model, "config"):
        raise FFNQuantError(f"expected a model folder or a transformers model, got {type(model).__name__}")
    if tokenizer is None:
        source = getattr(model, "name_or_path", "") or ""
        if not source or not Path(source).is_dir():
            raise FFNQuantError("a transformers model object needs its tokenizer: pass tokenizer=, or load the model "
                                "from a local folder that has one")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(source)
    scratch = Path(tempfile.mkdtemp(prefix="ffnquant-model-"))
    try:
        model.save_pretrained(scratch, safe_serialization=True)
        tokenizer.save_pretrained(scratch)
        return inspect_model(scratch), scratch
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def _texts(info: Any, text: Any, eval_text: Any, seq_len: int | None) -> int:
    """Read both texts now (a missing file is said before any work); the sequence length, capped at the model's."""
    from .hf.capture import read_text, require_transformers
    from .hf.corpus import DEFAULT_SEQ_LEN
    from .hf.inputs import EvalSettings, fit_settings

    require_transformers()
    read_text(text, "calibration")
    read_text(eval_text, "evaluation")
    return fit_settings(info, EvalSettings(seq_len=seq_len or DEFAULT_SEQ_LEN)).seq_len


def plan(model: Any, target: str = "ppl+1%", *, objective: str | None = None, runtime: str = "ort-cpu",
         tokens: int = 512, decode_tokens: int | None = None, candidates: Any = "default", format: str | None = None,
         text: Any = None, eval_text: Any = None, calib_tokens: int = 4096, eval_tokens: int = 4096,
         seq_len: int | None = None, probe_tokens: int = 512, rounds: int = 4, compute_dtype: str = "auto",
         ort_floor: bool = True, tokenizer: Any = None, progress: Progress | None = None):
    """A recipe per FFN layer of `model` (a folder or a transformers model) meeting `target` ('ppl+1%', 'kld<=0.01',
    'top1>=95%', 'sqnr>=30') at the least `objective` ('latency' on `runtime`, or 'bytes'), verified on held-out text:
    a `planning.Plan` (its `summary` has the verified figures; `Plan.to_toml` is plan.toml). `format`: plan only
    candidates that format ('compressed-tensors', 'onnx') can write. The other arguments are `ffnquant plan`'s."""
    from .deploy.formats import get_format
    from .deploy.precision import resolve_compute_dtype
    from .hf.inputs import EvalSettings
    from .planning.job import make_plan
    from .planning.target import DECODE_TOKENS, Objective, Target, Workload

    info, scratch = _model_info(model, tokenizer)
    try:
        goal = Target.parse(target)
        kind = objective or ("bytes" if info.n_experts else "latency")
        aim = Objective(kind, runtime, Workload(tokens, DECODE_TOKENS if decode_tokens is None else decode_tokens))
        fmt = None if format is None else get_format(format)
        dtype = resolve_compute_dtype(compute_dtype, fmt, info)
        settings = EvalSettings(seq_len=_texts(info, text, eval_text, seq_len), max_calib_tokens=calib_tokens,
                                max_eval_tokens=eval_tokens, ablation=False)
        result_plan, _ = make_plan(info, goal, aim, candidates, text=text, eval_text=eval_text, settings=settings,
                                   probe_tokens=probe_tokens, max_rounds=rounds, ort_floor=ort_floor, progress=progress,
                                   export_format=fmt, dtype=dtype)
        return result_plan
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


def apply(model: Any, plan_or_recipe: Any, *, format: str = "compressed-tensors", text: Any = None,
          eval_text: Any = None, calib_tokens: int = 4096, eval_tokens: int = 4096, seq_len: int | None = None,
          compute_dtype: str = "auto", tokenizer: Any = None, progress: Progress | None = None):
    """`model` (a folder or a transformers model) quantized as `plan_or_recipe` says (a Plan, a plan.toml path, or
    one recipe such as 'w8a16' for every layer), for `format`: a `deploy.PlannedModel`, the deployable model with
    ffnquant's reference figures on `eval_text`, which `save` writes."""
    from .deploy import build_planned_model
    from .deploy.formats import get_format
    from .deploy.precision import resolve_compute_dtype
    from .deploy.save import format_refusal
    from .planning import Plan, load_plan
    from .planning.planfile import model_fingerprint
    from .recipe import Recipe, as_recipe

    fmt = get_format(format)
    info, scratch = _model_info(model, tokenizer)
    try:
        if isinstance(plan_or_recipe, Plan):
            the_plan = plan_or_recipe
            the_plan.check_model(info)  # as load_plan checks a file
        elif isinstance(plan_or_recipe, Path) or (isinstance(plan_or_recipe, str) and plan_or_recipe.endswith(".toml")):
            the_plan = load_plan(plan_or_recipe, info)
        elif isinstance(plan_or_recipe, (str, Recipe)):
            recipe = as_recipe(plan_or_recipe)
            the_plan = Plan(model_fingerprint(info), {layer.index: recipe for layer in info.layers})
        else:
            raise FFNQuantError(f"expected a Plan, a plan.toml path or a recipe, got {type(plan_or_recipe).__name__}")
        whole, graph_why = format_refusal(info, the_plan, fmt)
        dtype = resolve_compute_dtype(compute_dtype, fmt, info)
        planned = build_planned_model(info, the_plan, text=text, eval_text=eval_text, calib_tokens=calib_tokens,
                                      eval_tokens=eval_tokens, seq_len=_texts(info, text, eval_text, seq_len),
                                      whole_model=whole, progress=progress, dtype=dtype)
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    planned.settings["format"] = {"name": fmt, "whole": whole, "graph_why": graph_why}
    if scratch is not None:  # save() reads the source folder (sizes, proof): kept while the model lives
        weakref.finalize(planned, shutil.rmtree, scratch, True)
    return planned


def save(qmodel: Any, out: str | Path, *, force: bool = False, progress: Progress | None = None):
    """Write `qmodel` (from `apply`) into the new folder `out` in the format it was applied for, load it back and
    prove it; a `deploy.save.DeployReport` (the folder, `proven`, `weight_bytes`, the whole document). Nothing is
    left half-written; `force` replaces only what an earlier save or export listed in its ffnquant-deploy.json."""
    from .atomic_folder import check_new_folder, staged_folder
    from .deploy.save import DEPLOY_DOC, DeployReport, write_deployment

    fmt = (getattr(qmodel, "settings", None) or {}).get("format")
    if fmt is None:
        raise FFNQuantError(f"save takes the model ffnquant.apply returns, got {type(qmodel).__name__}")
    if fmt["name"] == "onnx" and not fmt["whole"]:
        raise FFNQuantError(f"this model's whole ONNX graph cannot be written ({fmt['graph_why']}); its per-layer "
                            "artifacts are written by `ffnquant export --format onnx`")
    check_new_folder(out, force, inputs=[qmodel.info.path], listing=DEPLOY_DOC)
    with staged_folder(out, force, listing=DEPLOY_DOC) as folder:
        doc = write_deployment(qmodel, folder, fmt["name"], whole=fmt["whole"], graph_why=fmt["graph_why"],
                               command="ffnquant.save", progress=progress)
    return DeployReport(Path(out), doc)
