"""Settle an FFN candidate of `hf.ffn_candidates` by running it (`probe`): a small copy of its module with seeded
random weights, and the assignment of gate, up and activation whose ffnquant computation reproduces the module's
output (to float32 summation order); a dense module doing more around its Linears (a residual, a norm) is the FFN
replaced Linear by Linear where that leaves its output its own, bit for bit (`Install.SPLIT`). Used by
`hf.discover`."""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import itertools
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import nn

from ..errors import FFNQuantError
from ..spec import Activation
from .arch import Install
from .ffn_candidates import FoundFFN, expert_matrices, input_major
from .own import elementwise, gate_interleaved, own_activations, own_gate, own_middle, rowwise

__all__ = ["probe", "probe_activation", "takes_residual", "takes_sorted_tokens"]

_ACT_FN = {
    Activation.RELU: torch.relu,
    Activation.GELU: lambda x: nn.functional.gelu(x),
    Activation.GELU_TANH: lambda x: nn.functional.gelu(x, approximate="tanh"),
    Activation.SILU: nn.functional.silu,
    Activation.SIGMOID: torch.sigmoid,
    Activation.IDENTITY: lambda x: x,
    Activation.RELU2: lambda x: torch.square(torch.relu(x)),
}
# a reproduction is accepted within this many float32 ulps of the output's scale: the module and ffnquant may
# sum in another order (addmm vs matmul + add), never more than a few roundings per output element
_REPRODUCE_RTOL = 64 * torch.finfo(torch.float32).eps
_PROBE_D, _PROBE_F = 24, 40  # a probe's widths, when the module computes at any width
_PROBE_FULL_MAX = 64_000_000  # parameters: a probe at the real widths above this is refused (memory)


def _activation_child(module: nn.Module, first: str = "") -> str:
    """The attribute of `module`'s one parameterless child that is an activation (probed on numbers), or ''; where
    it has none, the one beside the FFN's first Linear `first` (BERT's intermediate.intermediate_act_fn)."""
    found = [n for n, c in module.named_children() if not any(True for _ in c.parameters()) and probe_activation(c)]
    parent = first.rpartition(".")[0]
    if not found and parent:
        return next((f"{parent}.{n}" for n in [_activation_child(module.get_submodule(parent))] if n), "")
    return found[0] if len(found) == 1 else ""


def probe_activation(fn: Any) -> Activation | None:
    """The ffnquant Activation that `fn` computes (elementwise, on numbers from -6 to 6), or None."""
    x = torch.linspace(-6.0, 6.0, 241)
    try:
        with torch.no_grad():
            y = fn(x)
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return None
    for act, f in _ACT_FN.items():
        if torch.allclose(y.float(), f(x), rtol=0.0, atol=1e-6):
            return act
    return None


