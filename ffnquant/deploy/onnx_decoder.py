"""The causal LM as one ONNX decoder with a KV cache: one graph serves the prefill (past length 0) and each
decode step (one new token), in the layout onnxruntime-genai's model builder writes and its genai_config.json
names (`past_key_values.%d.key`, `present.%d.key`, ...).

Inputs (dims named as the builder names them):

- `input_ids` int64 [batch_size, sequence_length]: the new tokens (the prompt at prefill, one token per step);
- `attention_mask` int64 [batch_size, total_sequence_length]: 1 for every real token of past + new, 0 for
  left padding; total = past + new;
- `position_ids` int64 [batch_size, sequence_length]: each new token's position (left padding does not count);
- `past_key_values.{i}.key` / `.value` float32 [batch_size, kv_heads, past_sequence_length, head_size] per
  decoder layer i (past length 0 at prefill).

Outputs: `logits` float32 [batch_size, sequence_length, vocab], `last_hidden` (the final hidden state, what the
scores compare) and `present.{i}.key` / `.value` [batch_size, kv_heads, total_sequence_length, head_size]:
past and new, the next step's past. Every layer keeps its whole past, sliding-window layers included: their
attention mask drops what lies outside the window, so a step computes what transformers computes.

The greedy loop (`greedy_generate`): left-pad the prompts, mask 1 on real tokens, positions the running count
of real tokens minus 1 (1 on padding, as transformers sets them), empty pasts; run; take argmax of each row's
last logits; feed that token with the presents as pasts, the mask one column longer and each position + 1;
a row that produced EOS gets the pad token from then on; stop after `new_tokens` or when every row is done.

The export goes through torch's dynamo exporter with transformers' DynamicCache built inside a small wrapper
from flat past tensors (`_Decoder`); it is checked against torch with and without the cache before it is kept.

Attention is exported at opset `DECODER_OPSET` with the kv heads passed to SDPA as they are (`enable_gqa`), so each
layer's attention is one ONNX `Attention` node reading the cache in place. The decomposed SDPA of older opsets
copied each layer's whole cache three more times per decode step (kv heads repeated to the query heads for K and
V, then K transposed), which made a step's cost grow with the context several times faster than attention's
own two passes over it. Where that export fails or differs from torch, the decomposed graph is written at the
caller's opset and the parity result says why (`attention`).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import math
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from ..errors import FFNQuantError, first_line
from ..infra.atomic import atomic_path
from ..measure.latency import latency_stats
from ..measure.timing import time_calls
from ..onnx.export import without_stack_traces
from ..onnx.onnxquant import ort_session

if TYPE_CHECKING:  # annotations only
    from ..hf.checkpoint import ModelInfo

__all__ = ["CacheLayout", "cache_layout", "export_decoder", "is_decoder", "prefill_feed", "greedy_generate",
           "cached_run", "generation_check", "decode_latency", "decode_step_tensors", "float_tolerance", "PAST", "PRESENT",
           "DECODER_OPSET"]

PAST, PRESENT = "past_key_values.{}.{}", "present.{}.{}"
HEADS = ("logits", "last_hidden")
# the first opset with the Attention op (onnxruntime's CPU provider runs it with fewer kv heads than query heads)
DECODER_OPSET = 23
# onnxruntime-genai's names for the dynamic dims (its builder's graphs); torch names the mask's dim itself
DIMS = ("batch_size", "sequence_length", "past_sequence_length", "total_sequence_length")


def float_tolerance(ref_absmax: float, n_layers: int, width: int) -> float:
    """How far onnxruntime's fp32 graph may be from torch's: each length-`width` dot product summed in another
    order differs by ~sqrt(width) units of float32 roundoff (2^-24) of its magnitude, the blocks add theirs
    (residual stream), and 8x covers softmax/norm amplification; scaled by the output's magnitude (>= 1)."""
    return 8.0 * n_layers * math.sqrt(width) * 2.0**-24 * max(1.0, float(ref_absmax))


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The exporter logs a warning per missing torchvision op and prints progress: nothing about this model."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def _native_gqa() -> Iterator[None]:
    """transformers' switch that hands SDPA the kv heads as they are (`enable_gqa=True`) instead of repeating them
    to the query heads first (`repeat_kv`, a copy of the whole cache per layer and step); the exporter then writes
    one Attention node. Read by transformers at each call, so it is set only around the export."""
    key, old = "TRANSFORMERS_SDPA_FORCE_GQA", os.environ.get("TRANSFORMERS_SDPA_FORCE_GQA")
    os.environ[key] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old


