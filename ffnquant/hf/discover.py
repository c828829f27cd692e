"""Find a causal LM's FFNs from the model itself: its module tree, and a probe that reproduces each FFN's output.

transformers builds the model from config.json on the meta device (no memory, no weights); the decoder
blocks are the largest `nn.ModuleList`; in each block, an FFN is a set of matrices that map the model width d
to a width f and back: separate Linears (gate/up/down under any names), a fused gate+up Linear (Phi-3, GLM),
GPT-2's Conv1D ([in, out]), Linears that sit in the block itself (OPT), or a mixture-of-experts module holding
every expert's matrices as 3-D tensors (transformers >= 5). Which matrix is the gate, which half of a fused
matrix comes first and what the activation is are not read from names: a small copy of one FFN module with
seeded random weights is run and the assignment whose ffnquant computation reproduces the module's output
(to float32 summation order) is the one kept; none reproducing refuses the model with the reason.

What is not an FFN stays float and is named: a mixture-of-experts router, shared experts and FFNs of another
shape than the model's main one (one FFN shape per model: DeepSeek-V3's dense first layers beside its experts).
The result is an `Arch` (`hf.arch`) like the hand-written ones, so every command reads it the same way.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from ..errors import FFNQuantError
from ..spec import Activation
from .conversions import expert_sources, pretrained_classes, with_renames
from .looped import call_order
from .skeleton import causal_lm_from_config
from .ffn_candidates import FoundFFN, candidates, linear_shape
from .arch import ARCHITECTURES, Arch, Install, ModelKind
from .own import OwnMiddle, own_middle
from .probe import probe, probe_activation
from .validate import check_attention_config

__all__ = ["FoundFFN", "Discovery", "discover", "discover_config", "arch_for_config", "ACTIVATION_NAMES", "probe_activation"]

# the transformers activation name each ffnquant Activation is reported (and re-read, `hf_activation`) as
ACTIVATION_NAMES: Mapping[Activation, str] = {
    Activation.RELU: "relu", Activation.GELU: "gelu", Activation.GELU_TANH: "gelu_pytorch_tanh",
    Activation.SILU: "silu", Activation.SIGMOID: "sigmoid", Activation.IDENTITY: "linear", Activation.RELU2: "relu2",
    # the model's own module (`Arch.activation_template`), no transformers name
    Activation.OWN: "own", Activation.OWN_GATE: "own_gate",
}


@dataclass(frozen=True)
class Discovery:
    """What `discover` found: the blocks' list, the FFN kept for quantization and in which blocks, what stays float."""

    model_type: str
    class_name: str
    layers_path: str  # e.g. "model.layers"
    n_blocks: int
    ffn: FoundFFN
    blocks: tuple[int, ...]
    float_parts: tuple[str, ...] = field(default=())  # "L0 mlp (dense, d_ff 64): reason"
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)  # the built model's tensors, by name
    # the classes of the model's PreTrainedModel modules, outermost first: transformers' conversion mapping keys
    model_classes: tuple[str, ...] = field(default=())
    # blocks whose FFN is an earlier block's, the same Parameters called again (Zamba's): {block: first block}
    shares: Mapping[int, int] = field(default_factory=dict)
    # blocks whose own middle holds other tensors than the kept FFN's template (`Arch.activation_templates`)
    own_templates: Mapping[int, Any] = field(default_factory=dict)
    # the blocks in the order the model's forward calls them, where that is not each once in order (a looped
    # depth: `hf.looped.call_order`); () for nearly every model
    calls: tuple[int, ...] = ()

    def list_suffix(self) -> str:
        """The shortest tail of the blocks' list path that names no other list of the model: checkpoints are read
        by it whatever prefix they store ('layers' mostly; HRM's 'H_module.layers' beside its 'L_module.layers')."""
        parts = self.layers_path.split(".")
        # the lists whose blocks hold tensors under the FFN's names (Gemma 3's vision tower's layers hold fc1/fc2:
        # never read for its language model's mlp.gate_proj)
        rel = (self.ffn.path + ".") if self.ffn.path else ""
        heads = tuple(rel + role for role in self.ffn.roles)
        lists = set()
        for name in self.shapes:
            pieces = name.split(".")
            for i, part in enumerate(pieces):
                if part.isdigit() and ".".join(pieces[i + 1:]).startswith(heads):
                    lists.add(".".join(pieces[:i]))
        for k in range(1, len(parts) + 1):
            suffix = ".".join(parts[-k:])
            if len({p for p in lists if p == suffix or p.endswith("." + suffix)}) <= 1:
                return suffix
        return self.layers_path

    def arch(self) -> Arch:
        """The `hf.arch.Arch` of this model: checkpoint and module patterns built from the names found."""
        ffn = self.ffn
        suffix = self.list_suffix()
        tail = re.escape(suffix)
        rel = (r"\." + re.escape(ffn.path)) if ffn.path else ""
        prefix = r"(?P<prefix>(?:.+\.)?" + tail + r"\.(?P<layer>\d+)" + rel + ")"
        roles_re = "|".join(re.escape(r) for r in sorted(ffn.roles))
        act = ACTIVATION_NAMES[ffn.activation] if ffn.activation is not None else "linear"
        gated = ffn.gated
        fixed = {"d_model": ffn.d_model, "d_ff": ffn.d_ff, "n_layers": self.n_blocks, "n_experts": ffn.experts,
                 "blocks": self.blocks, "shapes": self.shapes, "shares": dict(self.shares),
                 "calls": self.calls}
        # the whole path of the blocks' list: a multimodal model's vision tower has its own `layers.N.mlp`
        module_pattern = r"(?:.+\.)?" + re.escape(self.layers_path) + r"\.{layer}" + rel
        common: dict[str, Any] = dict(
            name=self.model_type, kind=ModelKind.CAUSAL_LM, d_model_keys=("hidden_size",), d_ff_keys=("intermediate_size",),
            activation=lambda c, w: (act, gated), roles=dict(ffn.roles), transposed=ffn.transposed,
            module_pattern=module_pattern, fixed=fixed, discovered=True, float_parts=self.float_parts,
            linear_class=ffn.linear_class if ffn.install is not Install.EXPERTS else "", residual_arg=ffn.residual,
            # the norm before each FFN is found when the model runs (`hf.fold`), from who produces its input
            norm_pattern="", norm_from_graph=True,
            activation_template=ffn.act_module, activation_attr=ffn.act_attr if ffn.act_module is not None else "",
            activation_templates=dict(self.own_templates))
        roles = tuple(sorted(ffn.roles))
        if ffn.install is Install.EXPERTS:
            # checkpoints often keep one 2-D tensor per expert and matrix, which transformers fuses at load time:
            # its own conversion mapping names them, and the order in which it concatenates gate and up
            per_expert, renames = expert_sources(self.model_type, ffn, self.model_classes)
            path = with_renames(suffix + r"\.(?P<layer>\d+)" + rel, renames)
            expert_prefix = r"(?P<prefix>(?:.+\.)?" + path + r"\.(?P<expert>\d+))"
            fused_prefix = r"(?P<prefix>(?:.+\.)?" + path + ")"
            expert_re = "|".join(re.escape(r) for r in sorted(per_expert)) or r"(?!)"
            common["roles"] = {**per_expert, **ffn.roles}
            return Arch(**common, tensor_pattern=expert_prefix + r"\.(?P<role>" + expert_re + r")\.(?P<kind>weight|bias)",
                        # each fused tensor's biases under <name>_bias (gpt-oss')
                        fused_experts_pattern=fused_prefix + r"\.(?P<role>" + roles_re + ")(?P<bias>_bias)?",
                        interleaved=bool(getattr(ffn.act_module, "interleaved", False)), experts_class=ffn.linear_class,
                        input_major=ffn.input_major, flat_experts=ffn.flat_experts,
                        matrix_experts=ffn.matrix_experts,
                        gated_roles=tuple(sorted(per_expert)), dense_roles=tuple(sorted(per_expert)),
                        fused_expert_roles=roles, install=Install.EXPERTS, n_experts_key="num_experts")
        pattern = prefix + r"\.(?P<role>" + roles_re + r")\.(?P<kind>weight|bias)"
        split = ("", "", "")
        if ffn.install is Install.SPLIT:
            up = next(a for a, w in ffn.roles.items() if w != "w_down")
            down = next(a for a, w in ffn.roles.items() if w == "w_down")
            split = (up, ffn.act_attr, down)
        return Arch(**common, tensor_pattern=pattern, gated_roles=roles, dense_roles=roles, install=ffn.install,
                    split_attrs=split)


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    if not lists:
        raise FFNQuantError(f"{type(model).__name__}: no list of decoder blocks (nn.ModuleList) in the model")
    size = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    try:  # a multimodal model's language decoder (transformers' get_decoder), whatever its vision tower weighs
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    except Exception:  # noqa: BLE001 - a model without one
        decoder = None
    inside = [(n, m) for n, m in lists if decoder is not None and decoder is not model
              and any(m is x for x in decoder.modules())]
    if inside:  # the decoder's own stack is its shallowest list: a tower it embeds (Phi-4's audio encoder, GIT's
        # image encoder) sits deeper, whatever it weighs
        return min(inside, key=lambda item: (item[0].count("."), -size(item[1])))
    return max(lists, key=lambda item: size(item[1]))


