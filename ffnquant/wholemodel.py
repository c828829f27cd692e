"""Whole models in the Python API: plan, apply, save, on a Hugging Face causal LM folder or a transformers model.

    import ffnquant
    plan = ffnquant.plan("SmolLM2-135M", "ppl+1%", objective="bytes", format="compressed-tensors")
    qmodel = ffnquant.apply("SmolLM2-135M", plan)                 # a plan, or one recipe for every layer
    report = ffnquant.save(qmodel, "SmolLM2-135M-ffnq")           # written, loaded back and proven
    model = transformers.AutoModelForCausalLM.from_pretrained("SmolLM2-135M-ffnq")

`plan` is `ffnquant plan` (a recipe per FFN layer meeting the target at the least cost, verified on held-out
text), `apply` quantizes the model as a plan says (`deploy.PlannedModel`: the deployable model and ffnquant's
reference figures), `save` writes it as compressed-tensors or ONNX and proves it (`write_deployment`, below,
which `ffnquant export --plan` calls too). A model object
is saved to a scratch folder first (the engine reads a model a layer at a time from its safetensors), with its
tokenizer: given, or read from the folder the model was loaded from.
"""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from .deploy import build_planned_model, onnx_model, proof
from .deploy.ctensors import folder_bytes
from .deploy.formats import get_format
from .deploy.planned import deployable_refusal
from .deploy.precision import resolve_compute_dtype
from .infra.device import resolve_device, use_device
from .errors import FFNQuantError, api_boundary
from .hf import inspect_model
from .hf.capture import load_tokenizer, read_text, require_transformers
from .hf.corpus import DEFAULT_SEQ_LEN
from .hf.draft import target_of
from .infra.target_model import check_target, current_target, use_target
from .hf.inputs import EvalSettings, eval_domain_batches, fit_settings
from .hf.memory import export_memory_refusal, plan_memory
from .hf.stream import token_batches_of
from .infra import arguments
from .infra.atomic import write_json, write_text
from .infra.atomic_folder import check_new_folder, folder_files, staged_folder, termination_unwinds
from .infra.envinfo import environment
from .infra.progress import progress_callback
from .planning import Plan, load_plan
from .planning.candidates import candidate_recipes, format_candidates, serve_candidates, serve_target
from .planning.job import make_plan
from .planning.planfile import model_fingerprint
from .planning.runtime_latency import check_runtimes
from .planning.sensitivity import check_plannable
from .planning.source import plan_needs
from .planning.target import DECODE_TOKENS, Objective, Target, Workload
from .recipe import Recipe, as_recipe
from .report.deploy import deploy_markdown

if TYPE_CHECKING:  # annotations only
    from .deploy.planned import PlannedModel
    from .hf.checkpoint import ModelInfo

__all__ = ["plan", "apply", "save", "check_plan_arguments", "PlanRequest", "plan_request", "PlanOutcome", "plan_model", "plan_memory_for", "DeployReport", "DEPLOY_DOC", "NOT_PROVEN_SUFFIX", "set_aside_unproven", "format_refusal",
           "write_deployment"]

Progress = Callable[[str, int, int], None]


def _terminable(fn: Callable) -> Callable:
    """`fn` with SIGTERM/SIGHUP unwinding it like Ctrl-C (`termination_unwinds`): no staging or scratch folder is
    left behind when a service stops a process inside the API."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with termination_unwinds():
            return fn(*args, **kwargs)

    return wrapper


def _model_info(model: Any, tokenizer: Any = None) -> tuple[Any, Path | None]:
    """(ModelInfo, the scratch folder a model object was saved to, or None for a folder)."""
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


def _texts(info: ModelInfo, text: Any, eval_text: Any, seq_len: int | None) -> int:
    """Read both texts now (a missing file is said before any work); the sequence length, capped at the model's."""
    require_transformers()
    read_text(text, "calibration")
    read_text(eval_text, "evaluation")
    return fit_settings(info, EvalSettings(seq_len=seq_len or DEFAULT_SEQ_LEN)).seq_len