@dataclass(frozen=True)
class CacheLayout:
    """Per decoder layer, the [kv_heads, head_size] of its cached keys and of its values."""

    keys: tuple[tuple[int, int], ...]
    values: tuple[tuple[int, int], ...]

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    def past_names(self) -> list[str]:
        return [PAST.format(i, kv) for i in range(self.n_layers) for kv in ("key", "value")]

    def present_names(self) -> list[str]:
        return [PRESENT.format(i, kv) for i in range(self.n_layers) for kv in ("key", "value")]

    def empty(self, batch: int, length: int = 0, seed: int | None = None) -> list[torch.Tensor]:
        """Past tensors in input order: zeros of `length`, or seeded normal values (an export's example)."""
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        out = []
        for k, v in zip(self.keys, self.values):
            for heads, size in (k, v):
                shape = (batch, heads, length, size)
                out.append(torch.randn(shape, generator=gen) if gen is not None else torch.zeros(shape))
        return out


def _with_cache(model: nn.Module, cache: Any) -> dict[str, Any]:
    """The cache as `model.forward` names it: `cache` (transformers >= 5.2x, which deprecates the old name) or
    `past_key_values`."""
    return {"cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values": cache}


def _cache_of(out: Any) -> Any:
    """The cache a transformers output returns, under either name."""
    return out["cache"] if "cache" in out else out.past_key_values


def cache_layout(model: nn.Module) -> CacheLayout:
    """The cache `model` builds on two tokens; FFNQuantError (one line) when it is not per-layer keys and values."""
    from transformers import DynamicCache

    with torch.no_grad():
        try:
            cache = _cache_of(model(input_ids=torch.tensor([[1, 2]]), use_cache=True, return_dict=True))
        except Exception as exc:  # noqa: BLE001 - transformers' own refusal or failure of its cache (linear-attention
            # layers alone; BartForCausalLM's cache holds no layers), on the float model ffnquant has not touched
            raise FFNQuantError(f"its forward with a cache fails in transformers: {type(exc).__name__}: "
                                f"{first_line(exc)}") from None
    layers = getattr(cache, "layers", None)
    if not isinstance(cache, DynamicCache) or not layers or any(getattr(c, "keys", None) is None for c in layers):
        raise FFNQuantError(f"its cache is {type(cache).__name__}, not a DynamicCache of per-layer keys and values")
    shapes = [(tuple(c.keys.shape), tuple(c.values.shape)) for c in layers]
    if any(len(k) != 4 or len(v) != 4 or k[2] != 2 or v[2] != 2 for k, v in shapes):
        raise FFNQuantError(f"its cached keys/values are {shapes[0]}, not [batch, heads, tokens, head_size]")
    return CacheLayout(tuple((k[1], k[3]) for k, _ in shapes), tuple((v[1], v[3]) for _, v in shapes))


class _Decoder(nn.Module):
    """The causal LM with its cache as flat tensors: (ids, mask, positions, *pasts) -> (logits, hidden, *presents)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                past: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        from transformers import DynamicCache

        # without a config every layer is a plain DynamicLayer: the whole past is kept (sliding layers too)
        cache = DynamicCache(ddp_cache_data=[(past[i], past[i + 1]) for i in range(0, len(past), 2)])
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, output_hidden_states=True, return_dict=True, **_with_cache(self.model, cache))
        flat = [t for layer in _cache_of(out).layers for t in (layer.keys, layer.values)]
        return (out.logits, out.hidden_states[-1], *flat)


def _torch_steps(model: nn.Module, ids: torch.Tensor, split: int) -> torch.Tensor:
    """transformers' own cached path: the first `split` tokens at once, then one at a time; the logits."""
    from transformers import DynamicCache

    cache, outs = DynamicCache(), []
    with torch.no_grad():
        for lo, hi in [(0, split), *((t, t + 1) for t in range(split, ids.shape[1]))]:
            out = model(input_ids=ids[:, lo:hi], use_cache=True, return_dict=True, **_with_cache(model, cache))
            cache = _cache_of(out)
            outs.append(out.logits.float())
    return torch.cat(outs, 1)


