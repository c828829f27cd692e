"""What a real model's FFN layers are quantized and measured on: each layer's captured inputs.

`capture_whole` runs the model on a calibration text and a different evaluation text (or reads
files saved by `ffnquant model capture`) and keeps each FFN's inputs by layer label (`LayerInputs`);
`EvalSettings` is the token budget and batching; `model_file_stem` names a model's files.
"""

from __future__ import annotations

import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch

from ..errors import FFNQuantError
from . import capture as _capture
from .capture import iter_captured, iter_captured_files, load_tokenizer, model_text_batches
from .checkpoint import HFLayer, ModelInfo
from .corpus import TextSource, shipped_corpora, source_items

__all__ = ["EvalSettings", "LayerInputs", "capture_whole", "file_inputs", "fit_settings", "model_file_stem",
           "token_budget"]


def token_budget(split: str, requested: int | None, batches: Sequence[torch.Tensor] | None,
                 source: str) -> dict[str, Any]:
    """Requested against obtained tokens of a text run through the model: {split, source, requested,
    obtained, short, note}. `short` when the text gives fewer tokens than requested (the count then is
    what the text yields); `note` says so in words, and how to give more text."""
    obtained = sum(int(b.numel()) for b in batches or [])
    short = requested is not None and obtained < requested
    note = None
    if short:
        note = (f"{split} text {source} gives {obtained:,} tokens, fewer than the {requested:,} requested (the text "
                "is too short): give a longer text or several files (repeat the option or comma-separate them)")
    return {"split": split, "source": source, "requested": requested, "obtained": obtained, "short": short,
            "note": note}


