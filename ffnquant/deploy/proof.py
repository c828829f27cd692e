"""What proves an export without sharing its mistakes: every figure is taken against the ORIGINAL float model.

An export folds each FFN's input scale (SmoothQuant, AWQ) into the norm `hf.fold` finds before it, then proves
the written model. A proof measured on ffnquant's own folded model inherits the fold's mistake: with the wrong
norm scaled, the deployed model and that "reference" agree with each other and not with the float model. So:

- `fold_check`, before anything is written: the folded model with FLOAT FFN weights (the exported norms, each
  FFN's input columns divided by its scale, nothing quantized) against the original model's logits and final
  hidden state on the held-out batches. In exact arithmetic they are equal; `fold_bound` is what float32
  rounding allows, and `fold_refusal` turns a miss into a one-line refusal naming the layers and norms.
- `rounding_allowance`: how far float32 rounding alone moves ffnquant's reference figures (perplexity ratio,
  final hidden SQNR, KL), measured on the original model with the unfolded quantized FFNs installed.
- `end_to_end_gates`: a deployed model's figures against that reference, each gated within twice the allowance.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ..errors import first_line
from ..hf import compare_models, load_ffn_layers
from ..hf.arch import ModelKind
from ..hf.draft import is_fed
from ..hf.capture import _module_for, ffn_input_hooks, install_ffns
from ..hf.fold import _Diff, with_input_transform
from ..hf.metrics import ErrorStats, _final_hidden, _run
from ..methods.awq import AWQRecord
from ..numerics.remedies import ChannelScale
from .precision import dtype_name, rounding_step

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo
    from ..methods.fakequant import QuantizedFFN
    from .planned import PlannedModel

__all__ = ["ULP", "FOLD_ULPS", "GATE_FACTOR", "fold_bound", "input_scale", "FoldCheck", "fold_check", "fold_refusal",
           "unfolded_ffns", "generation_equality", "rounding_allowance", "end_to_end_gates", "PLAIN_GREEDY"]

ULP = 2.0 ** -24  # float32's unit roundoff
# transformers' generate() as plain greedy decoding, whatever the model's generation_config.json adds (PLBart
# forces EOS at the last step; others penalise repeats or suppress tokens): what every greedy loop compared
# with it computes
PLAIN_GREEDY = {"forced_eos_token_id": None, "forced_bos_token_id": None, "repetition_penalty": 1.0,
                "no_repeat_ngram_size": 0, "encoder_no_repeat_ngram_size": 0, "bad_words_ids": None,
                "suppress_tokens": None, "begin_suppress_tokens": None, "sequence_bias": None}
# Fold bound: float32 roundoffs per block (see fold_bound for the measured figures behind it).
FOLD_ULPS = 2.0 ** 10
# A deployed figure may be worse than the reference by this many times the rounding spread (two independent
# roundings of one quantized model, each as far as the spread from the reference).
GATE_FACTOR = 2.0
# How closely the unfolded rebuild must reproduce ffnquant's recorded reference (the same computation: only the
# summation order of the float perplexity differs).
_REPRODUCE = 1e-9


def fold_bound(n_layers: int) -> float:
    """The relative difference (max |a - b| / max |a|) float32 rounding allows between the folded float model and
    the original: FOLD_ULPS units of float32 roundoff (2^-24) per block, the blocks' errors adding up through the
    residual stream. The fold is exact in real arithmetic and moves one rounding per channel (x * c into the norm's
    gain, W / c into the weights). Measured per block: a correct fold 1.1 (SmolLM2-135M, 30 blocks: 2.1e-6) to
    3.3 ulps (14 model types of tests/hf_models.py, 2 blocks: at most 4.0e-7); a fold into the attention's norm
    instead 7e5 (SmolLM2: 1.31) to 2e6 ulps (tiny models: 0.24-1.2). 2^10 sits ~300x above the first and ~700x
    below the second."""
    return FOLD_ULPS * max(1, n_layers) * ULP


def input_scale(qffn: QuantizedFFN) -> torch.Tensor | None:
    """The per-channel multiply x * c a layer's recipe put on its FFN input (SmoothQuant's, then AWQ's, composed
    as applied), from its remedy records; None without one. The planned model keeps its QuantizedFFNs with the
    scale folded away (an identity input_transform), so the records are what says what was folded."""
    c = None
    for rec in getattr(qffn, "remedies", ()):
        if isinstance(rec, AWQRecord):
            s = rec.scales.get("input")
            if s is not None:  # awq.apply_scales: ChannelScale(prior / s)
                s = s.detach().float()
                c = (torch.ones_like(s) if c is None else c) / s
        elif getattr(rec, "kind", None) == "smooth" and "input" in rec.details:
            # remedies.smooth records the whole composed scale (prior / s) as float32 values: exact round trip
            c = torch.tensor(rec.details["input"]["input_scale_to_fold_into_norm"], dtype=torch.float32)
    return c


def _divided(ffn: Any, scale: torch.Tensor) -> Any:
    """The float FFN reading x * c: its input columns divided by c (w_up, w_gate), nothing quantized."""
    new = copy.deepcopy(ffn)
    with torch.no_grad():
        for lin in (new.w_up, new.w_gate):
            if lin is not None:
                lin.weight.div_(scale[None, :].to(lin.weight.dtype))
    return new


def _outputs(model: Any, info: ModelInfo, ids: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(logits or None, final hidden state) of one batch."""
    out = _run(model, info, ids)
    return (out.logits if info.kind is ModelKind.CAUSAL_LM else None), _final_hidden(info, out)