def _shrunk_copy(module: nn.Module, ffn: FoundFFN, d: int, f: int, gen: torch.Generator) -> nn.Module:
    """A copy of the (meta) FFN module with its FFN matrices at widths d, f, everything materialised in float32 on
    the CPU with seeded random values (the matrices are swapped while still on the meta device, so a module of a
    very wide model costs only the probe's widths)."""
    small = copy.deepcopy(module)
    for name, role in ffn.roles.items():
        n_in = f if role == "w_down" else d
        n_out = d if role == "w_down" else (2 * f if "+" in role else f)
        if ffn.install is Install.EXPERTS:  # one expert: [1, out, in], input-major [1, in, out], flat [rows, cols]
            major = input_major(ffn, name)
            shape = (n_in, n_out) if major else (n_out, n_in)
            parent, _, attr = name.rpartition(".")
            owner = small.get_submodule(parent) if parent else small
            # every expert kept where the module routes the tokens itself (its router reads that many)
            lead = (ffn.experts,) if ffn.matrix_experts else () if ffn.flat_experts else (1,)
            setattr(owner, attr, nn.Parameter(torch.empty(*lead, *shape, device="meta")))
            if isinstance(getattr(owner, f"{attr}_bias", None), torch.Tensor):
                setattr(owner, f"{attr}_bias", nn.Parameter(torch.empty(1, n_out, device="meta")))
            continue
        old = small.get_submodule(name)
        if ffn.transposed:
            new = copy.deepcopy(old)
            new.weight = nn.Parameter(torch.empty(n_in, n_out, device="meta"))
            new.bias = nn.Parameter(torch.empty(n_out, device="meta"))
            new.nf = n_out
        else:
            new = nn.Linear(n_in, n_out, bias=getattr(old, "bias", None) is not None, device="meta")
        parent, _, attr = name.rpartition(".")
        setattr(small.get_submodule(parent) if parent else small, attr, new)
    if ffn.matrix_experts:  # its router and output bias at the probe's width too
        _resize_others(small, ffn, {ffn.d_model: d, ffn.d_ff: f, 2 * ffn.d_ff: 2 * f})
        _shrink_sizes(small, {ffn.d_model: d, ffn.d_ff: f})
    elif ffn.install is Install.EXPERTS:
        _shrink_sizes(small, {ffn.experts: 1, ffn.d_model: d, ffn.d_ff: f})
    small = small.to_empty(device="cpu").float()
    with torch.no_grad():
        majors = {id(small.get_parameter(n)) for n in ffn.roles if input_major(ffn, n)} \
            if ffn.install is Install.EXPERTS else set()
        for p in small.parameters():  # unit-scale outputs: the activations' shapes are told apart on them
            fan_in = (p.shape[-2] if id(p) in majors else p.shape[-1]) if p.dim() >= 2 else 1
            p.copy_(torch.randn(p.shape, generator=gen) * (1.5 * fan_in ** -0.5 if p.dim() >= 2 else 0.5))
        # buffers too: to_empty leaves them as whatever memory held (xIELU's beta and eps), and a probe must give
        # the same verdict every run
        for b in small.buffers():
            b.copy_(torch.randn(b.shape, generator=gen) * 0.5 if b.is_floating_point() else torch.zeros_like(b))
        if ffn.matrix_experts:
            # a module that routes its tokens itself: every expert the same and its own output bias zero, its output
            # is one expert's FFN, whichever experts the router picks (their gates sum to 1)
            for name in ffn.roles:
                t = small.get_parameter(name)
                t.copy_(t[:1].expand_as(t))
            for _, p in small.named_parameters(recurse=False):
                if p.dim() == 1:
                    p.zero_()
    return small.eval()


def _resize_others(small: nn.Module, ffn: FoundFFN, sizes: Mapping[int, int]) -> None:
    """Every parameter of the (meta) copy beside the FFN's matrices with its dimensions of the model's widths at
    the probe's (a router [experts, d], an output bias [d])."""
    if len(set(sizes)) != len(sizes):
        return
    roles = {id(small.get_parameter(n)) for n in ffn.roles}
    for name, p in list(small.named_parameters()):
        if id(p) in roles:
            continue
        parent, _, attr = name.rpartition(".")
        shape = tuple(sizes.get(int(n), int(n)) for n in p.shape)
        setattr(small.get_submodule(parent) if parent else small, attr, nn.Parameter(torch.empty(shape, device="meta")))


def _shrink_sizes(small: nn.Module, sizes: Mapping[Any, int]) -> None:
    """Set the size attributes of an experts module and its children to the probe's: every int attribute holding
    the model's number of experts, width or FFN width (MixtralExperts' num_experts, hidden_dim, intermediate_dim;
    DBRX's hidden_size, ffn_hidden_size, whatever their names), where those three differ."""
    if len(set(sizes)) != len(sizes) or None in sizes:
        return
    for module in small.modules():
        for attr, value in list(vars(module).items()):
            if isinstance(value, int) and not isinstance(value, bool) and value in sizes:
                setattr(module, attr, sizes[value])