def _block_width(block: nn.Module) -> int | None:
    """The width a block reads and writes: the one most of its Linears (or Conv1Ds) take in or give out (its
    attention's projections and its FFN's first and last matrices); None without any."""
    counts: dict[int, int] = {}
    for module in block.modules():
        shape = linear_shape(module)
        if shape is not None:
            for width in shape[:2]:
                counts[width] = counts.get(width, 0) + 1
    return max(counts, key=lambda w: (counts[w], -w)) if counts else None


def _unread_experts(block: nn.Module, d: int, cands: list[FoundFFN], settle: Any, i: int) -> list[str]:
    """A block's routed experts that are not kept: candidates whose probe refused them (with its reason), or
    stacked 3-D expert tensors in a layout ffnquant does not read."""
    out = [f"{_label(c.path)} (routed experts: {_why(str(settle(i, c)))})" for c in cands
           if c.install is Install.EXPERTS and not isinstance(settle(i, c), FoundFFN)]
    seen = {c.path for c in cands if c.install is Install.EXPERTS}
    for path, module in block.named_modules():
        params = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.shape[0] > 1]
        stacked = [f"{n} {list(p.shape)}" for n, p in params if d in p.shape[1:]]
        if len(stacked) >= 2 and path not in seen and _out_and_back(params, d):
            out.append(f"{_label(path)} (routed experts {', '.join(stacked[:3])}: not laid out as ffnquant reads "
                       f"routed experts, {_expert_layouts(d)})")
    return out