@dataclass(frozen=True)
class FoldCheck:
    """The folded float model against the original (see the module docstring). `folded`: the layers whose input
    scale went into a norm; `norms`: layer -> the module(s) the export changed for it (found from the weights, not
    from the architecture's data); figures are None when nothing was folded. `culprits`, on a miss: per folded
    layer, the module its FFN really reads (the one whose output is, bit for bit, the FFN's input) and how far that
    module's output in the exported model is from the original's times the scale, on one held-out sequence."""

    folded: tuple[str, ...]
    norms: Mapping[str, tuple[str, ...]]
    bound: float
    n_layers: int
    tokens: int = 0
    logits_max_rel: float | None = None
    logits_mean_rel: float | None = None
    hidden_max_rel: float | None = None
    hidden_sqnr_db: float | None = None
    culprits: tuple[Mapping[str, Any], ...] = field(default_factory=tuple)

    @property
    def exact(self) -> bool:
        figures = [f for f in (self.logits_max_rel, self.hidden_max_rel) if f is not None]
        return all(f <= self.bound for f in figures)

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "norms": {k: list(v) for k, v in self.norms.items()},
                "culprits": [dict(c) for c in self.culprits], "exact": self.exact,
                "relative": "max |a - b| / max |a| over every logit (final hidden value) of every held-out token",
                "bound_why": f"2^{int(math.log2(FOLD_ULPS))} float32 roundoffs (2^-24) per block x {self.n_layers} blocks"}


def _ffn_modules(model: Any, info: ModelInfo) -> dict[str, str]:
    """Layer label -> the FFN module's name in the loaded model."""
    names = [n for n, _ in model.named_modules()]
    return {layer.label: _module_for(model, info, layer, names)[0] for layer in info.layers}


def _changed_modules(planned: PlannedModel, ffn_modules: Sequence[str], original32: Any) -> list[str]:
    """The modules outside the FFNs whose parameters the export changed (the norms that took the scales)."""
    original = dict(original32.named_parameters())
    inside = tuple(name + "." for name in ffn_modules)
    changed = {name.rpartition(".")[0] for name, p in planned.model.named_parameters()
               if not name.startswith(inside) and name in original and not torch.equal(p, original[name])}
    return sorted(changed)


