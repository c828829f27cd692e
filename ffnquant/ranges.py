"""What the range tables say: profile every variant, state findings in plain words, check the seeds' claims.

Everything here is derived from measured RangeTables; no outcome is hard-coded. The range report that
renders these (JSON, Markdown, plots) is `ffnquant.report.ranges`.
"""

from __future__ import annotations

import enum
from typing import Any, Mapping, Sequence

from .errors import FFNQuantError
from .numerics.observe import DEFAULT_BINS, RangeTable, profile_spec
from .spec import SITES, Activation, FFNSpec, Variant

__all__ = [
    "OUTLIER_K",
    "RELU_HALF_ZERO_BAND",
    "FFN_SHARE_BAND",
    "TRAINED_RELU_ZERO_BAND",
    "ClaimStatus",
    "profile_variants",
    "findings",
    "claims",
]

# "Outlier channel": absmax above this many times the median channel absmax.
OUTLIER_K = 6.0
# "About half" of ReLU units zero: accepted band for the zero fraction.
RELU_HALF_ZERO_BAND = (0.4, 0.6)
# "About two thirds" of a block's parameters in the FFN: accepted band.
FFN_SHARE_BAND = (0.6, 0.72)
# "Roughly 90-95%" of trained ReLU units zero: accepted band, a little wider than the claim.
TRAINED_RELU_ZERO_BAND = (0.85, 0.97)
_SPARSE_ZERO_FRACTION = 0.01  # a site counts as sparse above 1% exact zeros


class ClaimStatus(str, enum.Enum):
    CONFIRMED = "confirmed"
    CONTRADICTED = "contradicted"
    MIXED = "mixed"
    NOT_MEASURED = "not measured"

    def __str__(self) -> str:
        return self.value


# =====================================================================================
# Measuring
# =====================================================================================


def profile_variants(
    specs: Sequence[FFNSpec],
    source,
    n_tokens: int,
    seed: int = 0,
    batch_size: int = 1024,
    bins: int = DEFAULT_BINS,
    sites: Sequence[str] | None = None,
) -> dict[str, RangeTable]:
    """Profile each spec (weights from `seed`) on the same `n_tokens` tokens of `source`; keyed by variant."""
    keys = [s.variant.value for s in specs]
    if not specs:
        raise FFNQuantError("no variants to profile")
    dup = sorted({k for k in keys if keys.count(k) > 1})
    if dup:
        raise FFNQuantError(f"variant(s) {dup} given more than once; the range report has one column per variant")
    out: dict[str, RangeTable] = {}
    for spec in specs:
        wanted = None if sites is None else [s for s in sites if s in spec.sites]
        out[spec.variant.value] = profile_spec(spec, source, n_tokens, seed=seed, batch_size=batch_size, bins=bins, sites=wanted)
    return out


# =====================================================================================
# Findings and claims (plain words from numbers)
# =====================================================================================


def _site_stat(tables: Mapping[str, RangeTable], site: str, stat: str) -> dict[str, float]:
    out = {}
    for v, t in tables.items():
        if site in t:
            value = getattr(t[site], stat)
            if value == value:  # skip nan (empty/constant)
                out[v] = float(value)
    return out


def _ranked(values: Mapping[str, float]) -> list[tuple[str, float]]:
    return sorted(values.items(), key=lambda kv: kv[1], reverse=True)


def pct(x: float) -> str:
    return f"{100 * x:.1f}%"


_FAMILY_KEYS = frozenset(v.value for v in Variant)


def _family(tables: Mapping[str, RangeTable]) -> dict[str, RangeTable]:
    """The synthetic FFN-family entries (keyed by variant); real-model layers are keyed 'arch:Lk'."""
    return {k: t for k, t in tables.items() if k in _FAMILY_KEYS}


def _model_layers(tables: Mapping[str, RangeTable]) -> dict[str, RangeTable]:
    return {k: t for k, t in tables.items() if k not in _FAMILY_KEYS}


def _uses_relu(table: RangeTable) -> bool:
    return table.spec is not None and table.spec.activation is Activation.RELU


