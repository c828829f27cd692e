"""What a user of a whole model notices, streamed over evaluation batches: next-token perplexity (causal LMs)
and the SQNR/cosine of the final hidden states against a reference run. `hf.evaluate` measures quantized FFNs
put back into the model with these; `compare_models` measures any other candidate (a deployed folder loaded
back, an ONNX graph) on the same batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from .arch import ModelKind
from .capture import shift_right
from .checkpoint import ModelInfo

__all__ = ["ErrorStats", "SQNR_CAP_DB", "TOP_K", "Reference", "reference_batch", "Agreement", "ratio_interval",
           "normalizer_and_argmax",
           "t_quantile", "compare_models"]

SQNR_CAP_DB = 200.0  # as ffnquant.numerics.accuracy: identical outputs read as 200 dB, not +inf


class ErrorStats:
    """Streaming SQNR and cosine of `got` against `ref` over the concatenation of all updates."""

    def __init__(self) -> None:
        self.signal = 0.0
        self.noise = 0.0
        self.dot = 0.0
        self.got_sq = 0.0
        self.n_tokens = 0

    def update(self, ref: torch.Tensor, got: torch.Tensor) -> "ErrorStats":
        r, g = ref.detach().double(), got.detach().double()
        self.signal += float((r * r).sum())
        self.noise += float(((r - g) ** 2).sum())
        self.dot += float((r * g).sum())
        self.got_sq += float((g * g).sum())
        self.n_tokens += r.numel() // max(1, r.shape[-1])
        return self

    @property
    def sqnr_db(self) -> float | None:
        if self.n_tokens == 0:
            return None
        if self.noise == 0.0:
            return SQNR_CAP_DB
        if self.signal == 0.0:
            return -SQNR_CAP_DB
        return min(SQNR_CAP_DB, 10.0 * math.log10(self.signal / self.noise))

    @property
    def cosine(self) -> float | None:
        if self.n_tokens == 0:
            return None
        den = math.sqrt(self.signal * self.got_sq)
        return self.dot / den if den > 0 else (1.0 if self.noise == 0 else 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"sqnr_db": self.sqnr_db, "cosine": self.cosine, "n_tokens": self.n_tokens}


def log_normalizer(logits: torch.Tensor) -> torch.Tensor:
    """log(sum(exp(logits))) over the last axis, float64, from float32 logits without a float64 copy of them.

    exp(x - max) in float32 summed by torch's cascade sum (relative rounding about 1e-7, unbiased), its log in
    float64: a log-probability (x - this) is within about 3e-7 of float64 arithmetic's, against ~1e-5 and a bias
    for float32 `log_softmax` at a 49k vocabulary, at half the time of a float64 copy of [tokens, vocabulary].
    Taken a few rows at a time (`_NORMALIZER_CHUNK` floats): each row's max, shift, exp and sum then read it from
    the cache, not from memory four times (a 262k vocabulary's logits are 1 MB a row); the same figures. No
    gradient flows through it: `summed_nll` is the differentiable loss."""
    return normalizer_and_argmax(logits)[0]


def normalizer_and_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(`log_normalizer(logits)`, `logits.argmax(-1)`) in one pass over the logits: each chunk's max and its index
    are one reduction, taken while the chunk is in the cache (a separate argmax reads a 262k vocabulary's logits from
    memory again: 160 ms of a 250 ms `Agreement.update` per 512-token sequence, measured). Ties: the first index, as
    `argmax`'s."""
    rows = logits.detach().float().reshape(-1, logits.shape[-1])
    top = torch.empty(rows.shape[0], 1, dtype=rows.dtype)
    where = torch.empty(rows.shape[0], 1, dtype=torch.long)
    total = torch.empty(rows.shape[0], dtype=rows.dtype)
    for i in range(0, rows.shape[0], step := _chunk_rows(rows.shape[1])):
        part = rows[i:i + step]
        torch.max(part, dim=-1, keepdim=True, out=(top[i:i + step], where[i:i + step]))
        torch.sum(torch.sub(part, top[i:i + step]).clamp_(min=_EXP_FLOOR).exp_(), dim=-1, out=total[i:i + step])
    shape = logits.shape[:-1]
    return (top.squeeze(-1).double() + torch.log(total.double())).reshape(shape), where.squeeze(-1).reshape(shape)


# exp(x - max) is taken of x - max >= this: below it a term is under 2e-35, nothing against a sum of at least 1 (the
# max's own term) at float32's 6e-8 resolution, and torch's vectorised exp leaves its fast path below about -87 (a
# logit spread of 430 ran 8x slower, measured)
_EXP_FLOOR = -80.0
_NORMALIZER_CHUNK = 1 << 21  # floats (8 MB) of logits at a time in `log_normalizer`: within a server CPU's L3 cache


def _chunk_rows(width: int) -> int:
    """How many rows of `width` logits make one `_NORMALIZER_CHUNK` (at least one)."""
    return max(1, _NORMALIZER_CHUNK // max(1, width))


def token_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each position's next-token NLL [sequences * (positions - 1)], float64 (`log_normalizer`). A sequence at a
    time: its predicting positions are a view of the logits, not a copy (a 262k vocabulary's are 1 MB a row)."""
    out = []
    for s in range(ids.shape[0]):
        x = logits[s, :-1]
        out.append(log_normalizer(x) - x.gather(-1, ids[s, 1:, None]).squeeze(-1).double())
    return torch.cat(out)


class _SummedNLL(torch.autograd.Function):
    """The summed next-token NLL of logits [sequences, positions, vocabulary] against `ids`, float64 (`token_nll`
    summed), with its gradient written out: softmax minus the one-hot of the next token at each predicting position,
    zero at each sequence's last. Both are taken a few rows at a time (`log_normalizer`), so the loss of a
    backward pass at a 262k vocabulary keeps no autograd graph of [tokens, vocabulary] temporaries."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        x = logits.detach().float()
        norm = torch.stack([log_normalizer(x[s, :-1]) for s in range(x.shape[0])])  # [sequences, positions - 1]
        target = x[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).double()
        ctx.save_for_backward(x, ids, norm)
        ctx.dtype = logits.dtype
        return (norm - target).sum()

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, ids, norm = ctx.saved_tensors
        grad, step = torch.zeros_like(x), _chunk_rows(x.shape[-1])
        for s in range(x.shape[0]):
            rows, out, lse = x[s, :-1], grad[s, :-1], norm[s].float()[:, None]
            for i in range(0, rows.shape[0], step):
                torch.sub(rows[i:i + step], lse[i:i + step], out=out[i:i + step]).clamp_(min=_EXP_FLOOR).exp_()
            out[torch.arange(out.shape[0]), ids[s, 1:]] -= 1.0
        return grad.mul_(grad_out.float()).to(ctx.dtype), None


def summed_nll(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """`token_nll(logits, ids).sum()`, float64, differentiable with respect to `logits` (`_SummedNLL`)."""
    return _SummedNLL.apply(logits, ids)


class _NLL:
    """Streaming negative log-likelihood of next-token prediction."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def update(self, logits: torch.Tensor, ids: torch.Tensor) -> None:
        self.total += float(token_nll(logits, ids).sum(dtype=torch.float64))
        self.count += ids[:, 1:].numel()

    def add(self, nll: torch.Tensor) -> None:
        """Per-token NLLs computed elsewhere (a kept `Reference`'s)."""
        self.total += float(nll.double().sum())
        self.count += nll.numel()

    @property
    def perplexity(self) -> float | None:
        return math.exp(self.total / self.count) if self.count else None


# --- the reference's next-token distribution kept once, and a candidate's agreement with it ----------------------

TOP_K = 128  # reference tokens kept per position; the rest of its probability mass is one bucket (see Agreement)

# two-sided 95% quantiles of Student's t by degrees of freedom (1-30); above 30 the table's last entries are
# interpolated in 1/df toward the normal quantile 1.960
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t_quantile(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (a 95% two-sided interval)."""
    if df < 1:
        return math.inf
    if df <= len(_T975):
        return _T975[df - 1]
    return 1.960 + (_T975[-1] - 1.960) * len(_T975) / df  # exact to 0.002 at every df > 30


def ratio_interval(num: Sequence[float], den: Sequence[float]) -> tuple[float, float, float] | None:
    """(estimate, low, high) of sum(num)/sum(den) with a 95% interval, the sequences as independent units.

    The ratio estimator's standard error over S units: sqrt(S/(S-1) * sum (num_s - r den_s)^2) / sum den_s,
    widened by Student's t with S-1 degrees of freedom. Tokens inside one sequence are correlated (a passage is
    easy or hard as a whole), so the sequence, not the token, is the unit. None with fewer than 2 units."""
    n = torch.as_tensor(list(num), dtype=torch.float64)
    d = torch.as_tensor(list(den), dtype=torch.float64)
    if n.numel() < 2 or float(d.sum()) <= 0:
        return None
    r = float(n.sum() / d.sum())
    s = n.numel()
    se = math.sqrt(s / (s - 1) * float(((n - r * d) ** 2).sum())) / float(d.sum())
    half = t_quantile(s - 1) * se
    return r, r - half, r + half


@dataclass
class Reference:
    """The reference model's figures of one batch, kept so that each candidate is scored without running it again:
    the next-token NLL at each position [sequences, positions] (float64), its `TOP_K` most likely next tokens with their
    log-probabilities (sorted, most likely first) and, optionally, the final hidden state."""

    nll: torch.Tensor
    top_logp: torch.Tensor
    top_ids: torch.Tensor
    hidden: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        parts = [self.nll, self.top_logp, self.top_ids] + ([self.hidden] if self.hidden is not None else [])
        return sum(t.numel() * t.element_size() for t in parts)


def reference_batch(logits: torch.Tensor | None, ids: torch.Tensor, hidden: torch.Tensor | None = None,
                    k: int = TOP_K) -> Reference:
    """`Reference` of one batch from the reference model's logits [sequences, positions, vocabulary]; without
    logits (an encoder: no next-token figures) only the final hidden state is kept."""
    if logits is None:
        return Reference(torch.zeros(0, dtype=torch.float64), torch.zeros(0), torch.zeros(0, dtype=torch.int32),
                         None if hidden is None else hidden.detach().float())
    nll, top_logp, top_ids = [], [], []
    for s in range(ids.shape[0]):  # a sequence at a time (bounded memory at a large vocabulary)
        x = logits[s, :-1]
        norm = log_normalizer(x)  # log-probabilities are x - norm: see log_normalizer
        nll.append(norm - x.gather(-1, ids[s, 1:, None]).squeeze(-1).double())
        lp, ix = x.topk(min(k, x.shape[-1]), dim=-1)  # the order of x is the order of its log-probabilities
        top_logp.append(lp.double() - norm[:, None])
        top_ids.append(ix)
    return Reference(torch.stack(nll), torch.stack(top_logp).float(), torch.stack(top_ids).to(torch.int32),
                     None if hidden is None else hidden.detach().float())


def _log1mexp_sum(logp: torch.Tensor) -> torch.Tensor:
    """log(1 - sum(exp(logp))) over the last axis, clamped away from log(0)."""
    mass = logp.double().exp().sum(-1).clamp(max=1.0 - 1e-12)
    return torch.log1p(-mass)


class Agreement:
    """A candidate's next-token predictions against the reference's on the same tokens, streamed over batches.

    Kept per sequence: both summed NLLs (their paired difference gives the perplexity change's interval), the
    summed KL divergence and the top-1 agreements; per token, the KL divergence (for its percentiles).
    KL(reference || candidate) is taken over the reference's `TOP_K` tokens plus one bucket holding the rest of
    each distribution's mass: merging outcomes never increases a KL divergence, so this is a lower bound of the
    full-vocabulary KL, and it equals it when the reference puts its mass on those tokens (measured against the
    full KL in the tests)."""

    def __init__(self) -> None:
        self.ref_nll: list[float] = []
        self.nll: list[float] = []
        self.kl_seq: list[float] = []
        self.top1_seq: list[float] = []
        self.count: list[int] = []
        self.kl_tokens: list[torch.Tensor] = []

    def update(self, ref: Reference, logits: torch.Tensor, ids: torch.Tensor, nll_into: "_NLL | None" = None) -> "Agreement":
        """One batch; `nll_into` also gets its per-token NLLs (the same figures `_NLL.update` computes, once)."""
        kls = []
        for s in range(ids.shape[0]):  # a sequence at a time (see reference_batch)
            x = logits[s, :-1]
            norm, best = normalizer_and_argmax(x)  # the candidate's log-probabilities are x - norm
            nll = norm - x.gather(-1, ids[s, 1:, None]).squeeze(-1).double()
            top_p_logp = ref.top_logp[s].double()
            q_top = x.gather(-1, ref.top_ids[s].long()).double() - norm[:, None]
            p_top = top_p_logp.exp()
            kl = (p_top * (top_p_logp - q_top)).sum(-1)
            p_rest = (1.0 - p_top.sum(-1)).clamp(min=0.0)
            rest = p_rest * (_log1mexp_sum(top_p_logp) - _log1mexp_sum(q_top))
            kl = (kl + torch.where(p_rest > 0, rest, torch.zeros_like(rest))).clamp(min=0.0)  # >= 0 up to rounding
            agree = (best == ref.top_ids[s, :, 0].long()).double()
            self.ref_nll.append(float(ref.nll[s].double().sum()))
            self.nll.append(float(nll.sum()))
            self.kl_seq.append(float(kl.sum()))
            self.top1_seq.append(float(agree.sum()))
            self.count.append(int(nll.numel()))
            if nll_into is not None:
                nll_into.add(nll)
            kls.append(kl.float())
        self.kl_tokens.append(torch.cat(kls))
        return self

    @property
    def n_tokens(self) -> int:
        return sum(self.count)

    def figures(self) -> dict[str, Any]:
        """{perplexity_ratio with its 95% interval (paired per-sequence differences), kl: {mean, its interval,
        median, p99, p99_9, max}, top1_agreement with its interval, n_sequences, n_predicted}."""
        if not self.count:
            return {}
        diff = [a - b for a, b in zip(self.nll, self.ref_nll)]
        r = sum(diff) / self.n_tokens
        ratio = ratio_interval(diff, self.count)
        kl_all = torch.cat(self.kl_tokens).double()
        qs = torch.quantile(kl_all, torch.tensor([0.5, 0.99, 0.999], dtype=torch.float64)).tolist()
        kl_ci = ratio_interval(self.kl_seq, self.count)
        top1 = ratio_interval(self.top1_seq, self.count)
        out = {
            "perplexity_ratio_paired": math.exp(r),
            "perplexity_ratio_ci": None if ratio is None else [math.exp(ratio[1]), math.exp(ratio[2])],
            "kl": {"mean": float(kl_all.mean()), "ci": None if kl_ci is None else [kl_ci[1], kl_ci[2]],
                   "median": qs[0], "p99": qs[1], "p99_9": qs[2], "max": float(kl_all.max()),
                   "top_k": TOP_K, "bound": "lower (the reference's top-k tokens plus one bucket)"},
            "top1_agreement": sum(self.top1_seq) / self.n_tokens,
            "top1_agreement_ci": None if top1 is None else [top1[1], min(1.0, top1[2])],
            "n_sequences": len(self.count), "n_predicted": self.n_tokens,
        }
        return out


def _final_hidden(info: ModelInfo, out: Any) -> torch.Tensor:
    if info.kind is ModelKind.ENCODER:
        return out.last_hidden_state
    if info.kind is ModelKind.SEQ2SEQ:
        return out.decoder_hidden_states[-1]
    # a causal LM's: its base model's last hidden state, what the head reads (and the engine's head measures:
    # `hf.head`); its hidden_states[-1] is that in most models, but Gemma 3n's are its AltUp inputs before they
    # are folded into one
    base = getattr(out, "ffnquant_base_hidden", None)
    return base if isinstance(base, torch.Tensor) else out.hidden_states[-1]


def _run(model, info: ModelInfo, ids: torch.Tensor):
    inputs: dict[str, torch.Tensor] = {"input_ids": ids}
    if info.kind is ModelKind.SEQ2SEQ:
        inputs["decoder_input_ids"] = shift_right(model, ids)
    if info.kind is ModelKind.CAUSAL_LM:  # one pass over whole sequences: no KV cache to build (nor to size a mask)
        inputs["use_cache"] = False
    base = getattr(model, "base_model", None) if info.kind is ModelKind.CAUSAL_LM else None
    got: list[torch.Tensor] = []
    handle = base.register_forward_hook(  # the base model's own output: `_final_hidden`
        lambda module, args, o: got.append(o[0] if isinstance(o, tuple) else getattr(o, "last_hidden_state", None))) \
        if isinstance(base, torch.nn.Module) and base is not model else None
    try:
        with torch.no_grad():
            out = model(**inputs, output_hidden_states=True)
    finally:
        if handle is not None:
            handle.remove()
    if got and isinstance(got[-1], torch.Tensor):
        object.__setattr__(out, "ffnquant_base_hidden", got[-1])
    return out


def compare_models(reference: Any, candidate: Any, info: ModelInfo, evals: Sequence[torch.Tensor],
                   candidate_run: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
                   references: Sequence[Reference] | None = None) -> dict[str, Any]:
    """`end_to_end`'s figures for a whole other model (a deployed folder loaded back, an ONNX graph): the final
    hidden state's SQNR/cosine against `reference` and, for causal LMs, both perplexities on `evals`, the
    change's 95% interval, KL divergence and top-1 agreement against `reference` (`Agreement`).

    `candidate_run(ids) -> (logits, final hidden)` runs a candidate that is not a transformers model
    (`candidate` is then unused); `references` (`hf.evaluate.float_reference`'s kept batches, with their final
    hidden states) stand in for running `reference` again."""
    hidden, nll_ref, nll, agreement = ErrorStats(), _NLL(), _NLL(), Agreement()
    causal = info.kind is ModelKind.CAUSAL_LM
    for b, ids in enumerate(evals):
        if references is not None:
            ref = references[b]
        else:
            out_ref = _run(reference, info, ids)
            ref = reference_batch(out_ref.logits if causal else None, ids, _final_hidden(info, out_ref))
            del out_ref
        if candidate_run is not None:
            logits, final = candidate_run(ids)
        else:
            out = _run(candidate, info, ids)
            logits, final = out.logits, _final_hidden(info, out)
        hidden.update(ref.hidden, final)
        if causal:
            nll_ref.add(ref.nll)
            agreement.update(ref, logits, ids, nll_into=nll)
    out = {"hidden_sqnr_db": hidden.sqnr_db, "hidden_cosine": hidden.cosine,
           "n_tokens": sum(int(b.numel()) for b in evals)}
    if causal:
        out.update(baseline_perplexity=nll_ref.perplexity, perplexity=nll.perplexity,
                   perplexity_ratio=nll.perplexity / nll_ref.perplexity)
        fig = agreement.figures()
        fig.pop("perplexity_ratio_paired", None)
        out.update(fig)
    return out