def _nearest(name: str, candidates: Sequence[str]) -> tuple[str, ...]:
    """The candidates sharing the longest dotted prefix with `name` (a block's norms with its FFN)."""
    def shared(other: str) -> int:
        n = 0
        for a, b in zip(name.split("."), other.split(".")):
            if a != b:
                break
            n += 1
        return n

    best = max((shared(c) for c in candidates), default=0)
    return tuple(c for c in candidates if best and shared(c) == best)


def fold_check(planned: PlannedModel) -> FoldCheck:
    """The planned model's folded norms with float FFNs (each planned input scale divided out of its input
    columns) against the original float model on the held-out batches; `culprits` measured when over the bound."""
    info = planned.info
    order = {layer.label: i for i, layer in enumerate(info.layers)}
    scales = {label: input_scale(q) for label, q in planned.qffns.items()}
    folded = tuple(sorted((k for k, c in scales.items() if c is not None), key=lambda k: order.get(k, 0)))
    bound = fold_bound(info.n_layers)
    base = dict(bound=bound, n_layers=info.n_layers)
    if not folded:
        return FoldCheck(folded=(), norms={}, **base)
    original = planned.float32_model()  # float32 rounding is what the bound allows, whatever the runtime's dtype
    ffn_modules = _ffn_modules(planned.model, info)
    changed = _changed_modules(planned, list(ffn_modules.values()), original)
    norms = {label: _nearest(ffn_modules[label], changed) for label in folded}
    floats = {layer.info: _divided(layer.ffn, scales[layer.label]) if layer.label in folded else layer.ffn
              for layer in load_ffn_layers(info, "all")}
    logits, hidden, sqnr = _Diff(), _Diff(), ErrorStats()
    for ids in planned.evals:
        ref_logits, ref_hidden = _outputs(original, info, ids)
        with install_ffns(planned.model, info, floats):
            got_logits, got_hidden = _outputs(planned.model, info, ids)
        if ref_logits is not None:
            logits.update(ref_logits, got_logits)
        hidden.update(ref_hidden, got_hidden)
        sqnr.update(ref_hidden, got_hidden)
    has_logits = logits.max_ref > 0
    check = FoldCheck(folded=folded, norms=norms, **base, tokens=sum(int(b.numel()) for b in planned.evals),
                      logits_max_rel=logits.to_dict()["max_rel_diff"] if has_logits else None,
                      logits_mean_rel=logits.to_dict()["mean_rel_diff"] if has_logits else None,
                      hidden_max_rel=hidden.to_dict()["max_rel_diff"], hidden_sqnr_db=sqnr.sqnr_db)
    if check.exact:
        return check
    return dataclasses.replace(check, culprits=_culprits(planned, folded, scales, norms, bound, original))


def _culprits(planned: PlannedModel, folded: Sequence[str], scales: Mapping[str, torch.Tensor],
              norms: Mapping[str, tuple[str, ...]], bound: float, original: Any) -> tuple[dict[str, Any], ...]:
    """Per folded layer, with no error carried from earlier layers: the module whose output the FFN reads in the
    original model (`_reads`), fed the input it had there, in the exported model against the original's output
    times the layer's scale. The layers over the bound, or reading no module's output, are the culprits."""
    info = planned.info
    ids = planned.evals[0][:1, :64]
    reads = _reads(original, info, ids)
    rows = []
    for label in folded:
        row = {"layer": label, "norm": list(norms.get(label, ())), "ffn_reads": None, "max_rel_diff": None}
        if label in reads:
            name, args, out = reads[label]
            with torch.no_grad():
                got = planned.model.get_submodule(name)(*args)
            want = out.double() * scales[label].double()
            row.update(ffn_reads=name,
                       max_rel_diff=float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)))
        if row["max_rel_diff"] is None or row["max_rel_diff"] > bound:
            rows.append(row)
    return tuple(rows)