def findings(tables: Mapping[str, RangeTable]) -> list[dict[str, Any]]:
    """Plain-words statements derived from the measured numbers, each with its figures."""
    out: list[dict[str, Any]] = []
    crest = _site_stat(tables, "hidden", "crest_factor")
    kurt = _site_stat(tables, "hidden", "kurtosis")
    if crest:
        rc, rk = _ranked(crest), _ranked(kurt)
        listing = ", ".join(f"{v} {c:.1f}" for v, c in rc)
        text = f"Widest `hidden` range (the down projection's input) by crest factor absmax/std: {listing}."
        if len(rc) > 1:
            text += (
                f" {rc[0][0]}'s largest value lies {rc[0][1] / rc[-1][1]:.1f}x as many standard deviations out as "
                f"{rc[-1][0]}'s."
            )
        if rk:
            text += f" By kurtosis (3 = Gaussian) the heaviest tails are {rk[0][0]}'s ({rk[0][1]:.1f}), the lightest {rk[-1][0]}'s ({rk[-1][1]:.1f})."
        out.append({"id": "widest_hidden", "text": text, "figures": {"crest_factor": crest, "kurtosis": kurt}})

        family_crest = {v: c for v, c in crest.items() if v in _FAMILY_KEYS}
        gated = {v: c for v, c in family_crest.items() if tables[v].spec is not None and tables[v].spec.gated}
        dense = {v: c for v, c in family_crest.items() if v not in gated}
        if gated and dense:
            g = sum(gated.values()) / len(gated)
            d = sum(dense.values()) / len(dense)
            relation = "wider" if g > d else "narrower"
            out.append(
                {
                    "id": "gated_vs_dense",
                    "text": (
                        f"Gated variants' `hidden` (activation x value product) is {relation} than the dense variants': "
                        f"mean crest factor {g:.1f} vs {d:.1f} ({g / d:.2f}x)."
                    ),
                    "figures": {"gated_mean_crest": g, "dense_mean_crest": d},
                }
            )

    zeros = _site_stat(tables, "hidden", "zero_fraction")
    if zeros:
        sparse = {v: z for v, z in zeros.items() if z > _SPARSE_ZERO_FRACTION}
        others = {v: z for v, z in zeros.items() if v not in sparse}
        if sparse:
            text = "Sparse `hidden`: " + ", ".join(f"{v} {pct(z)}" for v, z in _ranked(sparse)) + " of values exactly zero"
            relu_like = [v for v in sparse if _uses_relu(tables[v])]
            if relu_like and len(relu_like) == len(sparse):
                text += " (the ReLU-gated variants)"
            text += "."
            if others:
                top = max(others.values())
                text += f" The other variants have at most {pct(top)} exact zeros, so an int8 grid spends no codes on a zero spike there."
            else:
                text += " Every profiled variant is sparse."
        else:
            text = f"No variant has more than {pct(_SPARSE_ZERO_FRACTION)} exact zeros in `hidden` (largest {pct(max(zeros.values()))})."
        out.append({"id": "relu_sparsity", "text": text, "figures": {"zero_fraction": zeros}})

    dead = {v: t["hidden"].dead_units for v, t in tables.items() if "hidden" in t}
    if dead:
        n_tok = max(t.n_tokens for t in tables.values())
        with_dead = {v: n for v, n in dead.items() if n}
        if with_dead:
            text = "Dead `hidden` units (exactly zero for every one of the tokens): " + ", ".join(
                f"{v} {n} of {tables[v]['hidden'].channels}" for v, n in with_dead.items()
            ) + "."
        else:
            text = f"No dead `hidden` units in any variant over {n_tok:,} tokens: every unit was non-zero at least once."
        out.append({"id": "dead_units", "text": text, "figures": {"dead_units": dead}})

    outliers: dict[str, dict[str, int]] = {}
    for site in SITES:
        counts = {v: t[site].outlier_channels(OUTLIER_K) for v, t in tables.items() if site in t}
        if counts:
            outliers[site] = counts
    parts = []
    for site, counts in outliers.items():
        nonzero = {v: c for v, c in counts.items() if c}
        if not nonzero:
            continue
        if len(set(counts.values())) == 1:
            parts.append(f"`{site}` {next(iter(counts.values()))} in every variant")
        else:
            parts.append(f"`{site}` " + ", ".join(f"{v} {c}" for v, c in nonzero.items()))
    if outliers:
        text = f"Outlier channels (absmax above {OUTLIER_K:g}x the median channel's): " + (
            "; ".join(parts) + "." if parts else "none at any site."
        )
        if parts and "input" in outliers and any(outliers["input"].values()):
            text += " Per-tensor int8 ranges at such sites are set by these few channels; per-channel smoothing or rotation targets them."
        out.append({"id": "outlier_channels", "text": text, "figures": {"outlier_channels": outliers, "k": OUTLIER_K}})

    # Trained weights against the random-weight variant of the same family: the seeds'
    # generalisations are about random weights, real checkpoints are the real test.
    ratios = {}
    for key, table in _model_layers(tables).items():
        twin = table.spec.variant.value if table.spec is not None else None
        if twin in crest and key in crest and crest[twin] > 0:
            ratios[key] = (twin, crest[key], crest[twin])
    if ratios:
        parts = [f"{k} {c:.1f} vs {t} {ct:.1f} ({c / ct:.1f}x)" for k, (t, c, ct) in ratios.items()]
        out.append(
            {
                "id": "trained_vs_synthetic",
                "text": "Real-model layers against the random-weight variant of the same family, `hidden` crest factor: "
                + "; ".join(parts) + ".",
                "figures": {k: {"variant": t, "model_crest": c, "synthetic_crest": ct} for k, (t, c, ct) in ratios.items()},
            }
        )
    return out