def _check_common(*, text: Any, eval_text: Any, calib_tokens: Any, eval_tokens: Any, seq_len: Any, compute_dtype: Any,
                  tokenizer: Any, progress: Any) -> None:
    """The arguments `plan` and `apply` share, each checked as the command line checks it."""
    from .hf.corpus import TextSource

    arguments.text_source(text, "text", (TextSource,))
    arguments.text_source(eval_text, "eval_text", (TextSource,))
    arguments.count(calib_tokens, "calib_tokens")
    arguments.count(eval_tokens, "eval_tokens")
    arguments.count(seq_len, "seq_len", optional=True)
    arguments.one_of_type(compute_dtype, "compute_dtype", (str,), "'auto', 'float32', 'bfloat16' or 'float16'")
    if tokenizer is not None and not (hasattr(tokenizer, "save_pretrained") and callable(tokenizer)):
        raise FFNQuantError(f"tokenizer must be None or a transformers tokenizer (AutoTokenizer.from_pretrained), "
                            f"got {type(tokenizer).__name__}")
    progress_callback(progress)  # True, False, None or a callable


def check_plan_arguments(*, target: Any = "ppl+1%", objective: Any = None, runtime: Any = "ort-cpu", tokens: Any = 512,
                         decode_tokens: Any = None, candidates: Any = "default", format: Any = None, text: Any = None,
                         eval_text: Any = None, calib_tokens: Any = 4096, eval_tokens: Any = 4096, seq_len: Any = None,
                         probe_tokens: Any = 512, rounds: Any = 4, compute_dtype: Any = "auto", ort_floor: Any = True,
                         tokenizer: Any = None, progress: Any = True, max_memory: Any = None,
                         sequential: Any = False, serve: Any = None) -> int | None:
    """Every argument of `plan` checked by type and range before the model is read (the command line's checks:
    counts positive, sizes as '8GB'); returns max_memory in bytes."""
    arguments.one_of_type(target, "target", (str,), "a target text such as 'ppl+1%', 'kld<=0.01' or 'sqnr>=30'")
    arguments.one_of_type(objective, "objective", (str,), "'latency', 'bytes' or None", optional=True)
    arguments.one_of_type(runtime, "runtime", (str,), "a runtime name such as 'ort-cpu'")
    arguments.one_of_type(format, "format", (str,), "'compressed-tensors', 'onnx' or None", optional=True)
    arguments.one_of_type(serve, "serve", (str,), "'vllm-cpu' or None", optional=True)
    if serve is not None:
        serve_target(serve)
    arguments.count(tokens, "tokens")
    arguments.count(decode_tokens, "decode_tokens", minimum=0, optional=True)
    arguments.recipe_list(candidates, "candidates")
    arguments.count(probe_tokens, "probe_tokens")
    arguments.count(rounds, "rounds")
    arguments.flag(ort_floor, "ort_floor")
    arguments.flag(sequential, "sequential", optional=True)
    _check_common(text=text, eval_text=eval_text, calib_tokens=calib_tokens, eval_tokens=eval_tokens, seq_len=seq_len,
                  compute_dtype=compute_dtype, tokenizer=tokenizer, progress=progress)
    return arguments.size(max_memory, "max_memory")


@dataclass(frozen=True)
class PlanRequest:
    """What a plan is asked for, validated before any work: the target, the objective, the export format (None:
    any), the dtype the verification computes in, and the candidates the format leaves out (with its reasons)."""

    target: Any
    objective: Any
    format: str | None
    dtype: Any
    left_out: list
    serve: str | None = None