def _reads(model: Any, info: ModelInfo, ids: torch.Tensor) -> dict[str, tuple[str, tuple, torch.Tensor]]:
    """Layer label -> (the module whose output is, bit for bit, the FFN's input, its positional inputs, its
    output), leaf modules first; a layer whose FFN reads no module's output (a residual sum, a bare operation)
    is absent."""
    d = info.spec.d_model
    got: dict[str, torch.Tensor] = {}
    seen: dict[str, tuple[tuple, torch.Tensor]] = {}

    def keep(name):
        def hook(mod, args, out):
            if isinstance(out, torch.Tensor) and out.shape[-1] == d and name not in seen:
                seen[name] = (tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args), out.detach())
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in model.named_modules() if n]
    try:
        with torch.no_grad(), ffn_input_hooks(model, info, list(info.layers), lambda l, x: got.setdefault(l.label, x)):
            model(ids)
    finally:
        for h in handles:
            h.remove()
    leaves = {n for n, m in model.named_modules() if not any(True for _ in m.children())}
    out: dict[str, tuple[str, tuple, torch.Tensor]] = {}
    for label, x in got.items():
        hits = sorted((n for n, (_, o) in seen.items() if o.numel() == x.numel()
                       and torch.equal(o.reshape(-1, d).float(), x)), key=lambda n: (n not in leaves, n))
        if hits:
            out[label] = (hits[0], *seen[hits[0]])
    return out


def fold_refusal(check: FoldCheck, info: ModelInfo) -> str | None:
    """The one-line refusal of a fold that changes the float model beyond float32 rounding, naming the layers,
    the modules that took their scales and what their FFNs read; None when the fold is exact."""
    if check.exact:
        return None
    what = (f"logits {check.logits_max_rel:.3g}, " if check.logits_max_rel is not None else "")
    what += f"final hidden {check.hidden_max_rel:.3g}"
    parts = []
    for r in check.culprits[:3]:
        into = " and ".join(r["norm"]) or "no module"
        reads = (f"its FFN reads {r['ffn_reads']} ({r['max_rel_diff']:.2g} from its output times the scale)"
                 if r["ffn_reads"] else "its FFN reads no module's output (no norm of its own to fold into)")
        parts.append(f"{r['layer']}: scale folded into {into}, {reads}")
    if not parts:
        parts = [f"no single layer's norm accounts for it (folded into {', '.join(sorted({n for v in check.norms.values() for n in v}))})"]
    more = f" and {len(check.culprits) - 3} more layers" if len(check.culprits) > 3 else ""
    return (f"the FFN input scales folded into the norms change the float model: {what} relative to the original "
            f"(max |a - b| / max |a|; float32 rounding allows {check.bound:.1e}); {'; '.join(parts)}{more}. Nothing "
            f"written: a scale folds only into the norm whose output is its FFN's input and nothing else's (hf.fold, "
            f"{info.arch.name}); plan these layers without +smooth and AWQ to export this model")


# --- how finely the end-to-end figures can be matched, measured on the original model -------------------------

_FIGURES = ("perplexity_ratio", "hidden_sqnr_db", "kl_mean")


def _figures(fig: Mapping[str, Any]) -> dict[str, float | None]:
    kl = fig.get("kl") or {}
    return {"perplexity_ratio": fig.get("perplexity_ratio"), "hidden_sqnr_db": fig.get("hidden_sqnr_db"),
            "kl_mean": kl.get("mean")}


def _difference(name: str, got: float, ref: float) -> float:
    """How far `got` is from `ref`: relative for the perplexity ratio, in the figure's own unit otherwise."""
    return abs(got / ref - 1.0) if name == "perplexity_ratio" else abs(got - ref)


def _run_figures(planned: PlannedModel, ffns: Mapping[Any, Any], refs: Sequence[Any], delta: float) -> dict[str, Any]:
    """The original model with `ffns` installed, its first block's input scaled by 1 + delta, scored."""
    model = planned.float_model
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, out: out * (1.0 + delta))
    try:
        with install_ffns(model, planned.info, ffns):
            fig = compare_models(None, model, planned.info, planned.evals, references=refs)
    finally:
        hook.remove()
    return {"input_scale": 1.0 + delta, **_figures(fig)}