def _matrices(small: nn.Module, ffn: FoundFFN) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """role attribute -> (weight [out, in], bias) of the copy."""
    out = {}
    for name in ffn.roles:
        if ffn.install is Install.EXPERTS:
            w = expert_matrices(small.get_parameter(name), name, ffn, 1)[0]
            b = getattr(small, f"{name}_bias", None) if "." not in name else None
            out[name] = (w, b[0] if isinstance(b, torch.Tensor) else None)
            continue
        m = small.get_submodule(name)
        w = m.weight.t() if ffn.transposed else m.weight
        out[name] = (w, getattr(m, "bias", None))
    return out


def _assignments(ffn: FoundFFN) -> list[dict[str, str]]:
    roles = dict(ffn.roles)
    if not ffn.gated:
        return [roles]
    fused = [n for n, r in roles.items() if "+" in r]
    if fused:
        return [roles, {**roles, fused[0]: "w_up+w_gate"}]
    a, b = [n for n, r in roles.items() if r != "w_down"]
    return [roles, {**roles, a: "w_up", b: "w_gate"}]


def _ffnquant_output(mats: Mapping[str, tuple[torch.Tensor, Any]], roles: Mapping[str, str],
                     act: Callable[..., torch.Tensor], x: torch.Tensor, of_both: bool = False) -> torch.Tensor:
    """What ffnquant's FFN computes with these matrices, roles and activation (`of_both`: a gate function of gate
    and up, `Activation.OWN_GATE`; an activation that `reads_input` is handed the FFN's input too, as `FFN`
    hands it)."""
    lin = lambda name, h: nn.functional.linear(h, *mats[name])  # noqa: E731
    if getattr(act, "reads_input", False):
        act = functools.partial(act, x=x)
    by_role = {r: n for n, r in roles.items()}
    down = by_role["w_down"]
    if "w_up" not in by_role:  # a fused gate+up matrix
        both = by_role.get("w_gate+w_up") or by_role["w_up+w_gate"]
        product = lin(both, x)
        # a gate function that reads the halves interleaved (gpt-oss'): gate and up are every other column
        first, second = ((product[..., 0::2], product[..., 1::2]) if getattr(act, "interleaved", False)
                         else product.chunk(2, dim=-1))
        gate, up = (first, second) if both == by_role.get("w_gate+w_up") else (second, first)
    elif "w_gate" in by_role:
        gate, up = lin(by_role["w_gate"], x), lin(by_role["w_up"], x)
    else:
        return lin(down, act(lin(by_role["w_up"], x)))
    return lin(down, act(gate, up) if of_both else act(gate) * up)