def plan_request(info: ModelInfo, target: str = "ppl+1%", objective: str | None = None, runtime: str = "ort-cpu",
                 tokens: int = 512, decode_tokens: int | None = None, candidates: Any = "default",
                 format: str | None = None, compute_dtype: str = "auto", serve: str | None = None) -> PlanRequest:
    """Every input error of a plan, said before the model is read: target, objective and runtime (a runtime that is
    not here is refused now), format, compute dtype, candidates. `ffnquant.plan` and `ffnquant plan` both call it."""
    goal = Target.parse(target)
    kind = objective or ("bytes" if info.n_experts else "latency")
    aim = Objective(kind, runtime, Workload(tokens, DECODE_TOKENS if decode_tokens is None else decode_tokens))
    check_plannable(info, aim)
    if aim.runtimes != ("ort-cpu",):
        if aim.kind != "latency":
            raise FFNQuantError(f"runtime {runtime} applies to the latency objective; the objective here is {aim.kind}")
        check_runtimes(aim.runtimes)  # no CUDA here: said now, before the model is read
    fmt = None if format is None else get_format(format)
    if aim.kind == "latency" and aim.runtimes == ("vllm-cpu",):
        if serve not in (None, "vllm-cpu"):
            raise FFNQuantError(f"--runtime vllm-cpu times the plan in vLLM's CPU build; --serve {serve} names another")
        serve = "vllm-cpu"  # timed where it is served: only what vLLM's CPU build runs is a candidate
    if aim.kind == "latency" and aim.runtimes == ("genai-cpu",):
        if serve is not None or fmt not in (None, "onnx"):
            given = f"--serve {serve}" if serve is not None else f"--format {fmt}"
            raise FFNQuantError(f"--runtime genai-cpu times the plan on its ONNX decoder in onnxruntime-genai; {given} "
                                "names a compressed-tensors deployment (give --format onnx or leave it out)")
        fmt = "onnx"  # timed where it is served: only what the ONNX decoder writes is a candidate
    if serve is not None:
        serve = serve_target(serve)
        if fmt not in (None, "compressed-tensors"):
            raise FFNQuantError(f"--serve {serve} serves compressed-tensors folders, not --format {fmt}")
        fmt = "compressed-tensors"
    dtype = resolve_compute_dtype(compute_dtype, fmt, info)
    recipes, _ = candidate_recipes(candidates, info.spec)
    # a format that refuses the model itself is said now, before any work; make_plan leaves the same ones out
    recipes, left_out = format_candidates(recipes, [], info, fmt) if fmt else (recipes, [])
    if serve is not None:
        left_out = serve_candidates(recipes, left_out, info, serve)[1]
    return PlanRequest(goal, aim, fmt, dtype, left_out, serve)


@dataclass
class PlanOutcome:
    """What planning one model gives: the `Plan`, its document (`plan.json`'s content: the rounds, the figures,
    the atlas) and the memory plan it ran under (`hf.memory.MemoryPlan`)."""

    plan: Any
    result: dict
    memory: Any


def plan_memory_for(info: ModelInfo, text: Any, eval_text: Any, settings: Any, *, probe_tokens: int, dtype: Any,
                    max_memory: Any = None, sequential: bool = False, target: Any = None) -> Any:
    """The memory plan of planning `info`'s model on these texts: the whole model resident, or a decoder layer at a
    time when it does not fit (or `sequential`); refused with the numbers, before any work, when neither fits. Given
    the `target`, a held-out text too small to verify it is refused first (`check_resolvable`)."""
    calib = token_batches_of(info, text, "calibration", settings, settings.max_calib_tokens)
    # every held-out domain, as the plan will read them (each up to its token budget)
    domains = eval_domain_batches(info, load_tokenizer(info.path), eval_text, settings, settings.max_eval_tokens, True)
    if target is not None:
        check_resolvable(domains, target, settings.seq_len)
    evals = [b for _, bs in domains for b in bs]
    needs = plan_needs(info, calib_tokens=sum(int(b.numel()) for b in calib),
                       eval_tokens=sum(int(b.numel()) for b in evals), probe_tokens=probe_tokens,
                       batch_tokens=int(calib[0].numel()), dtype=dtype)
    return plan_memory(info, needs, max_memory=max_memory, sequential=sequential)


def check_resolvable(domains: list, target: Any, seq_len: int) -> None:
    """Refuse, before any work, a held-out domain shorter than one --seq-len window: a handful of tokens samples
    neither the text's variety nor the positions the plan runs at, so no verdict on it means anything (and with one
    short sequence there is no interval either). The sqnr target compares hidden states and is refused alike."""
    for label, batches in domains:
        n = sum(int(b.numel()) for b in batches)
        if n < seq_len:
            raise FFNQuantError(f"not verified: {n:,} tokens of {label} cannot resolve {target}; at least {seq_len:,} "
                                "are needed (one --seq-len window of every held-out text; more narrow its 95% "
                                "interval): give a longer --eval-text (or eval_text), more --eval-tokens, or a "
                                "smaller --seq-len")