def unfolded_ffns(planned: PlannedModel) -> dict[Any, Any]:
    """The plan's quantized FFNs by LayerInfo, each doing its input multiply itself (unfolded, as measured): what
    installed in the ORIGINAL float model is ffnquant's reference of the plan."""
    by_label = {layer.label: layer for layer in planned.info.layers}
    ffns = {}
    for label, q in planned.qffns.items():
        c = input_scale(q)
        ffns[by_label[label]] = q if c is None else with_input_transform(q, by_label[label], ChannelScale(c))
    return ffns


def generation_equality(planned: PlannedModel, loaded: Any, prompts: int = 4, prompt_tokens: int = 16,
                        new_tokens: int = 24, ffns: Mapping[Any, Any] | None = None) -> dict[str, Any]:
    """Greedy generation with a KV cache (transformers' `generate`) of a loaded deployed model against ffnquant's
    reference of the plan (the original float model with `unfolded_ffns` installed), on `prompts` prompts cut
    from the held-out batches (run as one batch): the tokens of both, and whether they are equal token for token.
    `ffns`: the `unfolded_ffns` when the caller has them (or those FFNs as a format's convention computes them)."""
    if is_fed(planned.float_model):  # its drafts are what the end-to-end figures measure, position by position
        return {"prompts": 0, "new_tokens": new_tokens, "equal": 0, "all_equal": False, "tokens_compared": 0,
                "with_cache": True, "rows": [],
                "skipped": "a draft model generates only inside its target's assisted generation, where the target "
                           "decides every token; its drafting steps are compared position by position instead "
                           "(top-1 agreement, KL)"}
    ids = torch.cat([b.reshape(-1) for b in planned.evals])
    cuts = [ids[i * prompt_tokens:(i + 1) * prompt_tokens].tolist() for i in range(prompts)
            if (i + 1) * prompt_tokens <= ids.numel()]

    def generate(model: Any, prompts: list[list[int]]) -> list[list[int]]:
        # the prompts as one batch (all `prompt_tokens` long: no padding): one decode step for all of them, where
        # the per-step cost of a loaded compressed-tensors model is mostly its modules' Python hooks
        if not prompts:
            return []
        eos = getattr(model.config, "eos_token_id", None)
        pad = getattr(model.config, "pad_token_id", None)
        pad = pad if pad is not None else (eos if isinstance(eos, int) else 0)
        ids = torch.tensor(prompts)
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=1,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=pad,
                                 **PLAIN_GREEDY)
        return out[:, ids.shape[1]:].tolist()

    try:  # transformers' own generate may fail on a model class (BartForCausalLM's cache): then nothing is compared
        generate(planned.float_model, cuts[:1])
    except Exception as exc:  # noqa: BLE001 - the original model, untouched: transformers' failure, said as such
        return {"prompts": 0, "new_tokens": new_tokens, "equal": 0, "all_equal": False, "tokens_compared": 0,
                "with_cache": True, "rows": [],
                "skipped": f"transformers' generate fails on the original model: {type(exc).__name__}: "
                           f"{first_line(exc)}"}
    with install_ffns(planned.float_model, planned.info, ffns if ffns is not None else unfolded_ffns(planned)):
        refs = generate(planned.float_model, cuts)
    rows = []
    for p, got, ref in zip(cuts, generate(loaded, cuts), refs):
        first = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
        rows.append({"prompt": p, "deployed": got, "reference": ref, "equal": got == ref, "first_difference": first})
    return {"prompts": len(rows), "new_tokens": new_tokens, "equal": sum(r["equal"] for r in rows),
            "all_equal": all(r["equal"] for r in rows), "tokens_compared": sum(len(r["reference"]) for r in rows),
            "with_cache": True, "rows": rows}


