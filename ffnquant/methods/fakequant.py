"""Reference numerics in torch: an FFN with fake-quantized weights and matmul-input activations.

`quantize_model(model, scheme, ranges)` copies the model, replaces each weight by its
quantize-dequantize image under the scheme, and puts forward hooks on the `input` and
`hidden` taps (what the matmuls read) that fake-quantize the activations: with a static
range per site chosen by a calibrator from the RangeTable's histograms, or per token at run
time. The result records the range and qparams every site got. nf4/fp4 go through
bitsandbytes itself; HQQ through onnxruntime's copy of the HQQ routine; GPTQ and AWQ need the
input Hessians (`input_hessians`; AWQ folds its searched channel scales into the copy first,
`ffnquant.methods.awq`). The end-to-end measurement (calibrate, quantize under a Recipe, ONNX
artifact, accuracy) builds on this in `ffnquant.quantization`.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from ..numerics import primitives as P
from ..numerics.accuracy import run_batched, sqnr_db
from ..numerics.calibrate import CANDIDATES, Grid, calibrate_range, histogram_of, parse_calibrator
from ..model import FFN
from ..schemes import ActDType, ActMode, Scheme, check_scheme_fits, get_scheme
from .qlinear import QuantizedLinear, WeightGrid
from .registry import handler_for, quantize_linear

if TYPE_CHECKING:  # annotations only: ffnquant.quantization builds on this module, not the other way
    from ..quantization import Prepared
    from ..recipe import Recipe

__all__ = [
    "ACT_SITES",
    "WEIGHT_INPUT_SITE",
    "SiteRange",
    "QuantizedFFN",
    "quantized_ffn_to",
    "QuantizedLinear",
    "WeightGrid",
    "quantize_weight",
    "weight_grid",
    "site_ranges",
    "input_hessians",
    "quantize_model",
    "search_calibrators",
]

# The activations that feed a matmul, and which weight reads which.
ACT_SITES = ("input", "hidden")
WEIGHT_INPUT_SITE = {"w_up": "input", "w_gate": "input", "w_down": "hidden"}


@dataclass(frozen=True)
class SiteRange:
    """The static range one activation site got: calibrated [lo, hi], the qparams derived from it, and who chose it."""

    site: str
    lo: float
    hi: float
    scale: float
    zero_point: int
    qmin: int
    qmax: int
    dtype: str
    calibrator: str
    expected_mse: float
    observed_min: float
    observed_max: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def _act_grid(scheme: Scheme) -> Grid:
    return Grid.for_act(scheme.act_dtype, bool(scheme.act_symmetric))


def site_ranges(
    ranges: Any, scheme: Scheme, calibrator: str | Mapping[str, str] | None = None, sites: Sequence[str] = ACT_SITES
) -> dict[str, SiteRange]:
    """Calibrated static ranges of `sites` from a RangeTable (anything indexable by site giving observers/histograms).

    `calibrator`: one name for every site, or {site: name}; None takes the scheme's.
    """
    if ranges is None:
        raise FFNQuantError(f"scheme {scheme.name!r} has static activations: calibration ranges are required")
    grid = _act_grid(scheme)
    out: dict[str, SiteRange] = {}
    for site in sites:
        name = calibrator.get(site) if isinstance(calibrator, Mapping) else calibrator
        cal = parse_calibrator(name or scheme.calibrator)
        try:
            obs = ranges[site]
        except (KeyError, FFNQuantError):
            raise FFNQuantError(f"the range table has no site {site!r}; profile the model's {', '.join(sites)}") from None
        h = histogram_of(obs)
        lo, hi, used, err = calibrate_range(h, grid, cal)
        if grid.kind == "int":
            scale, zp = P.choose_qparams(lo, hi, grid.qmin, grid.qmax, grid.symmetric)
            scale_f, zp_i, qmin, qmax = float(scale), int(zp), grid.qmin, grid.qmax
        else:
            amax = max(abs(lo), abs(hi))
            scale_f, zp_i, qmin, qmax = (amax / P.FP8_E4M3_MAX if amax > 0 else 1.0), 0, 0, 0
        out[site] = SiteRange(site, lo, hi, scale_f, zp_i, qmin, qmax, scheme.act_dtype.value, used, err, h.lo, h.hi)
    return out


def weight_grid(w: torch.Tensor, scheme: Scheme, hessian: torch.Tensor | None = None) -> tuple[torch.Tensor, WeightGrid | None]:
    """The quantize-dequantize image of one [out, in] weight under `scheme` (float32) and the grid it lies on:
    `quantize_linear`'s weight and grid (the scheme's method handler, `ffnquant.methods`).

    The grid is None for float weights and for formats whose values are not (code - zero) * scale with integer
    zero points: bitsandbytes' nf4/fp4 code books and HQQ's fitted float zero points.
    An AWQ scheme's weight is taken as already scaled (`quantize_model` folds the scales first): it gets RTN.
    """
    ql = quantize_linear(w, get_scheme(scheme), hessian)
    return ql.weight, ql.grid


def quantize_weight(w: torch.Tensor, scheme: Scheme, hessian: torch.Tensor | None = None) -> torch.Tensor:
    """The quantize-dequantize image of one [out, in] weight under `scheme` (float32); see `weight_grid`."""
    return weight_grid(w, scheme, hessian)[0]


def _act_fn(scheme: Scheme, rng: SiteRange | None):
    """The activation fake-quantizer of one site under `scheme`."""
    ad = scheme.act_dtype
    if ad is ActDType.FP16:
        return lambda x: x.half().to(x.dtype)
    if scheme.act_mode is ActMode.DYNAMIC:
        if ad is ActDType.FP8_E4M3:
            return P.fp8_per_token_fake
        signed = ad is ActDType.INT8
        return lambda x: P.fake_quantize_per_token(x, 8, signed, bool(scheme.act_symmetric))
    assert rng is not None
    if ad is ActDType.FP8_E4M3:
        return lambda x: P.fp8_e4m3_fake(x, rng.scale)
    # on x's device, made once per device: a CPU scale would make torch's CUDA division a product with its
    # reciprocal, off by an ulp from the CPU's IEEE division at some inputs
    qparams: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def fake(x: torch.Tensor) -> torch.Tensor:
        if x.device not in qparams:
            qparams[x.device] = (torch.tensor(rng.scale, dtype=torch.float32, device=x.device),
                                 torch.tensor(rng.zero_point, dtype=torch.int32, device=x.device))
        return P.fake_quantize(x, *qparams[x.device], rng.qmin, rng.qmax)

    return fake


class QuantizedFFN(nn.Module):
    """A fake-quantized copy of an FFN: quantized weights in `model`, activation hooks on its taps.

    `ranges` holds the static range each activation site got (empty for dynamic or weight-only
    schemes); `quantized_weights` / `quantized_sites` say what is quantized (a subset for
    per-site sensitivity); `remedies` the records of remedies applied to the model before; `linears` the
    `QuantizedLinear` of each quantized weight (its codes, grid and input quantizer: what every writer reads), by
    weight name, and `weight_grids` the integer or fp8 grid of each that has one (what a deployment format stores).
    `recipe` is the Recipe it was quantized under and `prepared` the `Prepared` calibration it came
    from (its float reference, tokens and GPTQ Hessians), when known: `quantize_spec` sets the recipe,
    the Python API (`ffnquant.quantize`) both, so that `export_onnx` and `evaluate` need nothing else.
    """

    recipe: Recipe | None = None
    prepared: "Prepared | None" = None

    def __init__(
        self,
        model: FFN,
        scheme: Scheme,
        ranges: Mapping[str, SiteRange],
        quantized_weights: Sequence[str],
        quantized_sites: Sequence[str],
        remedies: Sequence[Any] = (),
        weight_grids: Mapping[str, WeightGrid] | None = None,
        linears: Mapping[str, QuantizedLinear] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.linears = dict(linears or {})
        grids = {n: ql.grid for n, ql in self.linears.items() if ql.grid is not None}
        self.weight_grids = dict(weight_grids) if weight_grids is not None else grids
        self.scheme = scheme
        self.ranges = dict(ranges)
        self.quantized_weights = tuple(quantized_weights)
        self.quantized_sites = tuple(quantized_sites)
        self.remedies = list(remedies)
        self._handles = []
        for site in self.quantized_sites:
            fn = _act_fn(scheme, self.ranges.get(site))
            self._handles.append(model.taps[site].register_forward_hook(lambda mod, inp, out, fn=fn: fn(out)))

    @property
    def spec(self):
        return self.model.spec

    @staticmethod
    def input_site(weight: str) -> str:
        """The activation site a weight's matmul reads ('input' or 'hidden')."""
        return WEIGHT_INPUT_SITE[weight]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def remove_hooks(self) -> None:
        """Detach the activation fake-quantizers (the weights stay quantized)."""
        for h in self._handles:
            h.remove()
        self._handles = []

    def describe(self) -> dict[str, Any]:
        return {
            "scheme": self.scheme.to_dict(),
            "quantized_weights": list(self.quantized_weights),
            "quantized_sites": list(self.quantized_sites),
            "ranges": {s: r.to_dict() for s, r in self.ranges.items()},
            "remedies": [r.to_dict() for r in self.remedies],
        }