def _out_and_back(params: list[tuple[str, torch.Tensor]], d: int) -> bool:
    """Whether stacked 3-D tensors [n, ., .] of one module could be experts' FFN matrices: one maps the width d to
    some f (or 2f), another f back to d, with the same n. A Mamba mixer's per-head projections ([heads, dt + 2
    states, d], [heads, d, dt]) hold d too, but never go out and back through one width."""
    widths = {(int(p.shape[0]), int(w)) for _, p in params if d in p.shape[1:] for w in p.shape[1:] if w != d}
    return any((n, 2 * f) in widths or (n, f // 2) in widths or sum(1 for _, p in params if p.shape[0] == n
               and d in p.shape[1:] and f in p.shape[1:]) >= 2 for n, f in widths)


def _expert_layouts(d: int) -> str:
    """The layouts of routed experts' tensors ffnquant reads (`ffn_candidates`), at model width d."""
    return (f"[experts, 2f or f, {d}] (or gate and up apart) and [experts, {d}, f], each tensor output-major as "
            f"these or input-major ([experts, {d}, 2f or f], [experts, f, {d}]), 3-D or flat ([experts x rows, cols] "
            "in a module with num_experts)")


def _why(refusal: str) -> str:
    """A probe's refusal without the module's path before it and the list of activations after it."""
    text = refusal[refusal.find("ffnquant cannot"):] if "ffnquant cannot" in refusal else refusal
    return text.split("; activations ffnquant computes")[0]


