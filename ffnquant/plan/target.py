"""What a plan must meet end to end (`Target`) and what it makes cheapest (`Objective`). Frozen and validated."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..errors import FFNQuantError, unknown_choice

__all__ = ["Target", "Objective", "OBJECTIVES", "TARGET_FORMS"]

TARGET_FORMS = "ppl+P% (perplexity at most P% above the float model's) or sqnr>=DB (final hidden state SQNR)"
OBJECTIVES = ("latency", "bytes")


@dataclass(frozen=True)
class Target:
    """`ppl+1%`: held-out perplexity at most 1% above float; `sqnr>=30`: final hidden state SQNR of at least 30 dB.

    `budget` is what the search spends: the allowed increase of the mean negative log-likelihood (nats per
    token: log(1 + P/100)) or the allowed final-hidden noise-to-signal ratio (10^(-DB/10)); both add up
    over layers to first order, which is what the search assumes and the verification checks.
    """

    metric: str  # "ppl" or "sqnr"
    value: float  # percent for ppl, dB for sqnr

    def __post_init__(self) -> None:
        if self.metric not in ("ppl", "sqnr"):
            raise unknown_choice("target metric", self.metric, ("ppl", "sqnr"))
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)) or not math.isfinite(self.value):
            raise FFNQuantError(f"target {self.metric}: the value must be a number, got {self.value!r}")
        if self.metric == "ppl" and not 0 < self.value <= 100:
            raise FFNQuantError(f"target ppl+{self.value:g}%: the increase must be in (0, 100] percent")
        if self.metric == "sqnr" and not 0 < self.value <= 120:
            raise FFNQuantError(f"target sqnr>={self.value:g}: the SQNR must be in (0, 120] dB")
        object.__setattr__(self, "value", float(self.value))

    @classmethod
    def parse(cls, text: str) -> "Target":
        raw = str(text).strip().lower().replace(" ", "")
        m = re.fullmatch(r"ppl\+([0-9.]+)%", raw)
        if m:
            return cls("ppl", _number(m.group(1), text))
        m = re.fullmatch(r"sqnr>=([0-9.]+)(?:db)?", raw)
        if m:
            return cls("sqnr", _number(m.group(1), text))
        raise FFNQuantError(f"target {text!r} is not one of: {TARGET_FORMS}")

    @property
    def name(self) -> str:
        return f"ppl+{self.value:g}%" if self.metric == "ppl" else f"sqnr>={self.value:g}"

    def __str__(self) -> str:
        return self.name

    @property
    def budget(self) -> float:
        """What the layers' predicted damages may add up to (see the class docstring)."""
        return math.log1p(self.value / 100.0) if self.metric == "ppl" else 10.0 ** (-self.value / 10.0)

    def met(self, measured: dict) -> bool:
        """Whether an end-to-end measurement ({'perplexity_ratio', 'hidden_sqnr_db'}) meets the target."""
        if self.metric == "ppl":
            ratio = measured.get("perplexity_ratio")
            return ratio is not None and ratio <= 1.0 + self.value / 100.0
        sqnr = measured.get("hidden_sqnr_db")
        return sqnr is not None and sqnr >= self.value

    def spent(self, measured: dict) -> float | None:
        """The measured damage in budget units (nats per token, or noise-to-signal ratio)."""
        if self.metric == "ppl":
            ratio = measured.get("perplexity_ratio")
            return None if ratio is None else math.log(ratio)
        sqnr = measured.get("hidden_sqnr_db")
        return None if sqnr is None else 10.0 ** (-sqnr / 10.0)


def _number(text: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise FFNQuantError(f"target {whole!r}: {text!r} is not a number; the forms are {TARGET_FORMS}") from None


@dataclass(frozen=True)
class Objective:
    """What the plan makes cheapest: `latency` (FFN stack time on `runtime`, measured) or `bytes` (stored weights)."""

    kind: str = "latency"
    runtime: str = "ort-cpu"
    tokens: int = 512

    def __post_init__(self) -> None:
        if self.kind not in OBJECTIVES:
            raise unknown_choice("objective", self.kind, OBJECTIVES)
        if self.runtime != "ort-cpu":
            # the latency table times ffnquant's ONNX artifacts; only the CPU provider runs them on this machine
            raise unknown_choice("plan runtime", self.runtime, ("ort-cpu",))
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or self.tokens <= 0:
            raise FFNQuantError(f"objective tokens must be a positive integer, got {self.tokens!r}")

    @property
    def name(self) -> str:
        return f"latency on {self.runtime} at {self.tokens} tokens" if self.kind == "latency" else "weight bytes"