def rounding_allowance(planned: PlannedModel, references: Sequence[Any] | None = None,
                       numerics: Callable[[Any], Any] | None = None, numerics_name: str | None = None,
                       ffns: Mapping[Any, Any] | None = None, deployed: Mapping[str, Any] | None = None,
                       ppl_tolerance: float = 0.0) -> dict[str, Any]:
    """How far rounding alone moves ffnquant's reference figures on this text: the ORIGINAL float model
    with the plan's quantized FFNs installed, each doing its input multiply itself (unfolded, as measured), its
    first block's input scaled by 1 and 1 +- one rounding step of the dtype the model computes in
    (`precision.rounding_step`: 2^-23 in float32, 2^-7 in bf16).

    Static activation codes near a rounding boundary flip under any one-ulp change and the later layers' noise
    is redrawn: two computations of one quantized model that differ only in rounding cannot be told apart more
    finely than the spread of these runs (`spread`: relative for the perplexity ratio, dB, nats). The run at 1
    must reproduce the recorded reference (`reproduces_reference`), else the allowance belongs to another model.

    `numerics(qffn) -> module`: the FFN as a format computes it where that differs from ffnquant's numerics by a
    stated convention (`numerics_name`); the runs at 1 +- one step and the `reference` are then of that computation
    on the same original model, and `convention_cost` is what it moves the figures from ffnquant's reference.
    `references`: the original model's kept batches (`hf.evaluate.float_reference`), computed when None; `ffns`:
    the `unfolded_ffns` when the caller has them. `deployed`: the deployed model's figures (`hf.compare_models`);
    when they meet every `end_to_end_gates` gate against the reference itself (a spread of 0, perplexity within
    `ppl_tolerance`), a larger allowance changes no verdict, so the runs at 1 +- one step are not made
    (`spread_measured` False, the spread 0)."""
    step = rounding_step(planned.compute_dtype)
    ffns = ffns if ffns is not None else unfolded_ffns(planned)
    refs = references if references is not None else planned.references()
    plain = _run_figures(planned, ffns, refs, 0.0)
    recorded = _figures(planned.reference["end_to_end"])
    gaps = {k: _difference(k, plain[k], recorded[k]) for k in _FIGURES
            if plain[k] is not None and recorded[k] is not None}
    # the SQNR and KL of the run at 1 are the reference's own numbers recomputed: relative to their size
    size = {k: 1.0 if k == "perplexity_ratio" else max(1e-12, abs(recorded[k])) for k in gaps}
    out: dict[str, Any] = {"measured_on": "the original float model with the unfolded quantized FFNs",
                           "compute_dtype": dtype_name(planned.compute_dtype), "step": step,
                           "reference_gap": gaps,
                           "reproduces_reference": all(g <= _REPRODUCE * size[k] for k, g in gaps.items()),
                           "convention": None}
    if not out["reproduces_reference"]:  # why not: a second plain run tells a forward that draws at random
        again = _run_figures(planned, ffns, refs, 0.0)
        drawn = {k: _difference(k, again[k], plain[k]) for k in gaps if again[k] is not None}
        out["deterministic"] = all(v == 0.0 for v in drawn.values())
        if not out["deterministic"]:
            out["random_spread"] = drawn
    if numerics is not None:
        ffns = {layer: numerics(q) for layer, q in ffns.items()}
        at_one = _run_figures(planned, ffns, refs, 0.0)
        out.update(convention=numerics_name, convention_cost={k: at_one[k] - plain[k] for k in _FIGURES
                                                              if at_one[k] is not None})
    else:
        at_one = plain
    if deployed is not None and out.get("deterministic", True):
        zero = {**out, "runs": [at_one], "spread": {k: 0.0 for k in _FIGURES if at_one[k] is not None},
                "reference": {k: v for k, v in at_one.items() if k in _FIGURES}, "spread_measured": False}
        if end_to_end_gates(deployed, zero, ppl_tolerance)["met"]:
            return zero
    runs = [at_one] + [_run_figures(planned, ffns, refs, d) for d in (step, -step)]
    spread = {k: max(_difference(k, r[k], at_one[k]) for r in runs[1:]) for k in _FIGURES if at_one[k] is not None}
    if not out.get("deterministic", True):
        # the model's own forward draws at random on each run (Reformer's LSH hashing without a seed): the recorded
        # reference is one draw among these runs, reproduced when it lies within what the gates allow a deployed
        # folder, twice the runs' spread or the load tolerance (each run at 1 +- one step draws anew, so their
        # spread holds the draws; a handful of draws bounds the next one only loosely, hence the tolerance too)
        spread = {k: max(v, out["random_spread"].get(k, 0.0)) for k, v in spread.items()}
        out["reproduces_reference"] = all(
            g <= max(GATE_FACTOR * spread.get(k, 0.0), _tolerance(k, recorded[k], ppl_tolerance), _REPRODUCE * size[k])
            for k, g in gaps.items())
    return {**out, "runs": runs, "spread": spread, "reference": {k: v for k, v in at_one.items() if k in _FIGURES},
            "spread_measured": True}