def _label(path: str) -> str:
    return path or "the block's own Linears"


def discover(model: nn.Module, model_type: str = "", where: str = "") -> Discovery:
    """Find the FFNs of a causal LM (on the meta device or not; nothing of it is run or changed)."""
    where = where or type(model).__name__
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    d = _config_int(text, "hidden_size", "n_embd", "d_model")
    layers_path, blocks = _blocks(model)
    if d is None:  # a config of several stacks of their own widths (BLT's): the width of the blocks themselves
        d = _block_width(blocks[0])
    if d is None:
        raise FFNQuantError(f"{where}: the config names no model width (hidden_size), and the blocks of "
                            f"{layers_path} hold no Linear to read one from")
    found: dict[int, list[FoundFFN]] = {i: candidates(block, d) for i, block in enumerate(blocks)}
    # every FFN-shaped candidate is probed once per structure: what does not reproduce is not an FFN (an attention
    # whose heads make another width maps d -> h -> d too, but it is no function of its input alone)
    probed: dict[tuple, FoundFFN | str] = {}

    def settle(i: int, c: FoundFFN) -> FoundFFN | str:
        if c.key() not in probed:
            module = blocks[i].get_submodule(c.path) if c.path else blocks[i]
            try:
                probed[c.key()] = probe(module, c, f"{where}: {layers_path}.{i}.{_label(c.path)}", layer_idx=i)
            except FFNQuantError as exc:
                probed[c.key()] = str(exc)
        return probed[c.key()]

    # the FFN kept: experts where a block has them (the bulk of an MoE's parameters), else the block's FFN
    per_block: dict[int, FoundFFN] = {}
    float_parts: list[str] = []
    refused: list[str] = []
    for i, cands in found.items():
        valid = [c for c in cands if isinstance(settle(i, c), FoundFFN)]
        refused += [str(settle(i, c)) for c in cands if c not in valid]
        if not valid:
            continue
        experts = [c for c in valid if c.install is Install.EXPERTS]
        # the most parameters (X-MOD's main FFN, not its language adapter), a module before Linears in the block
        pick = experts[0] if experts else max(valid, key=lambda c: (c.d_ff * (3 if c.gated else 2),
                                                                     c.install is Install.MODULE))
        per_block[i] = pick
        for other in valid:
            if other is not pick:
                float_parts.append(f"L{i} {_label(other.path)} (d_ff {other.d_ff}): stays float, ffnquant quantizes "
                                   f"one FFN per block ({_label(pick.path)} here)")
        if not experts:  # routed experts beside the FFN kept, which ffnquant does not read: said, never skipped
            float_parts += [f"L{i} {part}: stay float, ffnquant quantizes {_label(pick.path)} here"
                            for part in _unread_experts(blocks[i], d, cands, settle, i)]
        if experts:
            for name, mod in blocks[i].named_modules():
                w = getattr(mod, "weight", None)
                n_experts = pick.experts or 0
                if isinstance(w, torch.Tensor) and w.dim() == 2 and tuple(w.shape) == (n_experts, d) and name != pick.path:
                    float_parts.append(f"L{i} {name}: the router stays float")
    if not per_block:
        if refused:  # FFN-shaped, but nothing ffnquant computes reproduces it: the most FFN-like one's reason
            raise FFNQuantError(max(refused, key=lambda r: ("mlp" in r, "reproduce" in r)))
        # expert-like tensors in a layout ffnquant does not read, named as found:
        # several matrices stacked, one of their two matrix axes the model width (a convolution's [C, 1, K] or
        # a recurrence's per-head blocks are not)
        stacked = [f"{name} {list(p.shape)}" for name, p in blocks[0].named_parameters()
                   if p.dim() == 3 and p.shape[0] > 1 and d in p.shape[1:]]
        if stacked:
            raise FFNQuantError(f"{where}: no FFN found in its {len(blocks)} blocks ({layers_path}): its experts' "
                                f"tensors {', '.join(stacked[:4])} are not laid out as ffnquant reads routed experts "
                                f"({_expert_layouts(d)})")
        # matrices that are no Linear's weight (DBRX's experts: [experts x f, d] each, sliced in the forward)
        loose = [f"{name} {list(p.shape)} ({type(blocks[0].get_submodule(name.rpartition('.')[0])).__name__})"
                 for name, p in blocks[0].named_parameters() if p.dim() == 2 and d in p.shape and p.shape[0] != p.shape[1]
                 and linear_shape(blocks[0].get_submodule(name.rpartition(".")[0])) is None]
        if loose:
            raise FFNQuantError(f"{where}: no FFN found in its {len(blocks)} blocks ({layers_path}): the matrices that "
                                f"hold the width {d} are parameters of their module, not Linear modules' weights: "
                                f"{', '.join(loose[:3])}{' and more' if len(loose) > 3 else ''}; ffnquant reads an FFN "
                                f"from Linear (or Conv1D) modules, and routed experts from 3-D tensors [experts, 2f "
                                f"or f, {d}] and [experts, {d}, f]")
        out = {n: tuple(p.shape) for n, p in blocks[0].named_parameters() if p.dim() == 2 and p.shape[1] == d != p.shape[0]}
        back = {n: tuple(p.shape) for n, p in blocks[0].named_parameters() if p.dim() == 2 and p.shape[0] == d != p.shape[1]
                and any(shape[0] == p.shape[1] for shape in out.values())}
        if out and back:  # out and back, but across modules (BERT's intermediate.dense, output.dense), none an FFN
            first, second = next(iter(out)), next(iter(back))

            def owner(param: str) -> str:  # the class of the module holding the Linear that holds `param`
                linear = param.rpartition(".")[0]
                return type(blocks[0].get_submodule(linear.rpartition(".")[0] or linear)).__name__

            raise FFNQuantError(
                f"{where}: no FFN found in its {len(blocks)} blocks ({layers_path}): {first} {list(out[first])} maps the "
                f"width {d} out and {second} {list(back[second])} back, but in different modules ({owner(first)}, "
                f"{owner(second)}), the second one's forward taking more than the FFN (the residual, a norm); ffnquant "
                "replaces an FFN that is one module or the block's own Linears")
        raise FFNQuantError(f"{where}: no FFN found in its {len(blocks)} blocks ({layers_path}): no matrices map the "
                            f"width {d} to another width and back")
    groups: dict[tuple, list[int]] = {}
    for i, c in per_block.items():
        groups.setdefault(c.key(), []).append(i)
    main_key = max(groups, key=lambda k: (len(groups[k]), k[4] * (k[5] or 1)))  # most blocks, then most parameters
    kept = tuple(sorted(groups[main_key]))
    ffn = probed[main_key]
    assert isinstance(ffn, FoundFFN)
    for i, c in sorted(per_block.items()):
        if c.key() != main_key:
            float_parts.append(f"L{i} {_label(c.path)} (d_ff {c.d_ff}{', ' + str(c.experts) + ' experts' if c.experts else ''}): "
                               f"stays float, {_differs(c, ffn)}: the model's main FFN is {_label(ffn.path)} "
                               f"(d_ff {ffn.d_ff}{', ' + str(ffn.experts) + ' experts' if ffn.experts else ''}), and "
                               "ffnquant plans one FFN form per model")
    for i in range(len(blocks)):
        if i not in per_block:
            float_parts.append(f"L{i}: no FFN in this block")
    float_parts += _other_stacks(model, layers_path, blocks)
    return Discovery(model_type or str(getattr(config, "model_type", "")), type(model).__name__, layers_path,
                     len(blocks), ffn, kept, tuple(sorted(float_parts, key=lambda s: (len(s.split()[0]), s))),
                     model_classes=pretrained_classes(model), shares=_shared_blocks(blocks, kept, ffn, where, layers_path),
                     own_templates=_own_templates(blocks, kept, ffn))