def plan_model(info: ModelInfo, req: PlanRequest, candidates: Any, *, text: Any, eval_text: Any, settings: Any,
               probe_tokens: int = 512, rounds: int = 4, ort_floor: bool = True, allow_pickle: bool = False,
               progress: Progress | None = None, executor: Any = None, max_memory: Any = None,
               sequential: bool = False, on_memory: Callable[[Any], None] | None = None) -> PlanOutcome:
    """Plan `info`'s model for the validated request `req` (`plan_request`): the memory plan (`on_memory` hears it
    before the long work starts), then `planning.make_plan`. `ffnquant.plan` and `ffnquant plan` both run this."""
    memory = plan_memory_for(info, text, eval_text, settings, probe_tokens=probe_tokens, dtype=req.dtype,
                             max_memory=max_memory, sequential=sequential, target=req.target)
    if on_memory is not None:
        on_memory(memory)
    the_plan, result = make_plan(info, req.target, req.objective, candidates, text=text, eval_text=eval_text,
                                 settings=settings, probe_tokens=probe_tokens, max_rounds=rounds, ort_floor=ort_floor,
                                 allow_pickle=allow_pickle, progress=progress, executor=executor, memory=memory,
                                 export_format=req.format, dtype=req.dtype, serve=req.serve)
    result["export_format"] = req.format
    result["target_model"] = current_target()  # a draft model's (`hf.draft`)
    result["serve"] = req.serve
    result["memory"] = memory.to_dict()
    return PlanOutcome(the_plan, result, memory)


@api_boundary
@_terminable
def plan(model: Any, target: str = "ppl+1%", *, objective: str | None = None, runtime: str = "ort-cpu",
         tokens: int = 512, decode_tokens: int | None = None, candidates: Any = "default", format: str | None = None,
         text: Any = None, eval_text: Any = None, calib_tokens: int = 4096, eval_tokens: int = 4096,
         seq_len: int | None = None, probe_tokens: int = 512, rounds: int = 4, compute_dtype: str = "auto",
         ort_floor: bool = True, tokenizer: Any = None, progress: Any = True, max_memory: Any = None,
         sequential: bool = False, device: Any = "auto", serve: str | None = None, target_model: Any = None):
    """A recipe per FFN layer of `model` (a folder or a transformers model) meeting `target` ('ppl+1%', 'kld<=0.01',
    'top1>=95%', 'sqnr>=30') at the least `objective` ('latency' on `runtime`, or 'bytes'), verified on held-out text:
    a `planning.Plan` (its `summary` has the verified figures; `Plan.to_toml` is plan.toml). `format`: plan only
    candidates that format ('compressed-tensors', 'onnx') can write; `serve` ('vllm-cpu'): only those that server
    runs (compressed-tensors implied). `max_memory` / `sequential`: a model that does
    not fit is read a decoder layer at a time, as `ffnquant plan` does. `progress`: a line per stage on stderr with the
    time left (True), silent (False) or `callable(message, done, total)`. `device`: where the model computes, a
    decoder layer at a time ('auto', 'cpu', 'cuda', 'cuda:N'; `infra.device`). `target_model`: for a draft model
    (Gemma 4's assistants), the folder of the model it drafts for (`hf.draft`). The other arguments are
    `ffnquant plan`'s."""
    max_memory = check_plan_arguments(
        target=target, objective=objective, runtime=runtime, tokens=tokens, decode_tokens=decode_tokens,
        candidates=candidates, format=format, text=text, eval_text=eval_text, calib_tokens=calib_tokens,
        eval_tokens=eval_tokens, seq_len=seq_len, probe_tokens=probe_tokens, rounds=rounds, compute_dtype=compute_dtype,
        ort_floor=ort_floor, tokenizer=tokenizer, progress=progress, max_memory=max_memory, sequential=sequential,
        serve=serve)
    device = resolve_device(device)  # before the model is read
    check_target(target_model)
    info, scratch = _model_info(model, tokenizer)
    try:
        with use_device(device), use_target(target_model):
            req = plan_request(info, target, objective, runtime, tokens, decode_tokens, candidates, format, compute_dtype,
                               serve)
            settings = EvalSettings(seq_len=_texts(info, text, eval_text, seq_len), max_calib_tokens=calib_tokens,
                                    max_eval_tokens=eval_tokens, ablation=False)
            return plan_model(info, req, candidates, text=text, eval_text=eval_text, settings=settings,
                              probe_tokens=probe_tokens, rounds=rounds, ort_floor=ort_floor,
                              progress=progress_callback(progress), max_memory=max_memory, sequential=sequential).plan
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)


