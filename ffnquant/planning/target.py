"""What a plan must meet end to end (`Target`) and what it makes cheapest (`Objective`). Frozen and validated."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from ..errors import FFNQuantError, unknown_choice
from ..infra.render import ppl_change

__all__ = ["Target", "Objective", "Workload", "token_interval", "OBJECTIVES", "METRICS", "TARGET_FORMS", "DECODE_TOKENS", "PLAN_RUNTIMES"]

TARGET_FORMS = ("ppl+P% (perplexity at most P% above the float model's), kld<=X (mean next-token KL divergence "
                "from the float model, nats), top1>=Y% (share of tokens whose most likely next token is the float "
                "model's) or sqnr>=DB (final hidden state SQNR)")
OBJECTIVES = ("latency", "bytes")
# Where the latency objective can time candidates (`ffnquant.runtimes` names): onnxruntime's CPU provider on the
# ONNX artifacts, or the torch-module runtimes on their kernels (a comma list: each candidate on the first one with
# a kernel for it). Left out: ort-cuda / ort-trt (the table times artifacts on the CPU provider only) and
# triton-cpu (Triton's interpreter: numerics, not latency). vllm-cpu: vLLM's CPU build on a compressed-tensors folder
# of the model (`planning.vllm_latency`); genai-cpu: onnxruntime-genai's generate loop on the model's ONNX decoder
# (`planning.genai_latency`).
PLAN_RUNTIMES = ("ort-cpu", "torch-cpu", "torch-cuda", "torch-cuda-graph", "torch-cuda-compile", "triton-cuda",
                 "bnb-cpu", "bnb-cuda", "vllm-cpu", "genai-cpu")
# decode steps per request the latency objective counts by default: a short chat reply to a 512-token prompt;
# on a CPU each step reads every weight, so at this count decode is most of a request's FFN time
DECODE_TOKENS = 128
METRICS = ("ppl", "kld", "top1", "sqnr")

# Top-1 disagreement grows about as the square root of the KL divergence for small perturbations (a token flips
# when the logit noise, of size ~sqrt(KL), crosses its margin); this prior factor (disagreement ~ 0.4 sqrt(KL),
# the ratio seen in published llama.cpp KL / "same top" tables) only sets the first round's budget: the
# verification rounds correct it by the measured disagreement, as they do for every target.
_TOP1_PER_SQRT_KL = 0.4


@dataclass(frozen=True)
class Target:
    """What must hold end to end on every held-out text, at its 95% confidence bound where the metric has one.

    `ppl+1%`: perplexity at most 1% above float (the interval's upper end); `kld<=0.01`: mean KL divergence of
    the next-token distribution at most 0.01 nats (upper end); `top1>=95%`: at least 95% of tokens keep the float
    model's top token (lower end); `sqnr>=30`: final hidden state SQNR of at least 30 dB (a ratio of sums over
    all tokens, no interval).

    `budget` is what the search spends, in units whose per-layer parts add to first order: nats per token for
    ppl (log(1 + P/100)) and kld (X); KL-equivalent nats for top1 ((disagreement / 0.4)^2); the final-hidden
    noise-to-signal ratio for sqnr (10^(-DB/10)).
    """

    metric: str  # one of METRICS
    value: float  # percent for ppl and top1, nats for kld, dB for sqnr

    def __post_init__(self) -> None:
        if self.metric not in METRICS:
            raise unknown_choice("target metric", self.metric, METRICS)
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise FFNQuantError(f"target {self.metric}: the value must be a number, got {self.value!r}")
        if self.metric == "ppl" and not 0 < self.value <= 100:
            raise FFNQuantError(f"target ppl+{self.value:g}%: the increase must be in (0, 100] percent")
        if self.metric == "kld" and not 0 < self.value <= 10:
            raise FFNQuantError(f"target kld<={self.value:g}: the KL divergence must be in (0, 10] nats")
        if self.metric == "top1" and not 0 < self.value < 100:
            raise FFNQuantError(f"target top1>={self.value:g}%: the agreement must be in (0, 100) percent")
        if self.metric == "sqnr" and not 0 < self.value <= 120:
            raise FFNQuantError(f"target sqnr>={self.value:g}: the SQNR must be in (0, 120] dB")
        object.__setattr__(self, "value", float(self.value))

    @classmethod
    def parse(cls, text: str) -> "Target":
        raw = str(text).strip().lower().replace(" ", "")
        forms = ((r"ppl\+([0-9.]+)%", "ppl"), (r"kld<=([0-9.eE+-]+)", "kld"), (r"top1>=([0-9.]+)%", "top1"),
                 (r"sqnr>=([0-9.]+)(?:db)?", "sqnr"))
        for pattern, metric in forms:
            m = re.fullmatch(pattern, raw)
            if m:
                return cls(metric, _number(m.group(1), text))
        raise FFNQuantError(f"target {text!r} is not one of: {TARGET_FORMS}")

    @property
    def name(self) -> str:
        return {"ppl": f"ppl+{self.value:g}%", "kld": f"kld<={self.value:g}", "top1": f"top1>={self.value:g}%",
                "sqnr": f"sqnr>={self.value:g}"}[self.metric]

    def __str__(self) -> str:
        return self.name

    @property
    def budget(self) -> float:
        """What the layers' predicted damages may add up to (see the class docstring)."""
        if self.metric == "ppl":
            return math.log1p(self.value / 100.0)
        if self.metric == "kld":
            return self.value
        if self.metric == "top1":
            return self._top1_kl(1.0 - self.value / 100.0)
        return 10.0 ** (-self.value / 10.0)

    @staticmethod
    def _top1_kl(disagreement: float) -> float:
        return (disagreement / _TOP1_PER_SQRT_KL) ** 2

    @property
    def damage_kind(self) -> str:
        """Which per-layer prediction the search adds up: 'kl' (next-token KL) or 'hidden_nsr'."""
        return "hidden_nsr" if self.metric == "sqnr" else "kl"

    def figure(self, measured: Mapping[str, Any]) -> tuple[float | None, list[float] | None]:
        """(point estimate, 95% interval or None) of the target's metric in its own unit (percent change for ppl,
        nats for kld, percent for top1, dB for sqnr)."""
        if self.metric == "ppl":
            ratio, ci = measured.get("perplexity_ratio"), measured.get("perplexity_ratio_ci")
            ci = ci or (None if ratio is None else token_interval(measured, ratio))
            return (None if ratio is None else 100.0 * (ratio - 1.0),
                    None if not ci else [100.0 * (ci[0] - 1.0), 100.0 * (ci[1] - 1.0)])
        if self.metric == "kld":
            kl = measured.get("kl") or {}
            return kl.get("mean"), kl.get("ci")
        if self.metric == "top1":
            top1, ci = measured.get("top1_agreement"), measured.get("top1_agreement_ci")
            return (None if top1 is None else 100.0 * top1, None if not ci else [100.0 * ci[0], 100.0 * ci[1]])
        return measured.get("hidden_sqnr_db"), None

    def _ok(self, value: float) -> bool:
        return value >= self.value if self.metric in ("top1", "sqnr") else value <= self.value

    def bound(self, measured: Mapping[str, Any]) -> float | None:
        """The figure the target is judged on: the interval's unfavourable end where there is one, else the point."""
        point, ci = self.figure(measured)
        if point is None:
            return None
        if ci is None:
            return point
        return ci[0] if self.metric in ("top1", "sqnr") else ci[1]

    def met(self, measured: Mapping[str, Any]) -> bool:
        """Whether an end-to-end measurement meets the target at its 95% confidence bound."""
        bound = self.bound(measured)
        return bound is not None and self._ok(bound)

    def resolution(self, measured: Mapping[str, Any]) -> dict[str, Any]:
        """How the measurement stands against the target: {point, ci, bound, met, point_met, resolved,
        tokens_needed, words}. Unresolved: the point meets the target but the interval reaches past it; then
        `tokens_needed` is about how many held-out tokens would shrink the interval inside the target (its
        half-width falls as 1/sqrt(tokens))."""
        point, ci = self.figure(measured)
        out: dict[str, Any] = {"target": self.name, "point": point, "ci": ci, "bound": self.bound(measured),
                               "met": self.met(measured), "point_met": point is not None and self._ok(point),
                               "resolved": True, "tokens_needed": None}
        n = (measured.get("n_predicted") or 0)
        if ci is not None and out["point_met"] and not out["met"]:
            half = (ci[1] - ci[0]) / 2.0
            room = abs(self.value - point)
            out["resolved"] = False
            if room > 0 and n:
                out["tokens_needed"] = int(math.ceil(n * (half / room) ** 2))
        unit = {"ppl": "%", "kld": " nats", "top1": "%", "sqnr": " dB"}[self.metric]
        if point is None:
            out["words"] = f"{self.name}: not measured"
        else:
            if self.metric == "ppl":
                shown = ppl_change(measured)  # the one wording of a perplexity change, as every report prints it
            else:
                shown = f"{point:.4g}{unit}" + ("" if ci is None else f" (95% CI {ci[0]:.4g}..{ci[1]:.4g}{unit})")
            if out["met"]:
                verdict = "meets"
            elif not out["resolved"]:
                more = f"; about {out['tokens_needed']:,} held-out tokens would resolve it" if out["tokens_needed"] else ""
                verdict = f"does not resolve (the interval reaches past the target{more})"
            else:
                verdict = "misses"
            out["words"] = f"{shown}: {verdict} {self.name}"
        return out

    def bound_spent(self, measured: Mapping[str, Any]) -> float | None:
        """The figure the target is judged on (`bound`) in budget units, as `spent` gives the point."""
        bound = self.bound(measured)
        if bound is None:
            return None
        if self.metric == "ppl":
            return math.log1p(bound / 100.0) if bound > -100.0 else -math.inf
        if self.metric == "kld":
            return bound
        if self.metric == "top1":
            return self._top1_kl(max(0.0, 1.0 - bound / 100.0))
        return 10.0 ** (-bound / 10.0)

    def spent(self, measured: Mapping[str, Any]) -> float | None:
        """The measured damage in budget units (see the class docstring), from the point estimate."""
        if self.metric == "ppl":
            ratio = measured.get("perplexity_ratio")
            return None if ratio is None else math.log(ratio)
        if self.metric == "kld":
            return (measured.get("kl") or {}).get("mean")
        if self.metric == "top1":
            top1 = measured.get("top1_agreement")
            return None if top1 is None else self._top1_kl(1.0 - top1)
        sqnr = measured.get("hidden_sqnr_db")
        return None if sqnr is None else 10.0 ** (-sqnr / 10.0)