def takes_residual(module: nn.Module) -> bool:
    """Whether a module's forward takes a second required argument named `residual` (BLOOM's and MPT's MLPs add the
    block's residual stream to their output)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return (len(params) >= 2 and params[1].name == "residual" and params[1].default is inspect.Parameter.empty
            and params[1].kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD))


def takes_sorted_tokens(module: nn.Module) -> bool:
    """Whether a fused experts module's forward takes the hidden states alone, every expert's rows stacked
    ([experts x tokens, d], Llama 4's: its MoE block scales each token by its router score, zero where it is not
    routed), rather than the tokens with their top-k experts and weights (Mixtral's)."""
    try:
        params = [p for p in inspect.signature(type(module).forward).parameters.values()][1:]
    except (TypeError, ValueError):
        return False
    # one parameter in all: gpt-oss' forward(hidden_states, router_indices=None, routing_weights=None) routes
    return len(params) == 1 and params[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                   inspect.Parameter.POSITIONAL_OR_KEYWORD)


_NO_ASSIGNMENT = "no assignment of gate, up and activation reproduces it"


def takes_layer_idx(module: nn.Module) -> bool:
    """Whether a module's forward takes `layer_idx`, transformers' name for the index of the layer calling it (Zamba
    2's MLP picks its per-call adapter by it): the probe passes the block's index, as the model does."""
    try:
        return "layer_idx" in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def _module_output(small: nn.Module, ffn: FoundFFN, x: torch.Tensor, act_attr: str,
                   residual: torch.Tensor | None = None, layer_idx: int | None = None) -> tuple[torch.Tensor, bool]:
    """The copy's output on `x`, and whether it was given `layer_idx` (only where it fails without it)."""
    try:
        return _output(small, ffn, x, act_attr, residual), False
    except Exception as exc:  # noqa: BLE001 - a forward that needs the calling layer's index (Zamba 2's MLP;
        # Moshi's takes one too, and computes otherwise with it: given only where the module fails without it)
        if layer_idx is None or not takes_layer_idx(small):
            raise
        try:
            return _output(functools.partial(small, layer_idx=layer_idx), ffn, x, act_attr, residual), True
        except Exception as with_index:  # noqa: BLE001 - fails either way: the first failure is the cause
            raise exc from with_index


def _output(small: Any, ffn: FoundFFN, x: torch.Tensor, act_attr: str,
            residual: torch.Tensor | None = None) -> torch.Tensor:
    with torch.no_grad():
        if residual is not None:  # the module adds it: FFN(x) + residual
            return small(x, residual)
        if ffn.matrix_experts:  # it routes the tokens itself: [batch, tokens, d]
            y = small(x[None])
            y = y[0] if isinstance(y, (tuple, list)) else y
            return y.reshape(x.shape) if isinstance(y, torch.Tensor) and y.numel() == x.numel() else y
        if ffn.install is Install.EXPERTS:
            if takes_sorted_tokens(small):  # one expert: its rows are the tokens (Llama 4's)
                return small(x)
            index = torch.zeros(x.shape[0], 1, dtype=torch.long)
            y = small(x, index, torch.ones(x.shape[0], 1))
            # as its rows, whatever leading shape it gives them (DBRX's: [rows, 1, d] for rows taken as a batch)
            return y.reshape(x.shape) if isinstance(y, torch.Tensor) and y.numel() == x.numel() else y
        if ffn.install is Install.SPLIT:  # the block's own Linears: first, activation, second
            up = next(n for n, r in ffn.roles.items() if r != "w_down")
            down = next(n for n, r in ffn.roles.items() if r == "w_down")
            return small.get_submodule(down)(small.get_submodule(act_attr)(small.get_submodule(up)(x)))
        try:
            return small(x)
        except Exception:  # noqa: BLE001 - a forward that reads [batch, tokens, width] (Moshi's views its gate
            # and value halves per batch and token): the tokens as one sequence
            return small(x.unsqueeze(0)).squeeze(0)


def probe(module: nn.Module, ffn: FoundFFN, where: str, layer_idx: int | None = None) -> FoundFFN:
    """Settle a candidate's roles and activation by reproducing its module's output (see the module docstring);
    `layer_idx`: the index of the block calling it, for a forward that takes one."""
    gen = torch.Generator().manual_seed(0)
    first = next((n for n, r in ffn.roles.items() if r != "w_down"), "")
    act_attr = _activation_child(module, first) if ffn.install is Install.SPLIT else ""
    if ffn.install is Install.SPLIT and not act_attr:
        raise FFNQuantError(f"{where}: the block's FFN Linears have no activation module beside them that ffnquant "
                            f"can compute ({', '.join(a.value for a in _ACT_FN)})")
    attempts = [(min(ffn.d_model, _PROBE_D), min(ffn.d_ff, _PROBE_F))]
    n_full = sum(p.numel() for p in module.parameters())
    if n_full <= _PROBE_FULL_MAX:
        attempts.append((ffn.d_model, ffn.d_ff))
    last = _NO_ASSIGNMENT
    residual = ffn.install is Install.MODULE and takes_residual(module)
    for d, f in attempts:
        try:
            small = _shrunk_copy(module, ffn, d, f, gen)
            x = torch.randn(7, d, generator=gen) * 1.5
            y, indexed = _module_output(small, ffn, x, act_attr, torch.zeros_like(x) if residual else None,
                                        layer_idx)
            if residual:  # what it adds is the residual itself, exactly: FFN(x) + r, whatever r
                r = torch.randn(7, d, generator=gen)
                added, _ = _module_output(small, ffn, x, act_attr, r, layer_idx)
                if not torch.equal(added, y + r):
                    last = ("its second argument 'residual' is not added to its output as it is (the output "
                            f"moves by {float((added - y - r).abs().max()):.3g} beside the residual)")
                    continue
        except Exception as exc:  # a module that reads its configured width: try the real widths
            last = f"running a copy of it failed ({type(exc).__name__}: {str(exc)[:120]})"
            continue
        if not isinstance(y, torch.Tensor) or y.shape != (x.shape[0], d):
            last = f"its output has shape {getattr(y, 'shape', None)}, not [tokens, {d}]"
            continue
        # it ran at these widths: what an earlier attempt's failure said no longer applies
        last = _NO_ASSIGNMENT
        mats = _matrices(small, ffn)
        scale = float(y.abs().max()) or 1.0
        named = ((roles, act, _ACT_FN[act], act_attr, lambda: None) for roles in _assignments(ffn)
                 for act in Activation if act in _ACT_FN)
        # the model's own functions only where no named activation reproduces it (built then: they run the module)
        tries = itertools.chain(named, _own_tries(module, small, ffn, d, f, gen, residual,
                                                  layer_idx if indexed else None))
        for roles, act, fn, attr, template in tries:
            with torch.no_grad():
                mine = _ffnquant_output(mats, roles, fn, x, act is Activation.OWN_GATE)
            if float((mine - y).abs().max()) <= _REPRODUCE_RTOL * scale * max(d, f) ** 0.5:
                return dataclasses.replace(ffn, roles=roles, activation=act, act_attr=attr, residual=residual,
                                           act_module=template())
    split = _as_split(module, ffn, gen) if ffn.install is Install.MODULE and not ffn.gated else None
    if split is not None:
        return split
    acts = [type(c).__name__ for c in module.children() if not any(True for _ in c.parameters())
            and not isinstance(c, nn.Dropout)]
    seen = f" (its parameterless parts: {', '.join(acts)})" if acts else ""
    # parameters beside the FFN's matrices (a norm inside the MLP, an activation with learned parameters): a part
    # ffnquant's FFN does not compute, the likely cause, named first
    matrices = {f"{name}.{p}" for name in ffn.roles for p in ("weight", "bias")} | set(ffn.roles)
    others = [f"{n} {list(p.shape)} ({type(module.get_submodule(n.rpartition('.')[0])).__name__})"
              if "." in n else f"{n} {list(p.shape)}" for n, p in module.named_parameters() if n not in matrices]
    beside = (f"; it holds parameters beside the FFN's matrices that ffnquant's FFN does not compute: "
              f"{', '.join(others[:3])}{' and more' if len(others) > 3 else ''}") if others else ""
    raise FFNQuantError(f"{where}: ffnquant cannot reproduce this FFN's output{seen}{beside}: {last}; activations "
                        f"ffnquant computes: {', '.join(a.value for a in _ACT_FN)}, or the model's own elementwise "
                        f"activation module")


def _own_tries(module: nn.Module, small: nn.Module, ffn: FoundFFN, d: int, f: int, gen: torch.Generator,
               residual: bool, layer_idx: int | None = None
               ) -> Iterator[tuple[Mapping[str, str], Activation, Any, str, Callable[[], Any]]]:
    """(roles, activation, its function on the probe's copy `small`, its attribute, its template from the meta
    `module`) of the model's own functions (`hf.own`), in order: an elementwise activation module (learned
    parameters and all), an experts module's gate function of gate and up, all a dense MLP computes between its
    Linears, the same reading the FFN's input too (`layer_idx`: what the module's forward needs, or None)."""
    own_acts = [n for n in own_activations(small, ffn)
                if ffn.install is not Install.SPLIT and elementwise(small.get_submodule(n), f, gen)]
    for roles in _assignments(ffn):
        for n in own_acts:
            yield roles, Activation.OWN, small.get_submodule(n), n, lambda n=n: copy.deepcopy(module.get_submodule(n))
    layout = gate_interleaved(small, f, gen) if callable(getattr(small, "_apply_gate", None)) else None
    for roles in _assignments(ffn):
        gate = own_gate(small, ffn, roles, bool(layout)) if layout is not None else None
        if gate is not None and elementwise(gate, f, gen, 2):
            yield roles, Activation.OWN_GATE, gate, "", lambda r=roles: own_gate(module, ffn, r, bool(layout))
        middle = own_middle(small, ffn, roles) if ffn.install is Install.MODULE and not residual else None
        if middle is not None and rowwise(middle, f, gen, 2 if ffn.gated else 1):
            yield (roles, Activation.OWN_GATE if ffn.gated else Activation.OWN, middle, "",
                   lambda r=roles: own_middle(module, ffn, r))
    if ffn.install is not Install.MODULE or residual:
        return
    for roles in _assignments(ffn):  # last: the module's own forward on the FFN's input, its Linears answering
        middle = own_middle(small, ffn, roles, reads_input=True, layer_idx=layer_idx)
        if middle is not None and rowwise(lambda *z, m=middle: m(*z[:-1], x=z[-1]), f, gen, 2 if ffn.gated else 1,
                                          widths=(d,)):
            yield (roles, Activation.OWN_GATE if ffn.gated else Activation.OWN, middle, "",
                   lambda r=roles: own_middle(module, ffn, r, reads_input=True, layer_idx=layer_idx))


def _as_split(module: nn.Module, ffn: FoundFFN, gen: torch.Generator) -> FoundFFN | None:
    """A dense FFN module whose forward does more around its Linears (XLNet's adds the residual and normalises,
    Reformer's normalises first): the FFN is its first Linear, activation and second Linear, replaced Linear by
    Linear (`Install.SPLIT`) where the module's output with the first Linear computing the whole chain (the
    activation and second Linear then identities) is its own output, bit for bit; else None."""
    up = next(n for n, r in ffn.roles.items() if r != "w_down")
    down = next(n for n, r in ffn.roles.items() if r == "w_down")
    act_attr = _activation_child(module, up)
    if not act_attr:
        return None
    split = dataclasses.replace(ffn, install=Install.SPLIT, act_attr=act_attr)
    # at the model's widths: what the module does around the Linears (a norm) is as wide as the model
    if sum(p.numel() for p in module.parameters()) > _PROBE_FULL_MAX:
        return None
    d, f = ffn.d_model, ffn.d_ff
    try:
        small = _shrunk_copy(module, split, d, f, gen)
        x = torch.randn(7, d, generator=gen) * 1.5
        with torch.no_grad():
            own = small(x)
            first, fn, second = (small.get_submodule(a) for a in (up, act_attr, down))
            act = probe_activation(fn)
            for dotted, new in ((up, _Chain(first, fn, second)), (act_attr, nn.Identity()), (down, nn.Identity())):
                parent, _, attr = dotted.rpartition(".")
                setattr(small.get_submodule(parent) if parent else small, attr, new)
            replaced = small(x)
    except Exception:  # noqa: BLE001 - a module that does not run so: not this form
        return None
    if act is None or not isinstance(own, torch.Tensor) or not torch.equal(own, replaced):
        return None
    return dataclasses.replace(split, activation=act)


class _Chain(nn.Module):
    """The whole FFN in place of its first Linear: first Linear, activation, second Linear on what it is given."""

    def __init__(self, *parts: nn.Module) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for part in self.parts:
            x = part(x)
        return x