def quantized_ffn_to(q: QuantizedFFN, device: torch.device | str) -> QuantizedFFN:
    """`q` with everything it holds on `device`, in place: its module (`nn.Module.to`) and each `QuantizedLinear`'s
    tensors and grid (what the deployment writers read); returns `q`. `nn.Module.to` alone moves the module only
    (what a forward pass needs), so a quantized copy made on a GPU comes back to host memory through this."""
    def move(value):
        return value.to(device) if isinstance(value, torch.Tensor) else value

    def grid_to(grid):
        return None if grid is None else replace(grid, scale=move(grid.scale), zero_point=move(grid.zero_point))

    q.to(device)
    q.linears = {name: replace(ql, weight=move(ql.weight), codes=move(ql.codes), zero_float=move(ql.zero_float),
                               scale_float=move(ql.scale_float), grid=grid_to(ql.grid))
                 for name, ql in q.linears.items()}
    q.weight_grids = {name: grid_to(grid) for name, grid in q.weight_grids.items()}
    return q


def input_hessians(model: FFN, batches: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPTQ's H = sum X^T X of each matmul's input ([d, d] for input, [f, f] for hidden), float64, by weight name.

    Accumulated batch by batch through hooks on the taps: memory is the two matrices, not the activations.
    """
    acc: dict[str, torch.Tensor] = {}

    def hook(site):
        def fn(mod, inp, out):
            x = out.detach().reshape(-1, out.shape[-1]).double()
            acc[site] = acc.get(site, 0) + x.T @ x

        return fn

    handles = [model.taps[s].register_forward_hook(hook(s)) for s in ACT_SITES]
    try:
        with torch.no_grad():
            for b in batches:
                model(b)
    finally:
        for h in handles:
            h.remove()
    if not acc:
        raise FFNQuantError("no calibration batches: cannot build the GPTQ Hessians")
    return {w: acc[site] for w, site in WEIGHT_INPUT_SITE.items() if w in model.spec.weight_names}


def quantize_model(
    model: FFN,
    scheme: Scheme | str,
    ranges: Any = None,
    calibrator: str | Mapping[str, str] | None = None,
    remedies: Sequence[Any] = (),
    weights: Sequence[str] | None = None,
    sites: Sequence[str] | None = None,
    hessians: Mapping[str, torch.Tensor] | None = None,
    site_range_cache: Mapping[str, SiteRange] | None = None,
    fold_cache: dict | None = None,
) -> QuantizedFFN:
    """Fake-quantize `model` under `scheme` (weights and matmul-input activations).

    `ranges`: the RangeTable of THIS model (after any remedies), needed for static
    activations; `calibrator` overrides the scheme's. `weights` / `sites` restrict what is
    quantized (default: everything the scheme quantizes), which is how per-site sensitivity
    is measured. `remedies`: records of remedies already applied to `model`, carried along.
    `hessians` (`input_hessians` of `model`, by weight name): needed by GPTQ and AWQ schemes
    (`Scheme.needs_hessians`). Each weight is quantized by the scheme's method handler
    (`ffnquant.methods`), after the handler's fold of the whole FFN: under AWQ the returned model is `model`
    with the searched scales folded in (`awq.awq_fold`, its record appended to `remedies`) and its weights
    clipped (`awq.clip_weights`) and RTN-quantized. `fold_cache`: a dict the caller keeps for this `model` and
    `hessians`, where the handler's fold keeps its search for the next scheme sharing it.
    """
    scheme = get_scheme(scheme)
    check_scheme_fits(scheme, model.spec)
    all_weights = list(model.spec.weight_names) if scheme.quantizes_weights else []
    all_sites = list(ACT_SITES) if scheme.quantizes_activations else []
    weights = all_weights if weights is None else [w for w in weights if w in all_weights]
    sites = all_sites if sites is None else [s for s in sites if s in all_sites]
    rng: dict[str, SiteRange] = {}
    if sites and scheme.static_activations:
        if site_range_cache is not None and all(s in site_range_cache for s in sites):
            rng = {s: site_range_cache[s] for s in sites}
        else:
            rng = site_ranges(ranges, scheme, calibrator, sites)
    handler = handler_for(scheme)
    if weights:
        if handler.needs_hessians and hessians is None:
            raise FFNQuantError(f"scheme {scheme.name!r} ({scheme.method}) needs calibration data for the input Hessians")
        # an exact float rewrite of the whole FFN first where the method has one (AWQ's folded channel scales)
        new, records = handler.fold(model, scheme, hessians, weights, cache=fold_cache)
        remedies = [*remedies, *records]
    else:
        new = copy.deepcopy(model)
    linears: dict[str, QuantizedLinear] = {}
    with torch.no_grad():
        for name in weights:
            lin = getattr(new, name)
            h = hessians.get(name) if hessians is not None else None
            ql = handler.quantize(lin.weight, scheme, h)
            lin.weight.copy_(ql.weight)  # into the float weight's layout, which the forward's sums follow
            # one tensor for both: the module's weight holds the decoded values exactly (float32 into float32), and
            # a second copy per weight was a whole model's worth of float32 in an export (`deploy.planned`)
            ql = replace(ql, weight=lin.weight.detach()) if ql.weight.dtype == lin.weight.dtype else ql
            site = WEIGHT_INPUT_SITE[name]
            mode = None if site not in sites or scheme.act_dtype.is_float else str(scheme.act_mode)
            linears[name] = ql.with_input(name, site, mode, rng.get(site))
    return QuantizedFFN(new.eval(), scheme, rng, weights, sites, remedies, linears=linears)


class _AtHidden(Exception):
    """Raised by `search_calibrators`' hook once an FFN's hidden activations are seen: the rest is not needed."""


def search_calibrators(
    model: FFN,
    table: Any,
    scheme: Scheme | str,
    tokens: torch.Tensor,
    candidates: Sequence[str] | None = None,
    hessians: Mapping[str, torch.Tensor] | None = None,
) -> dict[str, str]:
    """Per site, the calibrator whose range gives the best FFN output SQNR on calibration `tokens`.

    The ranges are tried on the whole FFN with the weights quantized too, since the two sites' errors add up at
    the output; activation MSE on a histogram cannot see that a smoothed channel's error is amplified by its
    rescaled weight column. The pairs are searched a site at a time (see the comment below); the first
    candidate's pair (minmax) is always among them, so the pick is never worse than it on `tokens`.
    """

    scheme = get_scheme(scheme)
    if not scheme.static_activations:
        return {}
    names = list(candidates or CANDIDATES)
    per_site: dict[str, dict[tuple[float, float], str]] = {}
    ranges: dict[tuple[str, str], SiteRange] = {}
    for site in ACT_SITES:
        per_site[site] = {}
        for name in names:
            r = site_ranges(table, scheme, name, [site])[site]
            key = (round(r.lo, 12), round(r.hi, 12))
            if key not in per_site[site]:  # identical ranges: try once, keep the first (simplest) name
                per_site[site][key] = r.calibrator
                ranges[(site, r.calibrator)] = r
    ref = run_batched(model, tokens)
    weights_only = quantize_model(model, scheme, table, sites=[], hessians=hessians)  # weights quantized once
    net = weights_only.model
    # The hidden site only feeds w_down: per input-site range, run the FFN up to the hidden tap once and try hidden
    # ranges on the down projection alone. The two sites' errors are nearly independent (they add at the output),
    # so a coordinate search finds the pair: each input range with the hidden site float, then the best input's
    # hidden ranges, then every input range again at that hidden range. 6 + 2 x 6 down projections instead of
    # 6 x 6, and (minmax, minmax) among the pairs tried, so the pick is never worse than minmax on these tokens.
    hidden_of: dict[str, torch.Tensor] = {}

    def grab_hidden(mod, inp, out):  # the hidden tap's output kept, and the down projection not run (a third of it)
        seen.append(out.detach())
        raise _AtHidden

    for input_cal in per_site["input"].values():
        q = QuantizedFFN(net, scheme, {"input": ranges[("input", input_cal)]}, weights_only.quantized_weights, ["input"])
        seen: list[torch.Tensor] = []
        grab = net.taps["hidden"].register_forward_hook(grab_hidden)
        try:
            with torch.no_grad():
                for i in range(0, tokens.shape[0], 4096):
                    try:
                        q(tokens[i : i + 4096])
                    except _AtHidden:
                        pass
        finally:
            grab.remove()
            q.remove_hooks()
        hidden_of[input_cal] = torch.cat(seen)
    tried: dict[tuple[str, str | None], float] = {}

    def score(input_cal: str, hidden_cal: str | None) -> float:
        if (input_cal, hidden_cal) not in tried:
            hidden = hidden_of[input_cal]
            if hidden_cal is not None:
                hidden = _act_fn(scheme, ranges[("hidden", hidden_cal)])(hidden)
            with torch.no_grad():
                got = net.taps["output"](net.w_down(hidden))
            tried[(input_cal, hidden_cal)] = sqnr_db(ref, got)
        return tried[(input_cal, hidden_cal)]

    inputs, hiddens = list(per_site["input"].values()), list(per_site["hidden"].values())
    first_in = max(inputs, key=lambda c: (score(c, None), -inputs.index(c)))
    best_hidden = max(hiddens, key=lambda c: (score(first_in, c), -hiddens.index(c)))
    best_input = max(inputs, key=lambda c: (score(c, best_hidden), -inputs.index(c)))
    pairs = [(best_input, best_hidden), (inputs[0], hiddens[0])]  # the first names are the simplest (minmax)
    pick = max(pairs, key=lambda p: (score(*p), -pairs.index(p)))
    return {"input": pick[0], "hidden": pick[1]}