def _rename_dims(proto: Any) -> None:
    """The total length under onnxruntime-genai's name: torch names the mask's dim itself and the presents'
    `past_sequence_length + sequence_length` (the other dims carry the names their torch.export.Dim has)."""
    total = DIMS[3]
    mask = next(i for i in proto.graph.input if i.name == "attention_mask")
    torch_total = mask.type.tensor_type.shape.dim[1].dim_param
    for value in [*proto.graph.input, *proto.graph.output]:
        for d in value.type.tensor_type.shape.dim:
            if d.dim_param == torch_total or (value.name.startswith("present.") and d.dim_param and "+" in d.dim_param):
                d.dim_param = total


def export_decoder(model: nn.Module, info: ModelInfo, path: str | os.PathLike, opset: int,
                   ids: torch.Tensor | None = None) -> dict[str, Any]:
    """`model` (a transformers causal LM) as the cached decoder graph of the module docstring at `path`, checked
    on onnxruntime against torch on `ids` (default a random [2, 16] batch): all at once (past 0) against the
    model without a cache, and the first half at once then a token per call against the full logits.
    Attention as one Attention node per layer (opset `DECODER_OPSET`, or `opset` when higher); where that fails,
    the decomposed graph at `opset`, `attention` saying why. FFNQuantError (one line) when the exporter fails or
    the graph differs (`float_tolerance`); no file then."""
    fast = max(opset, DECODER_OPSET)
    try:
        with _native_gqa():
            parity = _export_decoder(model, info, path, fast, ids)
        # a model whose attention is not SDPA (eager: soft-capping, ...) exports decomposed at any opset
        how = "one Attention node per layer" if parity["attention_nodes"] else "decomposed (the model's attention is not SDPA)"
        return {**parity, "opset": fast, "attention": how}
    except FFNQuantError as exc:
        why = str(exc)
    parity = _export_decoder(model, info, path, opset, ids)
    return {**parity, "opset": opset, "attention": f"decomposed SDPA: the opset {fast} export failed: {why}"}


def _export_decoder(model: nn.Module, info: ModelInfo, path: str | os.PathLike, opset: int,
                    ids: torch.Tensor | None) -> dict[str, Any]:
    import onnx

    model = model.eval()
    layout = cache_layout(model)
    vocab = int(getattr(model.config, "vocab_size", 2) or 2)
    gen = torch.Generator().manual_seed(0)
    b, s, p = 2, 3, 5  # every example dim >= 2: torch.export specializes dims of size 0 and 1
    example = (torch.randint(0, vocab, (b, s), generator=gen), torch.ones(b, p + s, dtype=torch.int64),
               torch.arange(p, p + s).expand(b, s).contiguous(), tuple(layout.empty(b, p, seed=1)))
    batch, seq = torch.export.Dim(DIMS[0]), torch.export.Dim(DIMS[1])
    past = torch.export.Dim(DIMS[2], min=0)
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: torch.export.Dim.DYNAMIC},
               "position_ids": {0: batch, 1: seq}, "past": tuple({0: batch, 2: past} for _ in layout.past_names())}
    outputs = [*HEADS, *layout.present_names()]
    with quiet(), torch.no_grad():
        try:
            program = torch.onnx.export(_Decoder(model), example, dynamo=True, opset_version=opset,
                                        dynamic_shapes=dynamic, verbose=False, output_names=outputs,
                                        input_names=["input_ids", "attention_mask", "position_ids", *layout.past_names()])
        except Exception as exc:  # the exporter's own (long, multi-line) report
            raise FFNQuantError(f"{info.model_type}: torch.onnx could not export the model with a KV cache: "
                                f"{first_line(exc)}") from exc
        proto = without_stack_traces(program.model_proto)  # no path of this machine in the graph
        del program
    _rename_dims(proto)
    proto.ir_version = min(proto.ir_version, 10)  # onnxruntime reads IR <= 10
    onnx.helper.set_model_props(proto, {"ffnquant_graph": "fp32", "model_type": info.model_type,
                                        "exporter": "torch.onnx dynamo", "kv_cache": f"{PAST} -> {PRESENT}"})
    onnx.checker.check_model(proto, full_check=True)
    attention_nodes = sum(n.op_type == "Attention" for n in proto.graph.node)
    if ids is None:
        ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(1))
    with atomic_path(path) as tmp:  # checked before it takes the name: a failed parity leaves no file
        onnx.save_model(proto, str(tmp))
        del proto
        parity = {**_parity(model, info, tmp, ids), "attention_nodes": attention_nodes}
        if not parity["passed"]:
            worst = max(parity["compared"], key=lambda k: parity[k]["max_abs_error"] / parity[k]["tolerance"])
            raise FFNQuantError(f"{path}: the fp32 decoder's {worst} differs from torch by "
                                f"{parity[worst]['max_abs_error']:.3g} (tolerance {parity[worst]['tolerance']:.3g})")
    return parity