def _other_stacks(model: nn.Module, layers_path: str, blocks: nn.ModuleList) -> list[str]:
    """Other lists of blocks of the kept blocks' class (HRM's H_module.layers beside its L_module.layers): their
    FFNs stay float, said, never skipped silently."""
    kind = type(blocks[0])
    return [f"{name} ({len(m)} blocks of {kind.__name__}): stay float, ffnquant quantizes the FFNs of one list of "
            f"blocks ({layers_path})" for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and m is not blocks and len(m) and type(m[0]) is kind]


def _own_templates(blocks: nn.ModuleList, kept: Sequence[int], ffn: FoundFFN) -> dict[int, Any]:
    """Each kept block's own middle (`hf.own.OwnMiddle`) where it holds other tensors than the kept FFN's template,
    built from that block's module as the template was from the first's: {block: template}. Zamba 2 with two
    shared blocks: each one's MLP keeps the adapters of its own calls alone (the others are identities)."""
    main = ffn.act_module
    if not isinstance(main, OwnMiddle):
        return {}
    keys = set(main.stored.state_dict())
    out = {}
    for i in kept:
        module = blocks[i].get_submodule(ffn.path) if ffn.path else blocks[i]
        mine = own_middle(module, ffn, ffn.roles, reads_input=main.reads_input, layer_idx=main.layer_idx)
        if mine is not None and set(mine.stored.state_dict()) != keys:
            out[i] = mine
    return out