@api_boundary
@_terminable
def apply(model: Any, plan_or_recipe: Any, *, format: str = "compressed-tensors", text: Any = None,
          eval_text: Any = None, calib_tokens: int = 4096, eval_tokens: int = 4096, seq_len: int | None = None,
          compute_dtype: str = "auto", tokenizer: Any = None, progress: Any = True, device: Any = "auto",
          max_memory: Any = None, target_model: Any = None):
    """`model` (a folder or a transformers model) quantized as `plan_or_recipe` says (a Plan, a plan.toml path, or
    one recipe such as 'w8a16' for every layer), for `format`: a `deploy.PlannedModel`, the deployable model with
    ffnquant's reference figures on `eval_text`, which `save` writes. `progress` and `device`: as `plan`'s.
    `max_memory` (bytes, or a size such as '16GB'): the budget the whole model held in memory is checked against
    before it is read (`hf.memory.export_memory_refusal`; default what the machine has available). `target_model`:
    as `plan`'s (the PlannedModel keeps its target for `save`'s proof)."""
    arguments.one_of_type(format, "format", (str,), "'compressed-tensors' or 'onnx'")
    if not isinstance(plan_or_recipe, (Plan, Path, str, Recipe)):
        raise FFNQuantError(f"plan_or_recipe: expected a Plan, a plan.toml path or a recipe such as 'w8a16', got "
                            f"{type(plan_or_recipe).__name__}")
    _check_common(text=text, eval_text=eval_text, calib_tokens=calib_tokens, eval_tokens=eval_tokens, seq_len=seq_len,
                  compute_dtype=compute_dtype, tokenizer=tokenizer, progress=progress)
    fmt = get_format(format)
    max_memory = arguments.size(max_memory, "max_memory")
    device = resolve_device(device)  # before the model is read
    check_target(target_model)
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
        with use_device(device), use_target(target_model):  # the estimate counts the target too
            why = export_memory_refusal(info, max_memory)
            if why is not None:
                raise FFNQuantError(why)
            whole, graph_why = format_refusal(info, the_plan, fmt)
            dtype = resolve_compute_dtype(compute_dtype, fmt, info)
            planned = build_planned_model(info, the_plan, text=text, eval_text=eval_text, calib_tokens=calib_tokens,
                                          eval_tokens=eval_tokens, seq_len=_texts(info, text, eval_text, seq_len),
                                          whole_model=whole, progress=progress_callback(progress), dtype=dtype,
                                          fmt=fmt)
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    planned.settings["format"] = {"name": fmt, "whole": whole, "graph_why": graph_why}
    if scratch is not None:  # save() reads the source folder (sizes, proof): kept while the model lives
        weakref.finalize(planned, shutil.rmtree, scratch, True)
    return planned