def _parity(model: nn.Module, info: ModelInfo, path: Path, ids: torch.Tensor) -> dict[str, Any]:
    session = ort_session(path)
    split = max(1, ids.shape[1] // 2)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False, output_hidden_states=True, return_dict=True)
    refs = {"logits": out.logits.float(), "last_hidden": out.hidden_states[-1].float(),
            "cached_logits": _torch_steps(model, ids, split)}
    logits, hidden = session.run(list(HEADS), prefill_feed(session, ids))
    got = {"logits": logits, "last_hidden": hidden, "cached_logits": cached_run(session, ids, split)[0].numpy()}
    return {"shape": list(ids.shape), "cached_split": split, "provider": session.get_providers()[0],
            "compared": list(refs), **compare_outputs(path, info, got, {k: v.numpy() for k, v in refs.items()})}


def compare_outputs(path: Any, info: ModelInfo, got: dict[str, np.ndarray], refs: dict[str, np.ndarray]) -> dict[str, Any]:
    """Each output of a graph against torch's: {name: max abs error, the reference's absmax, the float32 tolerance
    (`float_tolerance`)} and `passed`. A shape that differs is a one-line FFNQuantError naming `path`."""
    width = max(info.spec.d_model, info.spec.d_ff)
    out: dict[str, Any] = {"passed": True}
    for name, ref in refs.items():
        g = got[name]
        if g.shape != ref.shape:
            raise FFNQuantError(f"{path}: {name} has shape {g.shape} on onnxruntime, {ref.shape} in torch")
        err, tol = float(np.abs(g - ref).max()), float_tolerance(np.abs(ref).max(), info.n_layers, width)
        out[name] = {"max_abs_error": err, "ref_absmax": float(np.abs(ref).max()), "tolerance": tol}
        out["passed"] &= err <= tol
    return out


# --- running the graph -------------------------------------------------------------------------------

def is_decoder(session: Any) -> bool:
    """Whether an onnxruntime session's graph takes a KV cache (else: the prefill graph, `input_ids` only)."""
    return any(i.name.startswith("past_key_values.") for i in session.get_inputs())


def _empty_pasts(session: Any, batch: int) -> dict[str, np.ndarray]:
    return {i.name: np.zeros((batch, i.shape[1], 0, i.shape[3]), np.float32) for i in session.get_inputs()
            if i.name.startswith("past_key_values.")}


def prefill_feed(session: Any, ids: torch.Tensor | np.ndarray) -> dict[str, np.ndarray]:
    """The inputs that run `ids` [batch, seq] at once from an empty cache (just `input_ids` for a prefill graph)."""
    ids = np.asarray(ids, dtype=np.int64)
    if not is_decoder(session):
        return {"input_ids": ids}
    b, s = ids.shape
    return {"input_ids": ids, "attention_mask": np.ones((b, s), np.int64),
            "position_ids": np.broadcast_to(np.arange(s, dtype=np.int64), (b, s)).copy(), **_empty_pasts(session, b)}


def _step(session: Any, feed: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """One call: (logits, last hidden, the pasts of the next call)."""
    presents = [o.name for o in session.get_outputs() if o.name.startswith("present.")]
    logits, hidden, *rest = session.run([*HEADS, *presents], feed)
    return logits, hidden, {n.replace("present.", "past_key_values.", 1): v for n, v in zip(presents, rest)}


def cached_run(session: Any, ids: torch.Tensor, prefill: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`ids` [batch, seq] through the cache: the first `prefill` tokens in one call, then one token per call;
    (logits, final hidden) of every position, as one call over `ids` would give them."""
    ids_np = ids.numpy().astype(np.int64)
    b, s = ids_np.shape
    feed = prefill_feed(session, ids_np[:, :prefill])
    logits, hidden = [], []
    for t in range(prefill, s + 1):
        lg, hd, pasts = _step(session, feed)
        logits.append(lg)
        hidden.append(hd)
        if t < s:
            feed = {"input_ids": ids_np[:, t:t + 1], "attention_mask": np.ones((b, t + 1), np.int64),
                    "position_ids": np.full((b, 1), t, np.int64), **pasts}
    # the positions are the second-last axis of the hidden states: [batch, seq, width] mostly, Gemma 3n's AltUp
    # inputs [inputs, batch, seq, width]
    return torch.from_numpy(np.concatenate(logits, 1)), torch.from_numpy(np.concatenate(hidden, -2))


def greedy_generate(session: Any, prompts: Sequence[Sequence[int]], new_tokens: int, eos_token_id: Any = None,
                    pad_token_id: int = 0) -> list[list[int]]:
    """Greedy decoding on the cached graph (the loop of the module docstring): the new tokens of each prompt,
    EOS included, nothing after it. `eos_token_id`: an id, a list of ids or None."""
    if not prompts or any(len(p) == 0 for p in prompts) or new_tokens < 1:
        raise FFNQuantError("greedy_generate needs non-empty prompts and new_tokens >= 1")
    eos = set() if eos_token_id is None else set(np.atleast_1d(eos_token_id).tolist())
    b, n = len(prompts), max(len(p) for p in prompts)
    ids = np.full((b, n), pad_token_id, np.int64)
    mask = np.zeros((b, n), np.int64)
    for r, p in enumerate(prompts):  # left padding: every row's last token is the last column
        ids[r, n - len(p):], mask[r, n - len(p):] = p, 1
    positions = np.cumsum(mask, 1) - 1
    positions[mask == 0] = 1
    feed = {"input_ids": ids, "attention_mask": mask, "position_ids": positions, **_empty_pasts(session, b)}
    done, out = np.zeros(b, bool), [[] for _ in range(b)]
    for _ in range(new_tokens):
        logits, _, pasts = _step(session, feed)
        nxt = np.where(done, pad_token_id, logits[:, -1].argmax(-1)).astype(np.int64)
        for r in np.flatnonzero(~done):
            out[r].append(int(nxt[r]))
        done |= np.isin(nxt, list(eos))
        if done.all():
            break
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], 1)
        feed = {"input_ids": nxt[:, None], "attention_mask": mask, "position_ids": feed["position_ids"][:, -1:] + 1,
                **pasts}
    return out


def generation_check(model: nn.Module, session: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> dict[str, Any]:
    """`greedy_generate` on the graph against transformers' `generate(do_sample=False)` on `model`, prompt by
    prompt (batch 1 each: no padding on either side): the tokens of both and whether they are equal."""
    from .proof import PLAIN_GREEDY

    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    eos = eos if eos is not None else getattr(model.config, "eos_token_id", None)
    pad = getattr(model.config, "pad_token_id", None)
    pad = pad if pad is not None else (eos if isinstance(eos, int) else 0)
    rows = []
    for p in prompts:
        with torch.no_grad():
            ref = model.generate(torch.tensor([list(p)]), attention_mask=torch.ones(1, len(p), dtype=torch.int64),
                                 do_sample=False, num_beams=1, max_new_tokens=new_tokens, min_new_tokens=0,
                                 eos_token_id=eos, pad_token_id=pad, **PLAIN_GREEDY)[0, len(p):].tolist()
        got = greedy_generate(session, [p], new_tokens, eos, pad)[0]
        rows.append({"prompt": list(map(int, p)), "onnx": got, "transformers": ref, "equal": got == ref})
    return {"prompts": len(rows), "new_tokens": new_tokens, "equal": all(r["equal"] for r in rows),
            "eos_token_id": eos, "pad_token_id": pad,
            "tokens_compared": sum(len(r["transformers"]) for r in rows), "rows": rows,
            "provider": session.get_providers()[0]}


def interleaved_times(sessions: dict[str, Any], feeds: dict[int, dict[str, Any]], *, warmup: int, rounds: int,
                      per_round: int) -> dict[tuple[str, int], list[float]]:
    """Seconds per `session.run` of each (session, feed) pair, timed side by side: after `warmup` untimed runs of
    each (first runs allocate and pick kernels), `rounds` rounds that each run every session on every feed
    `per_round` times, so drift on a shared machine falls on all of them alike."""
    times: dict[tuple[str, int], list[float]] = {(k, n): [] for k in sessions for n in feeds}
    for session in sessions.values():
        for feed in feeds.values():
            time_calls(lambda: session.run(None, feed), 0, warmup=warmup)
    for _ in range(rounds):
        for n, feed in feeds.items():
            for key, session in sessions.items():
                times[key, n] += time_calls(lambda: session.run(None, feed), per_round)
    return times


def decode_latency(float_path: str | os.PathLike, quant_path: str | os.PathLike, contexts: Sequence[int] = (128, 1024),
                   rounds: int = 5, per_round: int = 3, warmup: int = 1, threads: int | None = None,
                   seed: int = 0) -> dict[str, Any]:
    """Per-token decode latency of the fp32 and quantized cached graphs on onnxruntime's CPU provider: one new
    token attending to N tokens of context (each N of `contexts`: a past of N - 1, the fp32 graph's presents
    after a prefill of N - 1 random tokens, and the new token; the same inputs for both graphs), batch 1; interleaved rounds as `graph_latency` runs them,
    p10/p50/p90 ms and the speedup (fp32 p50 / quantized p50)."""
    if rounds < 1 or per_round < 1 or warmup < 0 or not contexts or min(contexts) < 1:
        raise FFNQuantError("decode_latency needs rounds >= 1, per_round >= 1, warmup >= 0 and contexts >= 1")
    sessions = {"float": ort_session(float_path, threads=threads), "quantized": ort_session(quant_path, threads=threads)}
    if not all(is_decoder(s) for s in sessions.values()):
        raise FFNQuantError("decode latency needs two cached decoder graphs (past_key_values inputs)")
    vocab = sessions["float"].get_outputs()[0].shape[-1]
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else 2
    rng = np.random.default_rng(seed)
    feeds = {}
    for n in contexts:
        ids = rng.integers(0, vocab, (1, n), dtype=np.int64)
        past = n - 1
        pasts = _empty_pasts(sessions["float"], 1) if past == 0 else \
            _step(sessions["float"], prefill_feed(sessions["float"], ids[:, :past]))[2]
        feeds[n] = {"input_ids": ids[:, past:], "attention_mask": np.ones((1, n), np.int64),
                    "position_ids": np.array([[past]], np.int64), **pasts}
    times = interleaved_times(sessions, feeds, warmup=warmup, rounds=rounds, per_round=per_round)
    out: dict[str, Any] = {"provider": sessions["quantized"].get_providers()[0], "threads": threads or "onnxruntime default",
                           "rounds": rounds, "per_round": per_round, "batch": 1, "new_tokens": 1, "contexts": {}}
    for n in contexts:
        row = {}
        for key in sessions:
            st = latency_stats(times[key, n])
            row[key] = {"p10_ms": st.p10_s * 1e3, "p50_ms": st.median_s * 1e3, "p90_ms": st.p90_s * 1e3,
                        "samples": st.n, "tokens_per_s": 1.0 / st.median_s}
        row["speedup"] = row["float"]["p50_ms"] / row["quantized"]["p50_ms"]
        out["contexts"][str(n)] = row
    return out


def decode_step_tensors(path: str | os.PathLike, past: int, folder: str | os.PathLike) -> list[dict[str, Any]]:
    """What one decode step computes: each node onnxruntime ran (after its graph optimizations) for one new token on
    a past of `past` tokens, batch 1, with its outputs' shapes, read from onnxruntime's profiler (the trace file
    goes to `folder` and is removed). A structural view of the step, not a timing: [{node, op, shapes}]."""
    import json

    import onnxruntime as ort

    plain = ort_session(path, threads=1)
    vocab = plain.get_outputs()[0].shape[-1]
    ids = np.random.default_rng(0).integers(0, vocab if isinstance(vocab, int) and vocab > 1 else 2, (1, past + 1))
    pasts = _step(plain, prefill_feed(plain, ids[:, :past]))[2] if past else _empty_pasts(plain, 1)
    opts = ort.SessionOptions()
    opts.log_severity_level, opts.intra_op_num_threads, opts.enable_profiling = 3, 1, True
    opts.profile_file_prefix = str(Path(folder) / "decode-step")
    session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    session.run(None, {"input_ids": ids[:, past:], "attention_mask": np.ones((1, past + 1), np.int64),
                       "position_ids": np.array([[past]], np.int64), **pasts})
    trace = Path(session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    return [{"node": e["name"][: -len("_kernel_time")], "op": e["args"].get("op_name"),
             "shapes": [next(iter(o.values())) for o in e["args"].get("output_type_shape", [])]}
            for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