def _leader(values: Mapping[str, float], name: str) -> str:
    """'swiglu widest (22.1; next geglu 20.6)' or 'geglu widest (21.0; swiglu 19.2)'."""
    ranked = _ranked(values)
    top, top_v = ranked[0]
    if top == name:
        nxt = f"; next {ranked[1][0]} {ranked[1][1]:.1f}" if len(ranked) > 1 else ""
        return f"{name} widest ({top_v:.1f}{nxt})"
    return f"{top} widest ({top_v:.1f}; {name} {values[name]:.1f})"


def _verdict(checks: Sequence[bool]) -> ClaimStatus:
    """Confirmed if every measurement agrees with the claim, contradicted if none does, else mixed."""
    return ClaimStatus.CONFIRMED if all(checks) else ClaimStatus.CONTRADICTED if not any(checks) else ClaimStatus.MIXED


def _claim(cid: str, claim: str, source: str, status: ClaimStatus, detail: str, figures: dict) -> dict[str, Any]:
    return {"id": cid, "claim": claim, "source": source, "status": status.value, "detail": detail, "figures": figures}


def claims(tables: Mapping[str, RangeTable]) -> list[dict[str, Any]]:
    """Check the seeds' measurable claims against the tables; each is confirmed, contradicted,
    mixed or not measured, with the figures that decided it."""
    out = []
    lo, hi = RELU_HALF_ZERO_BAND
    claim = "About half of the ReLU FFN's hidden units are exactly zero at initialisation."
    src = "ReLU FFN seed text (2017)"
    if "relu" in tables and "hidden" in tables["relu"]:
        z = tables["relu"]["hidden"].zero_fraction
        ok = lo <= z <= hi
        out.append(
            _claim(
                "relu_half_zero", claim, src,
                ClaimStatus.CONFIRMED if ok else ClaimStatus.CONTRADICTED,
                f"measured {pct(z)} of relu `hidden` values exactly zero ({'inside' if ok else 'outside'} the {pct(lo)}-{pct(hi)} band)",
                {"zero_fraction": z, "band": [lo, hi]},
            )
        )
    else:
        out.append(_claim("relu_half_zero", claim, src, ClaimStatus.NOT_MEASURED, "relu was not profiled", {}))

    claim = "SwiGLU's gate*value product has a wider range than ReLU's hidden activation."
    src = "SwiGLU/GELU/ReLU seed comparison"
    if all(v in tables and "hidden" in tables[v] for v in ("swiglu", "relu")):
        s, r = tables["swiglu"]["hidden"], tables["relu"]["hidden"]
        wider = [s.crest_factor > r.crest_factor, s.kurtosis > r.kurtosis]
        status = _verdict(wider)
        out.append(
            _claim(
                "swiglu_wider_than_relu", claim, src, status,
                f"crest factor swiglu {s.crest_factor:.1f} vs relu {r.crest_factor:.1f}; "
                f"kurtosis swiglu {s.kurtosis:.1f} vs relu {r.kurtosis:.1f}",
                {
                    "crest_factor": {"swiglu": s.crest_factor, "relu": r.crest_factor},
                    "kurtosis": {"swiglu": s.kurtosis, "relu": r.kurtosis},
                },
            )
        )
    else:
        out.append(_claim("swiglu_wider_than_relu", claim, src, ClaimStatus.NOT_MEASURED, "needs both swiglu and relu", {}))

    claim = "SwiGLU's product has the widest range of the FFN family."
    src = "seed texts: the gated variants' generalisation"
    family = _family(tables)
    crest = _site_stat(family, "hidden", "crest_factor")
    kurt = _site_stat(family, "hidden", "kurtosis")
    if "swiglu" in crest and len(crest) > 1:
        top_c, top_k = _ranked(crest)[0], _ranked(kurt)[0]
        widest = [top_c[0] == "swiglu", top_k[0] == "swiglu"]
        status = _verdict(widest)
        out.append(
            _claim(
                "swiglu_widest", claim, src, status,
                f"by crest factor: {_leader(crest, 'swiglu')}; by kurtosis: {_leader(kurt, 'swiglu')}; "
                f"among {len(crest)} variants",
                {"crest_factor": crest, "kurtosis": kurt},
            )
        )
    else:
        out.append(_claim("swiglu_widest", claim, src, ClaimStatus.NOT_MEASURED, "needs swiglu and at least one other variant", {}))

    claim = "90-95% of ReLU FFN hidden units are exactly zero on a typical token in trained models."
    src = "seed 001 (SwiGLU, GELU and ReLU FFNs)"
    trained_relu = {k: t["hidden"].zero_fraction for k, t in _model_layers(tables).items()
                    if _uses_relu(t) and "hidden" in t}
    if trained_relu:
        lo, hi = TRAINED_RELU_ZERO_BAND
        inside = [lo <= z <= hi for z in trained_relu.values()]
        status = _verdict(inside)
        out.append(_claim("trained_relu_sparsity", claim, src, status,
                          "exact zeros in `hidden`: " + ", ".join(f"{k} {pct(z)}" for k, z in trained_relu.items())
                          + f" (band {pct(lo)}-{pct(hi)})", {"zero_fraction": trained_relu, "band": [lo, hi]}))
    else:
        out.append(_claim("trained_relu_sparsity", claim, src, ClaimStatus.NOT_MEASURED,
                          "needs a trained ReLU model's layers (--model with an opt or t5 checkpoint)", {}))

    claim = "The FFN holds about two thirds of a transformer block's parameters."
    src = "transformer block arithmetic (attention 4 d^2)"
    lo, hi = FFN_SHARE_BAND
    # The synthetic family: ffnquant's FFNs next to a full multi-head attention of 4 d^2 (the claim's own
    # arithmetic). A real model's layers are never counted here: its attention is what its config.json says.
    shares = {}
    for v, t in _family(tables).items():
        if t.spec is not None:
            d = t.spec.d_model
            attention = 4 * d * d + (4 * d if t.spec.bias else 0)
            shares[v] = t.spec.n_params / (t.spec.n_params + attention)
    if shares:
        inside = [lo <= s <= hi for s in shares.values()]
        status = _verdict(inside)
        out.append(
            _claim(
                "ffn_two_thirds", claim, src, status,
                "synthetic family, FFN share of block parameters: " + ", ".join(f"{v} {pct(s)}" for v, s in shares.items())
                + f" (band {pct(lo)}-{pct(hi)}; attention counted as 4 d^2 projections)",
                {"ffn_share": shares, "band": [lo, hi]},
            )
        )
    out.extend(_model_ffn_share_claims(tables, claim))
    return out