def _shared_blocks(blocks: nn.ModuleList, kept: Sequence[int], ffn: FoundFFN, where: str,
                   layers_path: str) -> dict[int, int]:
    """The kept blocks whose FFN holds the very Parameters of an earlier block's (Zamba's shared transformer, tied
    and stored once): {block: the first block holding them}. Such an FFN is one FFN called by several blocks: it is
    quantized once, from every call's inputs, and the same quantized weights serve every call. Routed experts
    shared by several blocks are refused: ffnquant pools an FFN's calls, not an experts module's routing."""
    first: dict[int, int] = {}
    out: dict[int, int] = {}
    for i in kept:
        module = blocks[i].get_submodule(ffn.path) if ffn.path else blocks[i]
        held = [getattr(module.get_submodule(name), "weight", None) if ffn.install is not Install.EXPERTS
                else getattr(module, name, None) for name in ffn.roles]
        ids = {id(t) for t in held if isinstance(t, torch.Tensor)}
        sources = {first[t] for t in ids if t in first}
        if not sources:
            for t in ids:
                first[t] = i
            continue
        if ffn.install is Install.EXPERTS or len(sources) > 1 or len(ids) != sum(1 for t in ids if t in first):
            raise FFNQuantError(f"{where}: {layers_path}.{i}.{_label(ffn.path)} holds some of the weights of "
                                f"{layers_path}.{min(sources)}.{_label(ffn.path)}"
                                + (" (routed experts shared by several blocks)" if ffn.install is Install.EXPERTS
                                   else " but not all of them") +
                                ": ffnquant quantizes an FFN shared by several blocks only where they share all of it")
        out[i] = sources.pop()
    return out


def _differs(c: FoundFFN, main: FoundFFN) -> str:
    """What sets an FFN apart from the model's main one, in words (`FoundFFN.key`'s fields)."""
    if bool(c.experts) != bool(main.experts):
        return "a dense MLP, not routed experts" if main.experts else "routed experts, not a dense MLP"
    if (c.d_model, c.d_ff, c.experts) != (main.d_model, main.d_ff, main.experts):
        return "another shape"
    if dict(c.roles) != dict(main.roles) or c.install is not main.install:
        return "its matrices laid out otherwise"
    return "at another place in its block"