def _tolerance(name: str, reference: float, ppl_tolerance: float) -> float:
    """The load tolerance in figure `name`'s unit. The same relative tolerance for every figure as for the
    perplexity: a deployment's arithmetic flips the static codes at a rounding tie (a folded norm, another kernel's
    order of sums), which one-step perturbations of the reference may not reach (a tiny Gemma 2 on an Intel Xeon:
    0.00024 dB of final hidden SQNR against a measured spread of 1e-6 dB); a folder that is wrong moves the figures
    by orders more (random experts: 13 dB)."""
    if name == "perplexity_ratio":
        return ppl_tolerance
    if name == "hidden_sqnr_db":
        return 10.0 * math.log10(1.0 + ppl_tolerance)  # the noise energy that much larger
    return ppl_tolerance * abs(reference)


_WORSE = {  # how a deployed figure is worse than the reference, in the spread's unit
    "perplexity_ratio": lambda got, ref: abs(got / ref - 1.0),  # either way: the figure must be reproduced
    "hidden_sqnr_db": lambda got, ref: ref - got,
    "kl_mean": lambda got, ref: got - ref,
}


def end_to_end_gates(figures: Mapping[str, Any], allowance: Mapping[str, Any], ppl_tolerance: float) -> dict[str, Any]:
    """Each end-to-end figure of a deployed model (`hf.compare_models` against the original float model) against
    the reference `rounding_allowance` measured on the original model (ffnquant's reference of the plan, or its
    stated convention): perplexity ratio within `ppl_tolerance` relative or twice its rounding spread; final
    hidden SQNR no more than twice its spread lower or its noise energy `ppl_tolerance` relative larger; mean KL no
    more than twice its spread or `ppl_tolerance` relative higher. `met`: every
    gate holds and the allowance's plain run reproduced ffnquant's recorded reference."""
    got, ref = _figures(figures), allowance["reference"]
    rows = []
    for name in _FIGURES:
        if got[name] is None or ref[name] is None:
            continue
        spread = allowance["spread"].get(name, 0.0)
        allowed = max(GATE_FACTOR * spread, _tolerance(name, ref[name], ppl_tolerance))
        worse = _WORSE[name](got[name], ref[name])
        rows.append({"figure": name, "deployed": got[name], "reference": ref[name], "worse_by": worse,
                     "rounding_spread": spread, "allowed": allowed, "met": worse <= allowed})
    return {"gates": rows, "reproduces_reference": bool(allowance.get("reproduces_reference")),
            "convention": allowance.get("convention"),
            "met": bool(rows) and all(r["met"] for r in rows) and bool(allowance.get("reproduces_reference"))}