def _model_ffn_share_claims(tables: Mapping[str, RangeTable], claim: str) -> list[dict[str, Any]]:
    """The two-thirds claim checked per real model, from its own shapes (config.json's heads, key/value heads,
    head width, d_model, FFN width and experts: `hf.ModelInfo.block_params`, carried in the layers' meta)."""
    lo, hi = FFN_SHARE_BAND
    models: dict[str, Mapping[str, Any] | None] = {}
    for key, t in _model_layers(tables).items():
        name = key.split(":", 1)[0]
        block = t.meta.get("model_block") if isinstance(t.meta, Mapping) else None
        if models.get(name) is None:
            models[name] = block
    out = []
    for name, block in models.items():
        text = f"{claim[:-1]} ({name}, from its own config.json)."
        cid = f"ffn_two_thirds:{name}"
        src = f"{name}'s config.json (attention q/k/v/o as its heads and key/value heads give them)"
        attn = (block or {}).get("attention")
        share = (block or {}).get("ffn_share")
        if not attn or share is None:
            reason = (block or {}).get("reason") or "the layers carry no shapes of their model's attention"
            out.append(_claim(cid, text, src, ClaimStatus.NOT_MEASURED, reason, {}))
            continue
        ok = lo <= share <= hi
        heads = f"{attn['n_heads']} heads"
        heads += (f", {attn['n_kv_heads']} key/value heads (grouped-query)" if attn["n_kv_heads"] != attn["n_heads"]
                  else " (no key/value sharing)")
        cross = block.get("cross_attention_blocks") or 0
        detail = (f"{name}: FFN {pct(share)} of a block's FFN + attention parameters ({'inside' if ok else 'outside'} "
                  f"the {pct(lo)}-{pct(hi)} band): FFN {block['ffn_params_per_block']:,}, attention {attn['params']:,} "
                  f"per block (d_model {attn['d_model']}, {heads}, head_dim {attn['head_dim']})"
                  + (f"; {cross} decoder blocks add a cross-attention" if cross else ""))
        out.append(_claim(cid, text, src, ClaimStatus.CONFIRMED if ok else ClaimStatus.CONTRADICTED, detail,
                          {"ffn_share": share, "band": [lo, hi], "block": dict(block)}))
    return out


# =====================================================================================
# Rendering
# =====================================================================================