def token_interval(measured: Mapping[str, Any], ratio: float) -> list[float] | None:
    """A perplexity ratio's 95% interval where the held-out text gave one sequence (no sequence-level interval):
    each predicted token an independent unit, the per-token log-likelihood ratio's variance about twice the mean KL
    divergence (its second-order value for a small change). Tokens of a passage are correlated, so this is narrower
    than the truth: a target this interval cannot resolve is not resolved by the text. None without a KL or tokens."""
    n = measured.get("n_predicted") or 0
    kl = (measured.get("kl") or {}).get("mean")
    if not n or kl is None or ratio <= 0:
        return None
    half = 1.96 * math.sqrt(2.0 * max(float(kl), 0.0) / n)
    return [ratio * math.exp(-half), ratio * math.exp(half)]


def _number(text: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise FFNQuantError(f"target {whole!r}: {text!r} is not a number; the forms are {TARGET_FORMS}") from None


def _count(value: Any, what: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise FFNQuantError(f"objective {what} must be an integer >= {least}, got {value!r}")
    return value


@dataclass(frozen=True)
class Workload:
    """The request the latency objective times: a prompt of `prompt` tokens in one call (the prefill), then
    `decode` steps of one token each with the KV cache. Its cost is prefill time + `decode` x one step's time,
    so a candidate fast on long prompts but slow per token (per-token dynamic int8 on a CPU) is costed as served."""

    prompt: int = 512
    decode: int = DECODE_TOKENS

    def __post_init__(self) -> None:
        _count(self.prompt, "prompt tokens", 1)
        _count(self.decode, "decode tokens", 0)

    def cost(self, prefill_ms: float, decode_ms: float) -> float:
        """The request's time from a prefill's and one decode step's."""
        return float(prefill_ms) + self.decode * float(decode_ms)

    @property
    def name(self) -> str:
        return f"a {self.prompt}-token prefill + {self.decode} decode steps"


@dataclass(frozen=True)
class Objective:
    """What the plan makes cheapest: `latency` (FFN stack time on `runtime`, measured, of the `tokens` workload) or
    `bytes` (stored weights). `tokens`: a Workload, or a prompt length (with `DECODE_TOKENS` decode steps)."""

    kind: str = "latency"
    runtime: str = "ort-cpu"
    tokens: Workload = Workload()

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise unknown_choice("objective", self.kind, OBJECTIVES)
        if not isinstance(self.runtime, str):
            raise FFNQuantError(f"plan runtime must be a name or a comma list of names, got {self.runtime!r}")
        names = tuple(n.strip().lower() for n in self.runtime.split(",") if n.strip())
        if not names:
            raise FFNQuantError(f"plan runtime is empty; valid: {', '.join(PLAN_RUNTIMES)}")
        for name in names:
            if name not in PLAN_RUNTIMES:
                raise unknown_choice("plan runtime", name, PLAN_RUNTIMES)
        for alone, what in (("ort-cpu", "the ONNX artifacts"), ("vllm-cpu", "a folder served by vLLM"),
                            ("genai-cpu", "the ONNX decoder in onnxruntime-genai")):
            if alone in names and len(names) > 1:
                # two measurement paths would put two clocks in one table
                raise FFNQuantError(f"plan runtime {self.runtime!r}: {alone} times {what} and cannot be listed "
                                    f"with other runtimes; give {alone} alone or a list of torch-module runtimes")
        if len(set(names)) != len(names):
            raise FFNQuantError(f"plan runtime {self.runtime!r} names a runtime twice")
        object.__setattr__(self, "runtime", ",".join(names))
        if not isinstance(self.tokens, Workload):
            object.__setattr__(self, "tokens", Workload(_count(self.tokens, "tokens", 1)))

    @property
    def runtimes(self) -> tuple[str, ...]:
        """The runtime names the latency table times on, in order of preference."""
        return tuple(self.runtime.split(","))

    @property
    def name(self) -> str:
        return f"latency on {self.runtime} of {self.tokens.name}" if self.kind == "latency" else "weight bytes"