_CACHE: dict[str, Discovery] = {}


def discover_config(config: Mapping[str, Any], where: str) -> Discovery:
    """`discover` on the causal LM that transformers builds from config.json, on the meta device (cached per config)."""
    import json

    key = json.dumps(config, sort_keys=True, default=str)
    if key in _CACHE:
        return _CACHE[key]
    try:
        import transformers
    except Exception as exc:
        raise FFNQuantError(f"{where}: finding a model's FFNs needs transformers ({type(exc).__name__}: {exc}); "
                            "pip install '.[hf]' from the ffnquant checkout") from exc
    try:
        cfg = transformers.AutoConfig.for_model(**dict(config))
    except Exception as exc:
        raise FFNQuantError(f"{where}: transformers {transformers.__version__} does not know model_type "
                            f"{config.get('model_type')!r} ({type(exc).__name__}: {str(exc)[:160]})") from exc
    try:
        with torch.device("meta"):  # the skeleton only: no memory, no weights read
            model = causal_lm_from_config(transformers, cfg)
    except Exception as exc:
        raise FFNQuantError(f"{where}: transformers has no causal LM class for model_type {config.get('model_type')!r} "
                            f"({type(exc).__name__}: {str(exc)[:160]}); ffnquant finds the FFNs of causal LMs "
                            "(and of bert and t5 by their names)") from exc
    found = discover(model, str(config.get("model_type") or ""), where)
    # the shape of every tensor of the model transformers builds: what a checkpoint's tensors are checked against
    # (`validate.check_other_tensors`), whatever its attention's layout
    found = dataclasses.replace(found, shapes={name: tuple(t.shape) for name, t in model.state_dict().items()})
    # a forward that calls some block more than once (a looped depth): each call one of ffnquant's layers
    # (`hf.looped`); found last, as it makes the modules beside the blocks on the CPU
    found = dataclasses.replace(found, calls=call_order(model, found.layers_path))
    _CACHE[key] = found
    return found


def arch_for_config(config: Mapping[str, Any], where: str) -> Arch:
    """The model's Arch: found from the causal LM transformers builds from config.json (`hf.discover`), or, for
    the encoder and seq2seq models ffnquant knows by name (bert, t5) and when transformers is not installed,
    the hand-written entry of `hf.arch.ARCHITECTURES`."""
    import importlib.util

    key = str(config.get("model_type") or "").strip().lower()
    known = ARCHITECTURES.get(key)
    # BERT's class as a causal LM (BertLMHeadModel, is_decoder): found as any causal LM is, not as the encoder
    causal = bool(config.get("is_decoder")) and any(str(a).endswith(("LMHeadModel", "ForCausalLM"))
                                                     for a in config.get("architectures") or ())
    if known is not None and known.kind is not ModelKind.CAUSAL_LM and not causal:
        return known
    # sizes checked before transformers builds anything from them (it fails deep inside, or divides by zero)
    sizes = {"hidden_size": ("hidden_size", "n_embd", "d_model"), "num_hidden_layers": ("num_hidden_layers", "n_layer")}
    d = None
    for name, keys in sizes.items():
        key = next((k for k in keys if config.get(k) is not None), None)
        if key is not None:
            value = config[key]
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise FFNQuantError(f"{where}: config.json {key} must be a positive integer, got {value!r}")
            d = value if name == "hidden_size" else d
    if d is not None:
        check_attention_config(config, d, where)
    if importlib.util.find_spec("transformers") is None:
        if known is not None:
            return known
        raise FFNQuantError(f"{where}: finding the FFNs of model_type {config.get('model_type')!r} needs transformers "
                            f"(pip install '.[hf]'); without it ffnquant reads {', '.join(sorted(ARCHITECTURES))} by name")
    return discover_config(config, where).arch()