@dataclass(frozen=True)
class EvalSettings:
    """Token budget and batching of a model evaluation. Frozen and validated."""

    seq_len: int = 128
    batch_size: int = 4
    max_calib_tokens: int = 4096
    max_eval_tokens: int = 4096
    bins: int = 2048
    ablation: bool = True  # per-layer end-to-end cost: one extra model run per layer, scheme and batch

    def __post_init__(self) -> None:
        for name in ("seq_len", "batch_size", "max_calib_tokens", "max_eval_tokens", "bins"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FFNQuantError(f"{name} must be a positive integer, got {value!r}")
        if self.seq_len < 2:
            raise FFNQuantError(f"seq_len must be at least 2, got {self.seq_len}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LayerInputs:
    """Each selected FFN's calibration and held-out evaluation inputs ([tokens, d_model], by layer label).

    `eval_batches` are the evaluation text's token ids and `model` the loaded transformers model
    (both None when the inputs came from captured files: no end-to-end numbers then); `borrowed`
    names the experts the router never chose, which get their layer's other experts' inputs
    (`calib_borrowed`: those among them whose calibration inputs are borrowed).
    """

    calib: dict[str, torch.Tensor]
    eval: dict[str, torch.Tensor]
    calibration_source: str
    evaluation_source: str
    separation: str
    borrowed: dict[str, str]
    eval_batches: list[torch.Tensor] | None = None
    model: Any = None
    calib_borrowed: dict[str, str] = field(default_factory=dict)  # the labels whose CALIBRATION inputs are borrowed
    calib_batches: list[torch.Tensor] | None = None  # the calibration text's token ids (None from captured files)
    # requested against obtained tokens of each text (`token_budget`); empty from captured files
    budgets: dict[str, dict[str, Any]] = field(default_factory=dict)
    # the held-out texts scored apart (`capture_layer_inputs(..., by_domain=True)`): (label, first batch, end
    # batch) spans of eval_batches, one per evaluation text; one span of all of them otherwise
    eval_domains: list[tuple[str, int, int]] = field(default_factory=list)
    # a causal LM's engine (`hf.stream.SequentialModel`, the model resident) that captured these inputs: the
    # end-to-end figures run through it too (`hf.evaluate.end_to_end(..., engine=)`)
    engine: Any = None
    # `capture_layer_inputs(..., references=True)` on the engine: the float model's figures on eval_batches
    # (`hf.evaluate.float_reference`'s kept batches and baseline), from the capture's own run of the held-out text
    float_references: list | None = None
    float_baseline: dict[str, Any] | None = None


# config.json's keys for the number of positions the decoder has learned (Whisper's decoder: max_target_positions)
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_target_positions")


def position_limit(config: Mapping[str, Any]) -> int | None:
    """The most tokens the model's learned positions cover (the least of config.json's `POSITION_KEYS`), or None."""
    limits = [config.get(k) for k in POSITION_KEYS]
    limits = [int(v) for v in limits if isinstance(v, int) and not isinstance(v, bool) and v >= 2]
    return min(limits) if limits else None


def fit_settings(info: ModelInfo, settings: EvalSettings) -> EvalSettings:
    """`settings` with seq_len no longer than the model's learned positions (`position_limit`), so windows never
    index past the position table."""
    limit = position_limit(info.config)
    if limit is not None and settings.seq_len > limit:
        from dataclasses import replace

        return replace(settings, seq_len=limit)
    return settings


def _concat_rows(pieces: Iterable[tuple[str, torch.Tensor]], labels: Sequence[str], limit: int | None,
                 skip: int = 0) -> dict[str, torch.Tensor]:
    """Per label, rows skip..skip+limit of the concatenated pieces (one label's rows in arrival order)."""
    got: dict[str, list[torch.Tensor]] = {label: [] for label in labels}
    seen = {label: 0 for label in labels}
    for label, x in pieces:
        if label not in got:
            continue
        start, stop = seen[label], seen[label] + x.shape[0]
        seen[label] = stop
        lo = max(skip - start, 0)
        hi = x.shape[0] if limit is None else min(x.shape[0], skip + limit - start)
        if hi > lo:
            got[label].append(x[lo:hi])
    return {label: torch.cat(xs) if xs else torch.zeros(0, 0) for label, xs in got.items()}


def _fill_unrouted(layers: Sequence[HFLayer], inputs: dict[str, torch.Tensor], what: str,
                   borrowed: dict[str, str]) -> None:
    """Each expert the router sent no tokens takes its layer's routed experts' inputs: only those (an expert filled
    before is no sibling, or each fill would hold every earlier one, the rows doubling per unrouted expert), one
    tensor shared by the layer's unrouted experts (a 128-expert layer holds it once, not per expert)."""
    routed = {o.label for o in layers if inputs[o.label].shape[0]}
    shared: dict[int, torch.Tensor] = {}
    for layer in layers:
        if layer.label in routed:
            continue
        if layer.index not in shared:
            siblings = [inputs[o.label] for o in layers if o.index == layer.index and o.label in routed]
            if not siblings:
                raise FFNQuantError(f"layer {layer.label} ({layer.name}) received no {what} tokens")
            shared[layer.index] = torch.cat(siblings)
        inputs[layer.label] = shared[layer.index]
        borrowed[layer.label] = f"the router sent it no {what} tokens: its layer's other experts' inputs are used"


def capture_whole(
    info: ModelInfo,
    layers: Sequence[HFLayer],
    text: str | os.PathLike | None = None,
    eval_text: str | os.PathLike | None = None,
    captured: str | os.PathLike | None = None,
    calib_tokens: int = 4096,
    eval_tokens: int = 2048,
    settings: EvalSettings = EvalSettings(),
    allow_pickle: bool = False,
    progress: Callable[[str, int, int], None] | None = None,
    by_domain: bool = False,
) -> LayerInputs:
    """Calibration and held-out inputs of each FFN in `layers`, for quantizing them one by one, from
    transformers' whole forward (encoders; a causal LM's reference) or captured files: what
    `hf.layerwise.capture_layer_inputs` takes where the engine does not run the model.

    From the model itself (needs transformers): its own tokenizer on `text` (calibration, default the
    shipped sample) and on `eval_text` (evaluation, a different book by default), each FFN's input
    captured through forward hooks. From `captured` files instead (no transformers): the first
    `calib_tokens` rows of each layer's file calibrate, the next `eval_tokens` rows evaluate.
    `progress(message, done, total)` is called after each batch run through the model ('capture calibration
    inputs: batch 3/9'); it never prints here. With `by_domain`, each evaluation text (each file, or each
    shipped corpus) is a domain of its own: tokenized apart with up to `eval_tokens` tokens each, its batches
    one span of `eval_batches` (`eval_domains`), so that a plan can be held to its target on each.
    """
    labels = [layer.label for layer in layers]
    borrowed: dict[str, str] = {}
    if captured is not None:
        d = info.spec.d_model
        calib = _concat_rows(iter_captured_files(captured, labels, d), labels, calib_tokens)
        evals = _concat_rows(iter_captured_files(captured, labels, d), labels, eval_tokens, skip=calib_tokens)
        for label in labels:
            if evals[label].shape[0] == 0:
                raise FFNQuantError(
                    f"captured activations of layer {label} in {str(captured)!r} have {calib[label].shape[0]} rows: "
                    f"none is left for evaluation after the {calib_tokens} calibration rows")
        return LayerInputs(calib, evals, f"captured {captured}", f"captured {captured}",
                           f"rows {calib_tokens + 1} onwards of each captured file (the first {calib_tokens} calibrate)",
                           borrowed)
    tokenizer = load_tokenizer(info.path)
    layer_infos = [layer.info for layer in layers]
    settings = fit_settings(info, settings)
    # tokenized (and the ids checked against config.json) before the model is loaded
    calib_ids = model_text_batches(info, tokenizer, text, "calibration", settings.seq_len, settings.batch_size,
                                   calib_tokens)
    domains = eval_domain_batches(info, tokenizer, eval_text, settings, eval_tokens, by_domain)
    eval_ids = [b for _, batches in domains for b in batches]
    model = _capture.load_hf_model(info, allow_pickle=allow_pickle)  # looked up at call time (tests replace it)

    def pieces(batches, stage):
        for i, batch in enumerate(iter_captured(model, info, layer_infos, batches)):
            yield from batch.items()
            if progress is not None:
                progress(f"{stage}: batch {i + 1}/{len(batches)}", i + 1, len(batches))

    calib = _concat_rows(pieces(calib_ids, "capture calibration inputs"), labels, None)
    evals = _concat_rows(pieces(eval_ids, "capture evaluation inputs"), labels, None)
    calib_borrowed: dict[str, str] = {}
    _fill_unrouted(layers, calib, "calibration", calib_borrowed)
    _fill_unrouted(layers, evals, "evaluation", borrowed)
    borrowed = {**calib_borrowed, **borrowed}
    cal_name, ev_name = _capture.text_label(text, "calibration"), _capture.text_label(eval_text, "evaluation")
    if by_domain:
        ev_name = " + ".join(label for label, _ in domains)
    budgets = {"calibration": token_budget("calibration", calib_tokens, calib_ids, cal_name),
               **domain_budgets(domains, eval_tokens, by_domain, ev_name)}
    return LayerInputs(calib, evals, cal_name, ev_name,
                       "different texts: calibration inputs from " + cal_name + ", held-out inputs from " + ev_name,
                       borrowed, eval_ids, model, calib_borrowed=calib_borrowed, calib_batches=calib_ids,
                       budgets=budgets, eval_domains=domain_spans(domains))


def eval_domain_batches(info: ModelInfo, tokenizer: Any, eval_text: Any, settings: EvalSettings, max_tokens: int,
                        by_domain: bool) -> list[tuple[str, list[torch.Tensor]]]:
    """The evaluation batches as (label, batches) per domain: each evaluation text apart (up to `max_tokens` each)
    with `by_domain`, else one domain of all of them together (up to `max_tokens` in all)."""
    from dataclasses import replace as _replace

    settings = fit_settings(info, settings)
    if not by_domain:
        sources = [eval_text]
    elif eval_text is None:  # every shipped evaluation corpus, a domain each
        sources = [c.name for c in shipped_corpora("evaluation")]
    else:  # each text a domain of its own, keeping how its documents become sequences (chat template, field)
        sources = [_replace(eval_text, items=(item,)) if isinstance(eval_text, TextSource) else item
                   for item in source_items(eval_text, "evaluation")]
    out = []
    for source in sources:
        batches = model_text_batches(info, tokenizer, source, "evaluation", settings.seq_len, settings.batch_size,
                                     max_tokens)
        out.append((_capture.text_label(source, "evaluation"), batches))
    return out


def domain_spans(domains: Sequence[tuple[str, Sequence[Any]]]) -> list[tuple[str, int, int]]:
    """(label, first batch, end batch) of each domain in the concatenated batch list."""
    spans, start = [], 0
    for label, batches in domains:
        spans.append((label, start, start + len(batches)))
        start += len(batches)
    return spans


def domain_budgets(domains: Sequence[tuple[str, Sequence[torch.Tensor]]], requested: int, by_domain: bool,
                   label: str) -> dict[str, dict[str, Any]]:
    """`token_budget` of the evaluation text, or of each domain ('evaluation: LABEL') with `by_domain`."""
    if not by_domain:
        return {"evaluation": token_budget("evaluation", requested, [b for _, bs in domains for b in bs], label)}
    return {f"evaluation: {name}": token_budget(f"evaluation ({name})", requested, batches, name)
            for name, batches in domains}


_GENERIC_FOLDERS = frozenset({"model", "models", "checkpoint", "weights", "hf", "snapshot"})


def model_file_stem(info: ModelInfo) -> str:
    """A file-name-safe name of a model folder: '<model_type>-<folder>' (e.g. 'bert-all-MiniLM-L6-v2');
    a generic folder name ('model', a snapshot hash) is replaced by its parent's."""
    folder = info.path.resolve()
    name = folder.name
    if name.lower() in _GENERIC_FOLDERS or re.fullmatch(r"[0-9a-f]{40}", name):
        name = folder.parent.name or name
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-.")
    return info.model_type if not name or name == info.model_type else f"{info.model_type}-{name}"


def file_inputs(info: ModelInfo, layers: Sequence[HFLayer], calib_captured, eval_captured) -> LayerInputs:
    """Every row of each layer's calibration and evaluation files; an expert the router sent no rows gets its
    layer's other experts' rows (recorded in `calib_borrowed` / `borrowed`)."""
    d, labels = info.spec.d_model, [layer.label for layer in layers]
    calib = _concat_rows(iter_captured_files(calib_captured, labels, d), labels, None)
    evals = _concat_rows(iter_captured_files(eval_captured, labels, d), labels, None)
    calib_borrowed: dict[str, str] = {}
    borrowed: dict[str, str] = {}
    _fill_unrouted(layers, calib, "calibration", calib_borrowed)
    for layer in layers:
        if evals[layer.label].shape[0] == 0 and not any(
                evals[o.label].shape[0] for o in layers if o.index == layer.index):
            # no evaluation rows in the whole layer: the rows report no tokens (SQNR None, from the files
            # streamed), and quantize_spec's own held-out figure, not reported, is taken on the calibration rows
            evals[layer.label] = calib[layer.label]
    _fill_unrouted(layers, evals, "evaluation", borrowed)
    return LayerInputs(calib, evals, f"captured {calib_captured}", f"captured {eval_captured}",
                       "separate files", {**calib_borrowed, **borrowed}, calib_borrowed=calib_borrowed)