@api_boundary
@_terminable
def save(qmodel: Any, out: str | Path, *, force: bool = False, progress: Any = True):
    """Write `qmodel` (from `apply`) into the new folder `out` in the format it was applied for, load it back and
    prove it; a `DeployReport` (the folder, `proven`, `weight_bytes`, the whole document). Nothing is
    left half-written; `force` replaces only what an earlier save or export listed in its ffnquant-deploy.json.
    `progress`: as `plan`'s."""
    arguments.out_path(out, "out")
    arguments.flag(force, "force")
    progress = progress_callback(progress)
    settings = getattr(qmodel, "settings", None)
    fmt = settings.get("format") if isinstance(settings, dict) else None
    if fmt is None:
        raise FFNQuantError(f"save takes the model ffnquant.apply returns, got {type(qmodel).__name__}")
    if fmt["name"] == "onnx" and not fmt["whole"]:
        raise FFNQuantError(f"this model's whole ONNX graph cannot be written ({fmt['graph_why']}); its per-layer "
                            "artifacts are written by `ffnquant export --format onnx`")
    check_new_folder(out, force, inputs=[qmodel.info.path], listing=DEPLOY_DOC)
    with staged_folder(out, force, listing=DEPLOY_DOC) as folder:
        doc = write_deployment(qmodel, folder, fmt["name"], whole=fmt["whole"], graph_why=fmt["graph_why"],
                               command="ffnquant.save", progress=progress)
    report = DeployReport(Path(out), doc)
    if report.proven is False:  # never left where a deployment is expected (`set_aside_unproven`)
        report = DeployReport(set_aside_unproven(Path(out)), doc)
    return report


NOT_PROVEN_SUFFIX = ".not-proven"


def set_aside_unproven(folder: Path) -> Path:
    """A written folder whose proof failed, renamed to the first free `FOLDER.not-proven` (`-2`, `-3`, ...): kept as
    the evidence the proof read, under a name that says it is not a deployment; the new path."""
    n = 1
    while True:
        target = folder.with_name(folder.name + NOT_PROVEN_SUFFIX + ("" if n == 1 else f"-{n}"))
        if not os.path.lexists(target):
            break
        n += 1
    try:
        os.replace(folder, target)
    except OSError as exc:
        raise FFNQuantError(f"the export in {str(folder)!r} is NOT PROVEN and could not be renamed to "
                            f"{str(target)!r} ({exc.strerror or exc}): do not deploy it") from None
    return target


# --- writing a planned model: one place for ffnquant.save and `ffnquant export --plan` ------------
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


def format_refusal(info: ModelInfo, plan: Plan, fmt: str) -> tuple[bool, str | None]:
    """(whether the whole model is written, why the whole-model graph is not) for `fmt`; raises FFNQuantError, in
    one line, where the format cannot take this plan of this model at all."""
    if fmt == "compressed-tensors":
        from .deploy import ctensors
        from .planning.sensitivity import check_plannable

        check_plannable(info)
        ok, why_missing = ctensors.ctensors_available()
        for why in (deployable_refusal(info), None if ok else why_missing, ctensors.plan_refusal(plan, info)):
            if why is not None:
                raise FFNQuantError(why)
        return True, None

    graph_why = onnx_model.graph_refusal(info)
    return graph_why is None, graph_why


def layer_rows(planned: PlannedModel, folder: Path) -> list[dict[str, Any]]:
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


def write_deployment(planned: PlannedModel, folder: Path, fmt: str, *, whole: bool, graph_why: str | None = None,
                     command: str | None = None, plan_file: str | None = None,
                     progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Write `planned` as `fmt` into `folder` (staged by the caller), prove it, and write the document; returns
    the document. Raises FFNQuantError where the folded norms do not reproduce the original model."""
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
           "texts": {**{k: planned.settings[k] for k in ("calibration", "evaluation")},
                     "calibration_read": planned.settings.get("calibration_read", True)},
           "token_budgets": planned.settings.get("token_budgets") or {},
           "reference": planned.reference["end_to_end"], "baseline": planned.reference["baseline"],
           "layers": layer_rows(planned, folder), "target_model": target_of(planned.float_model)}
    if fold is not None:
        doc["fold"] = fold.to_dict()
    tick(f"export: {steps[1]}", 1, len(steps))
    if fmt == "compressed-tensors":
        from .deploy import ctensors

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


def _write_onnx(planned: PlannedModel, folder: Path, doc: dict[str, Any], whole: bool, graph_why: str | None) -> int:
    """manifest.json and, where the model allows, the whole-model graph scored on onnxruntime; the weight bytes of
    what was written (the graph, else the per-layer artifacts the caller had written into `folder`)."""
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
