"""The main job: profile, quantize, export, benchmark and report every FFN variant in one run.

`RunConfig` is frozen and validated and round-trips through a dict and TOML, so a run can be
repeated exactly (`ffnquant run --config reports/run.toml`). `run(config)` returns a
`RunResult` holding the report document and the paths written; it measures and writes but
never prints (the CLI renders the progress and the summary).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .errors import FFNQuantError, unknown_choice
from .render import display_path
from .recipe import DEFAULT_SMOOTH_ALPHA, Recipe, parse_recipe
from .spec import FFNSpec, Variant, parse_variants

__all__ = [
    "CONFIG_VERSION",
    "DEFAULT_SCHEMES",
    "DEFAULT_TOKENS",
    "Recipe",
    "parse_recipe",
    "RunConfig",
    "RunResult",
    "load_config",
    "run",
]

CONFIG_VERSION = 1
# The default set: float baselines, int8 weight-only, static int8 with the best calibrator
# per site, dynamic int8, 4-bit group-wise and bitsandbytes' NF4; smoothed static int8 uses
# `search` (per site by the FFN's output SQNR), because after smoothing a per-tensor histogram
# cannot see the rescaled weight columns and `auto` falls behind (swiglu d=512: 28.8 vs 31.1 dB),
# plus smoothing with rotation, the one recipe that brings geglu's int8 over 30 dB.
DEFAULT_SCHEMES: tuple[str, ...] = (
    "fp32", "fp16", "w8a16", "w8a8@auto", "w8a8@search+smooth", "w8a8@search+smooth+rotate",
    "w8a8-dynamic", "w4a16-g128", "nf4",
)
# Decode (1, 16) and one prefill block (512): enough to see both regimes within the 5-minute budget.
DEFAULT_TOKENS: tuple[int, ...] = (1, 16, 512)
# What speedups and recommendations are measured against: an unquantized scheme.
FLOAT_BASELINES: tuple[str, ...] = ("fp32", "fp16")


# --- the configuration ---------------------------------------------------------------------

def _tuple_of_str(value: Any, what: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [v for v in value.split(",")]
    if not isinstance(value, (list, tuple)):
        raise FFNQuantError(f"{what} must be a list or a comma-separated string, got {value!r}")
    out = tuple(str(v).strip() for v in value if str(v).strip())
    return out


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FFNQuantError(f"{what} must be a positive integer, got {value!r}")
    return value


def _positive_float(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise FFNQuantError(f"{what} must be a positive number, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RunConfig:
    """Everything that decides a run's numbers (and where it writes). Frozen and validated.

    `runtimes=("available",)` means every runtime that is really available on the machine,
    `("none",)` measures no latency (accuracy only); naming a runtime that is not available is an error. `source` is "gaussian", "llm_like",
    "file:PATH" or a .npy/.safetensors path (see `ffnquant.data.parse_source`).
    """

    variants: tuple[str, ...] = tuple(v.value for v in Variant)
    d_model: int = 512
    d_ff: int | None = None
    multiple_of: int | None = None
    ffn_dim_multiplier: float | None = None
    bias: bool | None = None
    seed: int = 0
    source: str = "llm_like"
    n_outlier_channels: int = 4
    outlier_scale: float = 50.0
    calib_tokens: int = 4096
    eval_tokens: int = 2048
    batch_size: int = 1024
    bins: int = 2048
    schemes: tuple[str, ...] = DEFAULT_SCHEMES
    baseline: str = "fp32"
    target_db: float = 30.0
    sensitivity: bool = True
    onnx: bool = True
    runtimes: tuple[str, ...] = ("available",)
    tokens: tuple[int, ...] = DEFAULT_TOKENS
    budget_s: float = 0.04
    out_reports: str = "reports"
    out_export: str = "export"
    # A real model's FFN layers side by side with the variants: a local Hugging Face folder, its layers
    # ("0-3", "0,5,7"; None = all), calibration text and held-out evaluation text (None = shipped samples).
    model: str | None = None
    layers: str | None = None
    text: str | None = None
    eval_text: str | None = None
    version: int = CONFIG_VERSION

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass)
        if self.version != CONFIG_VERSION:
            raise FFNQuantError(f"run config version {self.version!r} is not supported (expected {CONFIG_VERSION})")
        set_("variants", tuple(v.value for v in parse_variants(list(_tuple_of_str(self.variants, "variants")) or None)))
        schemes = tuple(parse_recipe(s).name for s in _tuple_of_str(self.schemes, "schemes"))
        if not schemes:
            raise FFNQuantError("schemes must name at least one scheme")
        if len(set(schemes)) != len(schemes):
            raise FFNQuantError(f"schemes lists a scheme twice: {', '.join(schemes)}")
        set_("schemes", schemes)
        runtimes = tuple(r.lower() for r in _tuple_of_str(self.runtimes, "runtimes")) or ("available",)
        if ("available" in runtimes or "none" in runtimes) and len(runtimes) > 1:
            raise FFNQuantError("runtimes: give 'available' or 'none' alone, or a list of runtime names")
        set_("runtimes", runtimes)
        tokens = self.tokens
        if isinstance(tokens, str):
            try:
                tokens = [int(t) for t in tokens.split(",") if t.strip()]
            except ValueError:
                raise FFNQuantError(f"tokens must be comma-separated positive integers, got {self.tokens!r}") from None
        if not isinstance(tokens, (list, tuple)) or not tokens:
            raise FFNQuantError(f"tokens must list at least one token count, got {self.tokens!r}")
        set_("tokens", tuple(sorted({_positive_int(t, "tokens") for t in tokens})))
        for name in ("d_model", "calib_tokens", "eval_tokens", "batch_size", "bins", "n_outlier_channels"):
            if name == "n_outlier_channels" and self.n_outlier_channels == 0:
                continue
            _positive_int(getattr(self, name), name)
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise FFNQuantError(f"seed must be a non-negative integer, got {self.seed!r}")
        set_("outlier_scale", _positive_float(self.outlier_scale, "outlier_scale"))
        set_("budget_s", _positive_float(self.budget_s, "budget_s"))
        if isinstance(self.target_db, bool) or not isinstance(self.target_db, (int, float)) or not math.isfinite(self.target_db):
            raise FFNQuantError(f"target_db must be a number of dB, got {self.target_db!r}")
        set_("target_db", float(self.target_db))
        for name in ("sensitivity", "onnx"):
            if not isinstance(getattr(self, name), bool):
                raise FFNQuantError(f"{name} must be true or false, got {getattr(self, name)!r}")
        try:
            base_recipe = parse_recipe(self.baseline)
        except FFNQuantError as exc:
            raise FFNQuantError(f"baseline: {exc}") from None
        base = base_recipe.name
        if base_recipe.calibrator or base_recipe.smooth is not None or base_recipe.rotate or \
                base_recipe.scheme not in FLOAT_BASELINES:
            raise FFNQuantError(f"baseline {base!r} must be a float scheme (speedups are measured against it); "
                                f"valid: {', '.join(FLOAT_BASELINES)}")
        if base not in schemes:
            raise FFNQuantError(f"baseline {base!r} must be one of the schemes ({', '.join(schemes)})")
        set_("baseline", base)
        for name in ("out_reports", "out_export", "source"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise FFNQuantError(f"{name} must be a non-empty string, got {value!r}")
        if self.d_ff is not None and self.ffn_dim_multiplier is not None:
            raise FFNQuantError("d_ff and ffn_dim_multiplier are exclusive: give the width or the rule's multiplier")
        self._check_model_fields()
        self.specs()  # validates the sizes now, not halfway through a run
        self.token_source()

    def _check_model_fields(self) -> None:
        layers = self.layers
        if isinstance(layers, (list, tuple)):  # TOML/JSON lists of indices read as the CLI's "0,5,7"
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
                raise FFNQuantError(f"layers must be a string like '0-3' or a list of layer indices, got {layers!r}")
            layers = ",".join(str(i) for i in layers)
        elif isinstance(layers, int) and not isinstance(layers, bool):
            layers = str(layers)
        if isinstance(layers, str) and layers.strip().lower() in ("", "all"):
            layers = None
        object.__setattr__(self, "layers", layers)
        for name in ("model", "layers", "text", "eval_text"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise FFNQuantError(f"{name} must be a non-empty string, got {value!r}")
        if self.model is None:
            given = [n for n in ("layers", "text", "eval_text") if getattr(self, n) is not None]
            if given:
                raise FFNQuantError(f"{', '.join(given)} select(s) a real model's layers or texts: give model too")

    # --- derived -------------------------------------------------------------------
    @property
    def recipes(self) -> tuple[Recipe, ...]:
        return tuple(parse_recipe(s) for s in self.schemes)

    def specs(self) -> list[FFNSpec]:
        return [
            FFNSpec(v, d_model=self.d_model, d_ff=self.d_ff, bias=self.bias, multiple_of=self.multiple_of,
                    ffn_dim_multiplier=self.ffn_dim_multiplier)
            for v in self.variants
        ]

    def token_source(self):
        """The `ffnquant.data.TokenSource` the config names (validated; files are read later)."""
        from .data import parse_source

        return parse_source(self.source, seed=self.seed, n_outlier_channels=self.n_outlier_channels,
                            outlier_scale=self.outlier_scale)

    # --- presets and serialisation ---------------------------------------------------
    @classmethod
    def tiny(cls, **changes: Any) -> "RunConfig":
        """A seconds-long configuration for tests and smoke runs: d_model 64, 3 variants, few tokens."""
        base = dict(variants=("relu", "gelu", "swiglu"), d_model=64, calib_tokens=512, eval_tokens=256, batch_size=256,
                    bins=512, schemes=("fp32", "w8a8@auto", "w8a8@auto+smooth", "w8a8-dynamic", "w4a16-g32"),
                    tokens=(1, 64), budget_s=0.005)
        base.update(changes)
        return cls(**base)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "RunConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        extra = sorted(set(data) - known)
        if extra:
            raise FFNQuantError(f"unknown run config key(s) {', '.join(extra)}; valid: {', '.join(sorted(known))}")
        return cls(**dict(data))

    def to_toml(self) -> str:
        """TOML text that `load_config` reads back to an equal config (None fields are left out:
        TOML has no null, and absent means the default None)."""
        import tomli_w  # the well-kept TOML writer; tomllib only reads

        data = {k: v for k, v in self.to_dict().items() if v is not None}
        return "# ffnquant run configuration; repeat the run with: ffnquant run --config THIS_FILE\n" + tomli_w.dumps(data)

    def with_(self, **changes: Any) -> "RunConfig":
        return dataclasses.replace(self, **changes)


def load_config(path: str | os.PathLike) -> RunConfig:
    """Read a RunConfig from a TOML file; unreadable or invalid files raise FFNQuantError naming the file."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]

    p = Path(path)
    if p.exists() and not p.is_file():
        # a FIFO or a device would block the read forever; a folder cannot be parsed
        raise FFNQuantError(f"config file {str(p)!r} is not a regular file; give a TOML file written by 'ffnquant run'")
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FFNQuantError(f"config file {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise FFNQuantError(f"cannot read config file {str(p)!r}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise FFNQuantError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    try:
        return RunConfig.from_dict(data)
    except FFNQuantError as exc:
        raise FFNQuantError(f"config file {str(p)!r}: {exc}") from None
    except TypeError as exc:
        raise FFNQuantError(f"config file {str(p)!r}: {exc}") from None


# --- the run ---------------------------------------------------------------------------------

# (message, done, total): called after each unit of work; the CLI draws a progress bar from it.
Progress = Callable[[str, int, int], None]

@dataclass
class RunResult:
    """The report document of a run and the files written."""

    config: RunConfig
    document: dict[str, Any]
    paths: dict[str, Path] = field(default_factory=dict)

    @property
    def recommendations(self) -> list[dict[str, Any]]:
        return self.document["timing"]["recommendations"]

    @property
    def primary_tokens(self) -> int | None:
        return self.document["timing"]["latency"].get("primary_tokens")


class _Stages:
    """Wall time per named stage (for the report's timing section)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds


def _compact_histogram(hist: Any, max_bins: int = 256) -> dict[str, list] | None:
    """The observer's histogram folded to at most `max_bins` bins, with empty tails trimmed (for plots)."""
    import numpy as np

    counts = np.asarray(hist.counts, dtype=np.int64)
    edges = np.asarray(hist.edges, dtype=np.float64)
    if counts.sum() == 0:
        return None
    nz = np.nonzero(counts)[0]
    lo, hi = int(nz[0]), int(nz[-1]) + 1
    counts, edges = counts[lo:hi], edges[lo : hi + 1]
    factor = max(1, math.ceil(len(counts) / max_bins))
    pad = (-len(counts)) % factor
    if pad:
        counts = np.concatenate([counts, np.zeros(pad, dtype=np.int64)])
        step = edges[-1] - edges[-2]
        edges = np.concatenate([edges, edges[-1] + step * np.arange(1, pad + 1)])
    folded = counts.reshape(-1, factor).sum(axis=1)
    return {"edges": [float(e) for e in edges[::factor]], "counts": [int(c) for c in folded]}


def _json_num(x: Any) -> float | None:
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _select_runtimes(config: RunConfig) -> list[tuple[str, Any, Any]]:
    """[(name, Availability, Runtime)] to measure on. Explicitly named unavailable runtimes are an error."""
    from .runtimes import get_runtime, runtime_names

    if config.runtimes == ("none",):
        return []
    names = runtime_names() if config.runtimes == ("available",) else config.runtimes
    out = []
    for name in names:
        rt = get_runtime(name)  # unknown names raise, listing the valid ones
        avail = rt.availability()
        if not avail.available and config.runtimes != ("available",):
            raise FFNQuantError(f"runtime {name!r} is not available here: {avail.reason}")
        out.append((name, avail, rt))
    return out


def _claim_activation_time(model: Any, tokens: Any) -> dict[str, Any]:
    """Time the nonlinearity alone against the whole FFN forward (torch, CPU), median of a few repeats."""
    import statistics

    import torch

    def median_time(fn: Callable[[], Any], repeats: int = 7) -> float:
        fn()
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    with torch.no_grad():
        pre = (model.w_gate if model.w_gate is not None else model.w_up)(tokens)
        t_act = median_time(lambda: model.activation(pre))
        t_ffn = median_time(lambda: model(tokens))
    share = t_act / t_ffn
    v = model.spec.variant.value
    return {
        "claim": f"the activation is at most about 1% of the FFN's wall-clock time ({v})",
        "status": "confirmed" if share <= 0.015 else "contradicted",
        "figure": f"{1e6 * t_act:.0f} us of {1e6 * t_ffn:.0f} us at M={tokens.shape[0]} in torch on CPU: {100 * share:.1f}%",
        "source": "ffnquant.run (torch timing)",
    }


def _range_section(tables: Mapping[str, Any], specs: Sequence[FFNSpec], missing: list[dict]) -> tuple[dict, list[dict]]:
    """The report's `ranges` object and the range issue's claims (when its report module is installed)."""
    variants = {}
    for v, table in tables.items():
        summ = table.summary()
        variants[v] = {
            "sites": summ["sites"],
            "weights": summ["weights"],
            "hidden_histogram": _compact_histogram(table["hidden"].histogram) if "hidden" in table else None,
            "n_tokens": table.n_tokens,
        }
    section: dict[str, Any] = {"status": "ok", "reason": None, "variants": variants, "findings": [], "markdown": None}
    claims: list[dict] = []
    try:
        from . import rangereport
    except ImportError as exc:
        section["status"] = "partial"
        section["reason"] = f"range findings need ffnquant.rangereport ({exc})"
        missing.append({"part": "range findings and claims", "reason": section["reason"]})
        return section, claims
    section["findings"] = [f["text"] if isinstance(f, dict) else str(f) for f in rangereport.findings(tables)]
    for c in rangereport.claims(tables):
        claims.append({"claim": str(c["claim"]), "status": str(c["status"]), "figure": str(c.get("detail", "")),
                       "source": str(c.get("source", "ffnquant.rangereport"))})
    # The range issue's full Markdown (per-site tables, weights), nested under the report's own section.
    section["markdown"] = rangereport.range_report_markdown(tables, heading_level=3)
    return section, claims


def _weight_bytes(spec: FFNSpec, scheme: Any) -> int:
    """Stored bytes of the weight matrices in the scheme's format, with their scales (and zero points),
    plus fp32 biases: the nominal size a deployment carries (artifact files add graph overhead)."""
    wd = scheme.weight_dtype
    n_w = spec.n_weight_params
    bias = 4 * spec.n_bias_params
    if wd.is_float:
        return n_w * wd.bits // 8 + bias
    out_channels = sum(shape[0] for shape in spec.weight_shapes.values())
    gran = scheme.weight_granularity.value
    if gran == "per_group":
        n_scales = n_w // scheme.group_size
        scale_bytes = 2 * n_scales if wd.value in ("int4",) else 4 * n_scales  # fp16 scales (MatMulNBits); bnb absmax fp32
        zp_bytes = 0 if scheme.weight_symmetric else math.ceil(n_scales / 2)
    elif gran == "per_channel":
        scale_bytes, zp_bytes = 4 * out_channels, 0 if scheme.weight_symmetric else out_channels
    else:
        scale_bytes, zp_bytes = 4 * spec.n_matrices, 0
    return math.ceil(n_w * wd.bits / 8) + scale_bytes + zp_bytes + bias


def _sensitivity(prep: Any, res: Any) -> dict[str, float | None]:
    """SQNR with only one weight or one activation site quantized as in `res`, everything else in float."""
    from .accuracy import run_batched, sqnr_db
    from .quantize import quantize_model

    q = res.qmodel
    ref = prep.ref_eval()
    out: dict[str, float | None] = {}
    for w in q.quantized_weights:
        one = quantize_model(prep.model, q.scheme, weights=[w], sites=[])
        out[w] = _json_num(sqnr_db(ref, run_batched(one, prep.eval)))
    for site in q.quantized_sites:
        one = quantize_model(prep.model, q.scheme, weights=[], sites=[site], site_range_cache=q.ranges)
        out[site] = _json_num(sqnr_db(ref, run_batched(one, prep.eval)))
    return out


def _quantize_variant(
    spec: FFNSpec, model: Any, recipes: Sequence[Recipe], config: RunConfig, calib: Any, eval_tokens: Any,
    out_export: Path | None, tick: Callable[[str], None], label: str | None = None, stem: str | None = None,
    keep: dict[str, Any] | None = None,
) -> tuple[list[dict], list[dict], dict[str, Path], dict | None]:
    """Every recipe of one variant through `quantize.quantize_spec`: accuracy rows (torch reference and the
    ONNX artifact on onnxruntime), artifacts written to `out_export`, their paths by recipe name, and
    onnxruntime's default quantize_static on the same model and data for comparison.

    One `prepare()` per remedy set, shared across the schemes that use it (calibrate once). A real
    model's layer passes its report key as `label` (e.g. 'bert:L0'), its ONNX file stem as `stem`, and
    `keep` to collect the quantized FFN of every quantized recipe (by recipe name) for the end-to-end run.
    """
    from .atomic import is_output_failure
    from .quantize import prepare, quantize_spec
    from .schemes import get_scheme

    v = label or spec.variant.value
    rows: list[dict] = []
    artifacts: list[dict] = []
    paths: dict[str, Path] = {}
    preps: dict[tuple, Any] = {}
    work: dict[str, Any] = {}  # recipe name -> (prepared, QuantResult) for the sensitivity of the worst cases
    ort_baseline: dict | None = None
    for recipe in recipes:
        scheme = get_scheme(recipe.scheme)
        row: dict[str, Any] = {"variant": v, "scheme": recipe.name, "label": recipe.label, "status": "ok",
                               "reason": None, "sqnr_db": None, "cosine": None, "rel_l2": None, "max_abs_error": None,
                               "size_bytes": _weight_bytes(spec, scheme), "onnx_sqnr_db": None, "site_ranges": {},
                               "sensitivity": None}
        try:
            key = (recipe.smooth, recipe.rotate)
            if key not in preps:
                preps[key] = prepare(spec, calib_tokens=calib, eval_tokens=eval_tokens, seed=config.seed,
                                     smooth=recipe.smooth, rotate=recipe.rotate, model=model, name=stem)
                base = preps.get((None, False))
                if base is not None and key != (None, False):
                    # The reference fp32 export and onnxruntime's default baseline do not depend on the
                    # remedies: reuse the files already made instead of exporting them again.
                    preps[key]._files.update({k: p for k, p in base._files.items() if k[0] in ("reference", "baseline")})
            prep = preps[key]
            # quantize_spec names files by scheme; recipes that differ only by calibrator get a suffix, written
            # under that name from the start (renaming afterwards could drop an earlier file of the plain name)
            suffix = f"-{recipe.calibrator.replace(':', '')}" if recipe.calibrator and recipe.scheme != config.baseline else ""
            res = quantize_spec(spec, scheme, calibrator=recipe.calibrator, prepared=prep, seed=config.seed,
                                out_artifacts=out_export, onnx=out_export is not None, sensitivity=False,
                                baseline=out_export is not None, artifact_suffix=suffix)
            acc = res.accuracy
            if recipe.scheme == config.baseline:
                row.update(sqnr_db=None, cosine=1.0, rel_l2=0.0, max_abs_error=0.0)
            else:
                row.update(sqnr_db=_json_num(acc.sqnr_db), cosine=_json_num(acc.cosine), rel_l2=_json_num(acc.rel_l2),
                           max_abs_error=_json_num(acc.max_abs_error))
                work[recipe.name] = (prep, res)
                if keep is not None:
                    keep[recipe.name] = res.qmodel
            row["site_ranges"] = {s: {"lo": r.lo, "hi": r.hi, "calibrator": r.calibrator} for s, r in res.ranges.items()}
            if prep.remedies:
                row["remedies"] = [{"kind": r.kind, "params": r.params, "exact": r.exact, "note": r.note}
                                   for r in prep.remedies]
            art = res.artifact or {}
            if art.get("accuracy_onnx") and recipe.scheme != config.baseline:
                row["onnx_sqnr_db"] = _json_num(art["accuracy_onnx"]["sqnr_db"])
            if art.get("path"):
                p = Path(art["path"])
                paths[recipe.name] = p
                # the staged path for now: `run` puts the final one in once every artifact is written
                artifacts.append({"variant": v, "scheme": recipe.name, "path": p, "size_bytes": int(art["size_bytes"]),
                                  "format": str(art.get("kind"))})
            elif art.get("note") and art.get("kind") is None:
                row["reason"] = f"no ONNX artifact: {art['note']}"
            if res.baseline and ort_baseline is None:
                ort_baseline = {"variant": v, "what": res.baseline["what"],
                                "sqnr_db": _json_num(res.baseline["accuracy_onnx"]["sqnr_db"]),
                                "size_bytes": res.baseline.get("size_bytes")}
        except FFNQuantError as exc:
            # e.g. a remedy that cannot be applied exactly to this variant: refused by design, recorded.
            row.update(status="not applicable", reason=str(exc))
        except Exception as exc:  # one broken combination must not sink the run; the report shows it
            if is_output_failure(exc):
                raise  # a full disk is not one broken combination: the run stops and leaves nothing
            row.update(status="error", reason=f"{type(exc).__name__}: {exc}")
        rows.append(row)
        tick(f"{v} {recipe.name}")
    # Per-site sensitivity of the worst cases: the two least accurate quantized recipes of this variant.
    if config.sensitivity:
        ranked = sorted((r for r in rows if r["status"] == "ok" and r["sqnr_db"] is not None and r["scheme"] in work),
                        key=lambda r: r["sqnr_db"])[:2]
        for r in ranked:
            prep, res = work[r["scheme"]]
            try:
                r["sensitivity"] = _sensitivity(prep, res)
            except Exception as exc:  # recorded, not fatal
                r["reason"] = f"sensitivity failed: {type(exc).__name__}: {exc}"
    return rows, artifacts, paths, ort_baseline


# Quantized copies of every FFN layer under every recipe are kept for the end-to-end model runs;
# past this many bytes the run leaves the end-to-end numbers out (and says so) rather than swap.
MODEL_E2E_MAX_BYTES = 2 << 30


def _check_model(config: RunConfig) -> tuple[Any, list[int]]:
    """The model folder of `config` inspected (config.json, weights, architecture), its layer selection
    parsed, transformers and both texts checked: every model error fails before the run starts."""
    from .hf import inspect_model, parse_layers
    from .hf.capture import check_tokenizer, require_transformers

    info = inspect_model(config.model)
    indices = parse_layers(config.layers, info.n_layers)
    require_transformers()
    # reads both texts and checks the tokenizer's ids against config.json's vocab_size: a tokenizer
    # that does not belong to the weights fails here, not after the synthetic variants have run
    check_tokenizer(info, {"calibration": config.text, "evaluation": config.eval_text})
    return info, indices


def _model_layers_part(
    config: RunConfig, info: Any, recipes: Sequence[Recipe], out_export: Path | None, runtimes: Sequence[tuple],
    tick: Callable[..., None], progress: Progress | None, stages: _Stages,
) -> dict[str, Any]:
    """The real model's selected FFN layers, treated as variants keyed '<model_type>:<label>': range tables
    from inputs captured on the calibration text, every recipe quantized per layer on held-out inputs
    from the evaluation text (artifacts `<model>.<label>...onnx`), every quantized recipe put back into
    the model (end to end), and the latency of the first selected layer on the runtimes."""
    from .hf import EvalSettings, calibrate_layers, capture_layer_inputs, end_to_end, float_baseline, load_ffn_layers
    from .hf import model_file_stem

    t0 = time.perf_counter()
    layers = load_ffn_layers(info, config.layers)
    settings = EvalSettings(max_calib_tokens=config.calib_tokens, max_eval_tokens=config.eval_tokens, bins=config.bins)
    inputs = capture_layer_inputs(info, layers, text=config.text, eval_text=config.eval_text,
                                  calib_tokens=config.calib_tokens, eval_tokens=config.eval_tokens, settings=settings)
    keys = {layer.label: f"{info.model_type}:{layer.label}" for layer in layers}
    bs = config.batch_size
    chunks = ({layer.label: x[i : i + bs]} for layer in layers for x in [inputs.calib[layer.label]]
              for i in range(0, x.shape[0], bs))
    by_label, _ = calibrate_layers(layers, chunks, config.bins)
    tables = {keys[label]: table for label, table in by_label.items()}
    stages.add("model capture and profile", time.perf_counter() - t0)
    tick(f"{info.model_type}: inputs captured and profiled")

    t0 = time.perf_counter()
    stem = model_file_stem(info)
    quantized = [r for r in recipes if r.name != config.baseline]
    e2e_bytes = 4 * sum(layer.spec.n_params for layer in layers) * len(quantized)
    e2e_reason = None
    if e2e_bytes > MODEL_E2E_MAX_BYTES:
        e2e_reason = (f"would keep {e2e_bytes / 2**30:.1f} GiB of quantized FFN copies (limit "
                      f"{MODEL_E2E_MAX_BYTES / 2**30:.0f} GiB): select fewer layers or schemes")
    kept: dict[str, dict[str, Any]] = {}
    rows: list[dict] = []
    artifacts: list[dict] = []
    baselines: list[dict] = []
    rep_paths: dict[str, Path] = {}
    for n, layer in enumerate(layers):
        keep = {} if e2e_reason is None else None
        lrows, larts, paths, ort_base = _quantize_variant(
            layer.spec, layer.ffn, recipes, config, inputs.calib[layer.label], inputs.eval[layer.label], out_export,
            tick, label=keys[layer.label], stem=f"{stem}.{layer.label}", keep=keep)
        for r in lrows:
            r["layer"] = layer.label
        rows += lrows
        artifacts += larts
        if ort_base is not None:
            baselines.append(ort_base)
        if keep is not None:
            kept[layer.label] = keep
        if n == 0:
            rep_paths = paths
    stages.add("model quantize and export", time.perf_counter() - t0)

    skipped: dict[str, dict[str, Any]] = {}
    for r in rows:
        if r["status"] != "ok":
            entry = skipped.setdefault(r["scheme"], {"scheme": r["scheme"], "reason": r["reason"] or r["status"], "layers": []})
            entry["layers"].append(r["layer"])

    # --- end to end: every layer quantized with the same recipe, back in the model ----------------
    t0 = time.perf_counter()
    e2e: dict[str, Any] = {"status": "ok", "reason": None, "evaluation_text": inputs.evaluation_source,
                           "baseline": None, "schemes": []}
    if e2e_reason is not None:
        e2e.update(status="missing", reason=e2e_reason)
    else:
        e2e["baseline"] = float_baseline(inputs.model, info, inputs.eval_batches)
        for recipe in quantized:
            qffns = {label: k.get(recipe.name) for label, k in kept.items()}
            if any(q is None for q in qffns.values()):
                continue  # not applicable to this model (listed under skipped)
            res = end_to_end(inputs.model, info, layers, qffns, inputs.eval_batches, settings, e2e["baseline"])
            e2e["schemes"].append({"scheme": recipe.name, "label": recipe.label, "end_to_end": res["end_to_end"],
                                   "ablation": res["ablation"], "worst_layers_end_to_end": res["worst_layers_end_to_end"]})
        tick(f"{info.model_type}: end to end")
    kept.clear()
    stages.add("model end to end", time.perf_counter() - t0)

    # --- latency of one representative layer (all layers share the spec: same shapes, same kernels) ---
    rep = layers[0]
    latency: dict[str, Any] = {"layer": None, "reason": None, "cases": [], "runtimes": []}
    if config.runtimes == ("none",) or not runtimes:
        latency["reason"] = "no runtimes requested (runtimes = none)" if config.runtimes == ("none",) \
            else "no runtime is available"
    else:
        t0 = time.perf_counter()
        ok = {r["scheme"] for r in rows if r["layer"] == rep.label and r["status"] == "ok"}
        v = rep.spec.variant.value
        section = _measure_latency(config, [rep.spec], [r for r in recipes if r.name in ok], {v: rep.ffn},
                                   {(v, name): p for name, p in rep_paths.items()}, runtimes, [], progress)
        for c in section["cases"]:
            c["variant"] = keys[rep.label]
        latency.update(layer=keys[rep.label], cases=section["cases"], runtimes=section["runtimes"],
                       reason=f"{keys[rep.label]} stands for every layer: the {len(layers)} selected layers share one "
                              f"spec ({rep.spec.key}), so the same shapes run the same kernels"
                              + (f"; {section['reason']}" if section.get("reason") else ""))
        stages.add("model latency", time.perf_counter() - t0)

    doc = {
        "status": "ok" if not skipped and e2e["status"] == "ok" else "partial",
        "reason": None,
        "path": display_path(info.path),
        "model_type": info.model_type,
        "kind": info.kind.value,
        "variant": info.spec.variant.value,
        "activation": info.spec.activation.value,
        "hf_activation": info.hf_activation,
        "spec": info.spec.to_dict(),
        "spec_key": info.spec.key,
        "n_layers": info.n_layers,
        "n_experts": info.n_experts,
        "n_ffns": len(info.layers),
        "file_stem": stem,
        "layers": [{"key": keys[l.label], "label": l.label, "index": l.index, "expert": l.expert, "name": l.name,
                    "calib_tokens": int(inputs.calib[l.label].shape[0]), "eval_tokens": int(inputs.eval[l.label].shape[0]),
                    "inputs_borrowed": inputs.borrowed.get(l.label)} for l in layers],
        "calibration": {"source": inputs.calibration_source},
        "evaluation": {"source": inputs.evaluation_source, "separation": inputs.separation},
        "skipped": list(skipped.values()),
        "end_to_end": e2e,
        "latency": {"layer": latency["layer"], "reason": latency["reason"]},
    }
    if skipped:
        doc["reason"] = "; ".join(f"{s['scheme']} skipped: {s['reason']}" for s in skipped.values())
    elif e2e["status"] != "ok":
        doc["reason"] = f"end to end not measured: {e2e['reason']}"
    return {"doc": doc, "tables": tables, "rows": rows, "artifacts": artifacts, "baselines": baselines,
            "latency": latency}


def _model_finding(model: Mapping[str, Any], rows: Sequence[dict], recipes: Sequence[Recipe], variants: Sequence[str],
                   ranges: Mapping[str, Any]) -> dict | None:
    """The model's layers against the random-weight variant of its family under the first static int8 recipe
    (or the first quantized one), with the end-to-end figure: the side-by-side in one sentence."""
    keys = [l["key"] for l in model["layers"]]
    order = [r for r in recipes if r.scheme in ("w8a8", "w8a8-s8") and r.smooth is None and not r.rotate] + list(recipes)
    for recipe in order:
        sq = {r["variant"]: r["sqnr_db"] for r in rows if r["scheme"] == recipe.name and r["status"] == "ok"
              and r["sqnr_db"] is not None}
        layer_sq = {k: sq[k] for k in keys if k in sq}
        if not layer_sq:
            continue
        lo = min(layer_sq, key=layer_sq.get)
        text = (f"{model['model_type']} ({model['variant']}, d_model {model['spec']['d_model']}) under {recipe.label}: "
                f"per-layer SQNR {min(layer_sq.values()):.1f} to {max(layer_sq.values()):.1f} dB on held-out text "
                f"inputs (lowest {lo}, hidden crest factor "
                f"{ranges.get(lo, {}).get('sites', {}).get('hidden', {}).get('crest_factor') or float('nan'):.0f})")
        same = model["variant"] if model["variant"] in variants else None
        if same is not None and sq.get(same) is not None:
            crest = ranges.get(same, {}).get("sites", {}).get("hidden", {}).get("crest_factor")
            text += f", against {sq[same]:.1f} dB for the random-weight {same} variant" + (
                f" (crest {crest:.0f})" if crest is not None else "")
        e2e = next((s for s in model["end_to_end"]["schemes"] if s["scheme"] == recipe.name), None)
        if e2e is not None:
            e = e2e["end_to_end"]
            text += f"; every layer quantized, the model's final hidden state keeps {e['hidden_sqnr_db']:.1f} dB SQNR"
            if e.get("perplexity_delta") is not None:
                text += f" and perplexity changes by {e['perplexity_delta']:+.3g}"
        return {"text": text, "scheme": recipe.name, "layers_sqnr_db": layer_sq}
    return None


def run(config: RunConfig, progress: Progress | None = None, command: str | None = None) -> RunResult:
    """Profile, quantize, export, benchmark and report every variant of `config`; returns the document.

    Everything is validated before anything is written (bad schemes, sizes, data or an explicitly
    requested runtime that is unavailable raise FFNQuantError). A runtime that fails midway is
    recorded in the report and the rest of the run completes.
    """
    import torch

    from . import __version__
    from .atomic import OutputTransaction, write_text
    from .data import calibration_and_eval
    from .envinfo import environment
    from .model import build

    t_start = time.perf_counter()
    stages = _Stages()
    missing: list[dict[str, str]] = []
    command = command or "ffnquant.run.run(RunConfig(...))"

    # --- validate everything first --------------------------------------------------------
    specs = config.specs()
    recipes = config.recipes
    try:
        from .schemes import check_scheme_fits, get_scheme
    except ImportError as exc:
        get_scheme = None
        missing.append({"part": "quantization", "reason": f"ffnquant.schemes is not installed ({exc})"})
    if get_scheme is not None:
        for spec in specs:
            for recipe in recipes:
                check_scheme_fits(get_scheme(recipe.scheme), spec)
    try:
        runtimes = _select_runtimes(config)
    except ImportError as exc:
        runtimes = []
        missing.append({"part": "latency", "reason": f"ffnquant.runtimes is not installed ({exc})"})
    source = config.token_source()
    calib_source, eval_tokens = calibration_and_eval(source, config.calib_tokens, config.eval_tokens, config.d_model)
    calib_source.available(config.d_model)  # reads and validates a token file now, before writing anything
    model_info = None
    if config.model is not None:
        if get_scheme is None:
            raise FFNQuantError("model: quantizing a model's layers needs ffnquant's quantization modules")
        model_info = _check_model(config)  # a bad folder or text fails here, before anything is written
    # The whole output set is staged beside its folders and moved into place only once every file is
    # written: a failure, a full disk or Ctrl-C leaves the reports and artifacts folders as they were,
    # and an earlier file is replaced only by this run's file of the same name.
    with OutputTransaction() as tx:
        out_reports = tx.folder(config.out_reports)
        out_export = tx.folder(config.out_export)

        n_units = len(specs) * (1 + len(recipes))
        if model_info is not None:
            n_units += len(model_info[1]) * (1 if model_info[0].n_experts is None else model_info[0].n_experts) * len(recipes) + 2
        done = 0

        def tick(message: str, units: int = 1) -> None:
            nonlocal done
            done += units
            if progress is not None:
                progress(message, done, n_units)

        torch.manual_seed(config.seed)  # nothing below should draw from the global generator; belt and braces
        tables: dict[str, Any] = {}
        acc_rows: list[dict] = []
        artifacts: list[dict] = []
        models: dict[str, Any] = {}
        onnx_paths: dict[tuple[str, str], Path] = {}
        timed_claims: list[dict] = []
        ort_baselines: list[dict] = []
        calib_tokens = calib_source.tokens(config.calib_tokens, config.d_model)
        from .observe import profile

        for spec in specs:
            v = spec.variant.value
            t0 = time.perf_counter()
            model = build(spec, seed=config.seed)
            models[v] = model
            tables[v] = profile(model, calib_source.batches(config.calib_tokens, spec.d_model, config.batch_size), bins=config.bins)
            stages.add("profile", time.perf_counter() - t0)
            tick(f"{v}: profiled")
            if get_scheme is not None:
                t0 = time.perf_counter()
                rows, arts, paths, ort_base = _quantize_variant(
                    spec, model, recipes, config, calib_tokens, eval_tokens, out_export if config.onnx else None,
                    lambda m: tick(m))
                acc_rows += rows
                artifacts += arts
                if ort_base is not None:
                    ort_baselines.append(ort_base)
                for name, p in paths.items():
                    onnx_paths[(v, name)] = p
                stages.add("quantize and export", time.perf_counter() - t0)
            else:
                tick(f"{v}: quantization skipped", len(recipes))
            if v in ("relu", "swiglu"):
                timed_claims.append(_claim_activation_time(model, eval_tokens[: max(config.tokens)]))

        model_part = None
        if model_info is not None:
            model_part = _model_layers_part(config, model_info[0], recipes, out_export if config.onnx else None, runtimes,
                                            tick, progress, stages)
            tables.update(model_part["tables"])
            acc_rows += model_part["rows"]
            artifacts += model_part["artifacts"]
            ort_baselines += model_part["baselines"]

        ranges, range_claims = _range_section(tables, specs, missing)
        claims = range_claims

        # --- latency ------------------------------------------------------------------------------
        t0 = time.perf_counter()
        latency = _measure_latency(config, specs, recipes, models, onnx_paths, runtimes, missing, progress)
        stages.add("latency", time.perf_counter() - t0)
        if model_part is not None and model_part["latency"]["cases"]:
            latency["cases"] += model_part["latency"]["cases"]
            errors = {r["name"]: r["error"] for r in model_part["latency"]["runtimes"] if r.get("error")}
            for r in latency["runtimes"]:
                if errors.get(r["name"]) and not r.get("error"):
                    r["error"] = f"{model_part['latency']['layer']}: {errors[r['name']]}"

        # --- recommendations and findings ------------------------------------------------------------
        from .recommend import Point, crest_cost_finding, pareto_front, recommend_all

        acc_index = {(r["variant"], r["scheme"]): r for r in acc_rows}
        points = []
        for c in latency["cases"]:
            if c.get("error") is not None or not c.get("median_s"):
                continue
            row = acc_index.get((c["variant"], c["scheme"]))
            if c["scheme"] == config.baseline:
                sqnr = None
            elif row is not None and row["status"] == "ok" and row["sqnr_db"] is not None:
                sqnr = row["sqnr_db"]
            else:
                continue
            points.append(Point(c["variant"], c["scheme"], c["runtime"], c["tokens"], c["median_s"], sqnr,
                                row["label"] if row else c["scheme"]))
        recs = [r.to_dict() for r in recommend_all(points, config.target_db, config.baseline)]
        pareto = []
        groups: dict[tuple, list] = {}
        for p in points:
            groups.setdefault((p.variant, p.runtime, p.tokens), []).append(p)
        for (v, rt, t), pts in sorted(groups.items()):
            pareto.append({"variant": v, "runtime": rt, "tokens": t, "schemes": [p.scheme for p in pareto_front(pts)]})

        findings = []
        # the crest/cost relation is a claim about the synthetic family; a real model's layers get their own finding
        crest = {v: ranges["variants"][v]["sites"].get("hidden", {}).get("crest_factor") for v in ranges["variants"]
                 if v in config.variants}
        crest = {v: c for v, c in crest.items() if c is not None}
        for recipe in recipes:
            if recipe.scheme not in ("w8a8", "w8a8-s8") or recipe.smooth is not None or recipe.rotate:
                continue
            sq = {r["variant"]: r["sqnr_db"] for r in acc_rows if r["scheme"] == recipe.name and r["sqnr_db"] is not None
                  and r["variant"] in config.variants}
            f = crest_cost_finding(crest, sq, scheme=recipe.label)
            if f is not None:
                findings.append(f)
            break
        findings += _remedy_findings(acc_rows, recipes)
        if model_part is not None:
            f = _model_finding(model_part["doc"], acc_rows, recipes, config.variants, ranges["variants"])
            if f is not None:
                findings.append(f)

        for a in artifacts:  # the paths the files will have once moved into place
            a["path"] = display_path(tx.final(a["path"]))
        doc: dict[str, Any] = {
            "schema": "ffnquant-report",
            "schema_version": 1,
            "ffnquant_version": __version__,
            "command": command,
            "config": config.to_dict(),
            "environment": environment(),
            "specs": [dict(s.to_dict(), key=s.key, n_params=s.n_params, flops_per_token=s.flops_per_token) for s in specs],
            "data": {
                "source": source.label,
                "calib_tokens": config.calib_tokens,
                "eval_tokens": config.eval_tokens,
                "separation": "held-out tokens never used for calibration: "
                              + ("rows after the calibration rows of the file" if source.kind.value == "file"
                                 else "an independent random stream of the same source"),
            },
            **({"model": model_part["doc"]} if model_part is not None else {}),
            "ranges": ranges,
            "claims": claims,
            "accuracy": {"status": "ok" if acc_rows else "missing",
                         "reason": None if acc_rows else "quantization modules are not installed", "rows": acc_rows,
                         "baseline": _ort_baseline_summary(ort_baselines, acc_rows, recipes)},
            "artifacts": artifacts,
            "findings": findings,
            "missing": missing,
            "timing": {
                "wall_s": 0.0,
                "stages": {},
                "latency": latency,
                "recommendations": recs,
                "pareto": pareto,
                "claims": timed_claims,
            },
        }
        from .report import write_report

        doc["timing"]["stages"] = {k: round(v, 3) for k, v in stages.seconds.items()}
        doc["timing"]["wall_s"] = round(time.perf_counter() - t_start, 3)
        paths = write_report(doc, out_reports)
        paths["config"] = write_text(out_reports / "run.toml", config.to_toml())
        paths = {k: tx.final(p) for k, p in paths.items()}
    return RunResult(config, doc, paths)


def _remedy_findings(rows: Sequence[dict], recipes: Sequence[Recipe]) -> list[dict]:
    """What smoothing bought per variant, from the accuracy rows (only where it applied)."""
    out = []
    for recipe in recipes:
        if recipe.smooth is None:
            continue
        plain = Recipe(recipe.scheme, recipe.calibrator).name
        gains = []
        refused = []
        # one note per distinct text, naming every variant (or model layer) it applies to
        by_note: dict[str, list[str]] = {}
        for r in rows:
            if r["scheme"] == recipe.name:
                for rem in r.get("remedies", []):
                    if rem.get("note") and r["variant"] not in by_note.setdefault(rem["note"], []):
                        by_note[rem["note"]].append(r["variant"])
        notes = sorted(f"{', '.join(vs)}: {note}" for note, vs in by_note.items())
        for r in rows:
            if r["scheme"] != recipe.name:
                continue
            if r["status"] == "not applicable":
                refused.append(r["variant"])
                continue
            base = next((b for b in rows if b["variant"] == r["variant"] and b["scheme"] == plain), None)
            if base and base["sqnr_db"] is not None and r["sqnr_db"] is not None:
                gains.append((r["variant"], r["sqnr_db"] - base["sqnr_db"]))
        if gains:
            text = f"{recipe.label} vs {plain}: " + ", ".join(f"{v} {g:+.1f} dB" for v, g in gains)
            if refused:
                text += f"; not applied to {', '.join(refused)} (the fold is not exact for their nonlinearity)"
            if notes:
                text += "; " + "; ".join(notes)
            out.append({"text": text, "gains_db": dict(gains), "refused": refused})
    return out


def _measure_latency(
    config: RunConfig, specs: Sequence[FFNSpec], recipes: Sequence[Recipe], models: Mapping[str, Any],
    onnx_paths: Mapping[tuple[str, str], Path], runtimes: Sequence[tuple[str, Any, Any]], missing: list[dict],
    progress: Progress | None,
) -> dict[str, Any]:
    """Latency of every (variant, recipe, runtime, tokens) the runtimes support, via `ffnquant.bench`."""
    section: dict[str, Any] = {
        "status": "ok", "reason": None, "primary_tokens": max(config.tokens),
        "runtimes": [{"name": n, "available": bool(a.available), "reason": a.reason, "device": a.device, "error": None}
                     for n, a, _ in runtimes],
        "cases": [],
    }
    if config.runtimes == ("none",):
        section.update(status="missing", reason="no runtimes requested (runtimes = none): accuracy only")
        missing.append({"part": "latency and recommendations", "reason": section["reason"]})
        return section
    try:
        from . import bench
    except ImportError as exc:
        section.update(status="missing", reason=f"the latency harness ffnquant.bench is not installed ({exc})")
        missing.append({"part": "latency and recommendations", "reason": section["reason"]})
        return section
    return _run_bench(bench, config, specs, recipes, models, onnx_paths, runtimes, section, missing, progress)


def _run_bench(
    bench: Any, config: RunConfig, specs: Sequence[FFNSpec], recipes: Sequence[Recipe], models: Mapping[str, Any],
    onnx_paths: Mapping[tuple[str, str], Path], runtimes: Sequence[tuple[str, Any, Any]], section: dict[str, Any],
    missing: list[dict], progress: Progress | None,
) -> dict[str, Any]:
    """Drive `bench.run_benchmark`: one sweep over the formats of the first recipe of each scheme, then
    one sweep per further recipe of a scheme (e.g. with smoothing) on the runtimes that load our ONNX
    artifacts (the others would time the same thing again). Cases are relabelled with recipe names."""
    by_key = {s.key: s for s in specs}
    variant_key = {s.variant.value: s.key for s in specs}
    first: dict[str, Recipe] = {}
    extra: list[Recipe] = []
    for r in recipes:
        if r.scheme in first:
            extra.append(r)
        else:
            first[r.scheme] = r
    from .runtimes.base import FORMATS

    unknown = [s for s in first if s not in FORMATS]
    if unknown:
        missing.append({"part": f"latency of {', '.join(unknown)}", "reason": "no runtime format of that name"})
    # One warm-up and a floor of two timed calls: fast cases still repeat until the budget is spent, and the
    # slow ones (torch's CPU int4/int8 weight-only kernels take seconds per 512-token call) stay bounded.
    # The accuracy stage scores every recipe against its reference already: no second reference here.
    bconf = bench.BenchConfig(tokens=config.tokens, budget_s=config.budget_s, warmup=1, min_repeats=2, seed=config.seed,
                              reference_check=False)
    model_map = {variant_key[v]: m for v, m in models.items() if v in variant_key}
    runtime_objs = [rt for _, _, rt in runtimes]
    done_before = 0

    def sweep(recipe_of_format: Mapping[str, Recipe], rts: Sequence[Any]) -> Any:
        nonlocal done_before
        paths = {}
        for spec in specs:
            v = spec.variant.value
            for fmt, recipe in recipe_of_format.items():
                p = onnx_paths.get((v, recipe.name)) or onnx_paths.get((v, fmt))
                if p is not None and (fmt in ("fp32", "fp16") or (v, recipe.name) in onnx_paths):
                    paths[(spec.key, fmt)] = p
        offset = done_before

        def cb(done: int, total: int, label: str) -> None:
            if progress is not None:
                progress(f"latency {label}", offset + done, offset + total)

        res = bench.run_benchmark(specs, rts, [f for f in recipe_of_format if f in FORMATS], bconf, models=model_map,
                                  onnx_paths=paths, progress=cb)
        done_before = offset + len(res.cases)
        return res

    main = sweep(first, runtime_objs)
    cases = []
    for c in main.cases:
        d = c.to_dict()
        d["scheme"] = first[c.scheme].name if c.scheme in first else c.scheme
        cases.append(d)
    rows = {r["name"]: dict(r) for r in main.runtimes}
    onnx_rts = [rt for rt in runtime_objs if rt.name.startswith("ort-")]
    for recipe in extra:
        if not onnx_rts:
            break
        res = sweep({recipe.scheme: recipe}, onnx_rts)
        for c in res.cases:
            if c.scheme != recipe.scheme:
                continue  # the baseline the harness re-measured for this sweep's speedups
            d = c.to_dict()
            d["scheme"] = recipe.name
            cases.append(d)
        for r in res.runtimes:
            if r.get("error") and not rows.get(r["name"], {}).get("error"):
                rows[r["name"]]["error"] = r["error"]
    for c in cases:
        for k, v in list(c.items()):
            if isinstance(v, float) and not math.isfinite(v):
                c[k] = None
    section["runtimes"] = [
        {"name": r["name"], "available": bool(r["available"]), "reason": str(r["reason"]), "device": r.get("device"),
         "error": r.get("error"), "ran_with": list(r.get("ran_with", []))}
        for r in rows.values()
    ]
    section["cases"] = cases
    section["skipped"] = list(main.skipped)
    failed = [r["name"] for r in section["runtimes"] if r["error"]]
    if not any(c["error"] is None for c in cases):
        section.update(status="missing", reason="no latency case could be measured")
        missing.append({"part": "latency", "reason": section["reason"]})
    elif failed:
        section.update(status="partial", reason=f"runtime(s) failed during the run: {', '.join(failed)}")
    del by_key
    return section


def _ort_baseline_summary(baselines: Sequence[dict], rows: Sequence[dict], recipes: Sequence[Recipe]) -> dict | None:
    """onnxruntime's default quantize_static against ffnquant's best static int8 recipe, per variant."""
    if not baselines:
        return None
    static = [r.name for r in recipes if r.scheme in ("w8a8", "w8a8-s8")]

    def db(r: dict) -> float | None:
        return r["onnx_sqnr_db"] if r.get("onnx_sqnr_db") is not None else r["sqnr_db"]

    per_variant = []
    for b in baselines:
        ours = [r for r in rows if r["variant"] == b["variant"] and r["scheme"] in static and r["status"] == "ok"
                and db(r) is not None]
        best = max(ours, key=db, default=None)
        per_variant.append({"variant": b["variant"], "ort_default_sqnr_db": b["sqnr_db"],
                            "ours": best["label"] if best else None, "ours_sqnr_db": db(best) if best else None})
    parts = [f"{p['variant']} {p['ort_default_sqnr_db']:.1f} dB vs ffnquant's {p['ours']} {p['ours_sqnr_db']:.1f} dB"
             for p in per_variant if p["ours_sqnr_db"] is not None and p["ort_default_sqnr_db"] is not None]
    text = "; ".join(parts) + " (both on onnxruntime's CPU provider, same data)" if parts else ""
    return {"what": baselines[0]["what"], "variants": per_variant, "text": text}
