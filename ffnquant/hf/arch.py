"""Hugging Face architectures as data: where each FFN's tensors live and what its activation is.

One `Arch` per supported `model_type`, kept in a registry keyed by that name. An Arch
knows (from config.json alone, never from the weights) the model width, the FFN width,
the number of layers per stack, the activation and whether the FFN is gated; and the
regular expression that finds a layer's FFN tensors in a checkpoint, with the role of
each tensor (gate, up, down, fused gate+up) and whether it is stored transposed
(GPT-2's Conv1D keeps [in, out]); and the norm whose output is the FFN's input (and nothing
else's), where an input scale of SmoothQuant/AWQ folds, or why no norm can take it
(`hf.fold`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ..errors import FFNQuantError, unknown_choice
from ..spec import Activation, Variant

__all__ = [
    "ModelKind",
    "Install",
    "NormGain",
    "Arch",
    "ARCHITECTURES",
    "HF_ACTIVATIONS",
    "get_arch",
    "hf_activation",
    "ffn_variant",
    "attention_shape",
]


class ModelKind(str, enum.Enum):
    """What the model's user measures end to end: perplexity, or the final hidden states."""

    CAUSAL_LM = "causal_lm"
    ENCODER = "encoder"
    SEQ2SEQ = "seq2seq"

    def __str__(self) -> str:
        return self.value


class Install(str, enum.Enum):
    """How a replacement FFN is put into the transformers model.

    MODULE: the MLP is one module whose forward is the whole FFN (replace its forward).
    SPLIT: the FFN is spread over a block's attributes (first linear, activation, second
    linear: BERT, OPT); the first linear becomes the whole FFN, the other two identities.
    EXPERTS: one expert of a mixture-of-experts block (Mixtral).
    """

    MODULE = "module"
    SPLIT = "split"
    EXPERTS = "experts"

    def __str__(self) -> str:
        return self.value


class NormGain(str, enum.Enum):
    """How a norm applies its learned per-channel gain g to the normalised n (and what folding a scale c does).

    GAIN: y = n * g (+ b), RMSNorm and LayerNorm: g <- g * c (b <- b * c).
    ONE_PLUS_GAIN: y = n * (1 + g), Gemma's RMSNorm (g stored zero-centred): g <- (1 + g) * c - 1.
    """

    GAIN = "gain"
    ONE_PLUS_GAIN = "one_plus_gain"

    def __str__(self) -> str:
        return self.value


# transformers' ACT2FN names we can represent exactly (checked numerically in the tests:
# gelu_new/fast/accurate/python_tanh are the tanh GELU to within 1e-12).
HF_ACTIVATIONS: Mapping[str, Activation] = {
    "relu": Activation.RELU,
    "gelu": Activation.GELU,
    "gelu_python": Activation.GELU,
    "gelu_new": Activation.GELU_TANH,
    "gelu_pytorch_tanh": Activation.GELU_TANH,
    "gelu_python_tanh": Activation.GELU_TANH,
    "gelu_fast": Activation.GELU_TANH,
    "gelu_accurate": Activation.GELU_TANH,
    "silu": Activation.SILU,
    "swish": Activation.SILU,
    "sigmoid": Activation.SIGMOID,
    "linear": Activation.IDENTITY,
    "relu2": Activation.RELU2,  # ReLUSquaredActivation
}

_GATED_VARIANT = {
    Activation.SILU: Variant.SWIGLU,
    Activation.GELU: Variant.GEGLU,
    Activation.GELU_TANH: Variant.GEGLU,  # with activation_override=gelu_tanh
    Activation.RELU: Variant.REGLU,
    Activation.SIGMOID: Variant.GLU,
    Activation.IDENTITY: Variant.BILINEAR,
    Activation.RELU2: Variant.REGLU,  # with activation_override=relu2
    Activation.OWN: Variant.REGLU,  # with activation_override=own: the model's module computes it
    Activation.OWN_GATE: Variant.REGLU,  # with activation_override=own_gate: fn(gate, up), the model's module
}
_DENSE_VARIANT = {
    Activation.RELU: Variant.RELU,
    Activation.GELU: Variant.GELU,
    Activation.GELU_TANH: Variant.GELU_TANH,
    Activation.SILU: Variant.SWISH,
    Activation.RELU2: Variant.RELU,  # with activation_override=relu2
    Activation.OWN: Variant.RELU,  # with activation_override=own
}


def hf_activation(name: object, where: str) -> Activation:
    """ffnquant's Activation for a transformers activation name; an unrepresentable one names itself."""
    key = str(name).strip().lower()
    if key not in HF_ACTIVATIONS:
        raise FFNQuantError(
            f"{where}: activation {name!r} cannot be represented by ffnquant's FFN variants; "
            f"supported: {', '.join(sorted(HF_ACTIVATIONS))}"
        )
    return HF_ACTIVATIONS[key]


def ffn_variant(activation: Activation, gated: bool, where: str) -> tuple[Variant, Activation | None]:
    """The variant (and activation override, if the variant's own differs) for an FFN."""
    table = _GATED_VARIANT if gated else _DENSE_VARIANT
    if activation not in table:
        kind = "gated" if gated else "dense"
        raise FFNQuantError(f"{where}: a {kind} FFN with activation {activation.value!r} has no ffnquant variant")
    variant = table[activation]
    return variant, activation  # FFNSpec normalises an override equal to the variant's own to None


# --- attention shapes (for block parameter counts) --------------------------------------

_HEADS_KEYS = ("num_attention_heads", "n_head", "num_heads", "n_heads", "encoder_attention_heads")
_KV_HEADS_KEYS = ("num_key_value_heads", "n_kv_heads", "num_kv_heads", "n_head_kv", "num_kv")
_HEAD_DIM_KEYS = ("head_dim", "d_kv", "attention_head_dim")


def _config_int(config: Mapping[str, Any], keys: tuple[str, ...]) -> int | None:
    for k in keys:
        v = config.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def attention_shape(config: Mapping[str, Any], d_model: int, ffn_bias: bool = False) -> dict[str, Any] | None:
    """One self-attention's shape and parameter count from config.json: heads, key/value heads (grouped-query
    and multi-query attention share K/V heads), head width, and the q/k/v/o projections' weights (+ biases
    where config.json's attention_bias says so, else where the FFN has them). None when config.json names
    no head count (the attention cannot be counted from it)."""
    n_heads = _config_int(config, _HEADS_KEYS)
    if n_heads is None:
        return None
    n_kv = _config_int(config, _KV_HEADS_KEYS)
    if n_kv is None:
        n_kv = 1 if config.get("multi_query") is True else n_heads
    head_dim = _config_int(config, _HEAD_DIM_KEYS)
    if head_dim is None:
        if d_model % n_heads:
            return None
        head_dim = d_model // n_heads
    q = n_heads * head_dim
    kv = n_kv * head_dim
    bias = config.get("attention_bias")
    bias = ffn_bias if not isinstance(bias, bool) else bias
    weights = d_model * q + 2 * d_model * kv + q * d_model
    biases = (q + 2 * kv + d_model) if bias else 0
    return {"d_model": d_model, "n_heads": n_heads, "n_kv_heads": n_kv, "head_dim": head_dim, "bias": bool(bias),
            "params": weights + biases}


# --- per-architecture config readers --------------------------------------------------


def _get(config: Mapping[str, Any], keys: tuple[str, ...], where: str, default: Any = None) -> Any:
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    if default is not None:
        return default
    raise FFNQuantError(f"{where}: config.json has none of {', '.join(keys)}")


def _positive(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise FFNQuantError(f"{where}: config.json {name} must be a positive integer, got {value!r}")
    return value


def _t5_activation(config: Mapping[str, Any], where: str) -> tuple[str, bool]:
    # transformers' T5Config: "gated-gelu" means gelu_new; "{gated-}ACT" otherwise.
    if config.get("dense_act_fn") is not None and config.get("is_gated_act") is not None:
        return str(config["dense_act_fn"]), bool(config["is_gated_act"])
    proj = str(config.get("feed_forward_proj", "relu"))
    parts = proj.split("-")
    if len(parts) > 2 or (len(parts) == 2 and parts[0] != "gated"):
        raise FFNQuantError(f"{where}: config.json feed_forward_proj {proj!r} is not 'ACT' or 'gated-ACT'")
    act = "gelu_new" if proj == "gated-gelu" else parts[-1]
    return act, parts[0] == "gated" and len(parts) == 2


def _gemma_activation(config: Mapping[str, Any], where: str) -> tuple[str, bool]:
    # Gemma checkpoints carry hidden_act "gelu" for history and the real one in hidden_activation.
    return str(config.get("hidden_activation") or config.get("hidden_act") or "gelu_pytorch_tanh"), True


def _always_folds(config: Mapping[str, Any]) -> str:
    return ""


def _opt_fold_refusal(config: Mapping[str, Any]) -> str:
    # OPTDecoderLayer: pre-LN (do_layer_norm_before, the default) normalises with final_layer_norm right
    # before fc1; post-LN (opt-350m) applies final_layer_norm after the residual add instead.
    if config.get("do_layer_norm_before", True) is False:
        return ("post-LN (do_layer_norm_before false, as opt-350m): the FFN's input is self_attn_layer_norm's output, "
                "which is also the residual added to the FFN's output, so scaling that norm would change the residual")
    if config.get("layer_norm_elementwise_affine", True) is False:
        return "its LayerNorms have no gain (layer_norm_elementwise_affine false) to fold a scale into"
    return ""


_BERT_NO_FOLD = ("post-LN: the FFN's input (the attention block's output LayerNorm) is also the residual added to the "
                 "FFN's output (BertOutput: LayerNorm(dense(h) + input)), so folding a scale into that norm would "
                 "change the residual")
_MIXTRAL_NO_FOLD = ("post_attention_layernorm's output feeds the router as well as every expert, and each expert is "
                    "smoothed with its own input scale: one norm gain cannot carry several scales, and scaling it "
                    "would change the routing")


@dataclass(frozen=True)
class Arch:
    """One Hugging Face architecture: config readers, checkpoint tensor layout, install style."""

    name: str
    kind: ModelKind
    d_model_keys: tuple[str, ...]
    d_ff_keys: tuple[str, ...]
    # (config, where) -> (transformers activation name, gated)
    activation: Callable[[Mapping[str, Any], str], tuple[str, bool]]
    # regex (fullmatch on a tensor name) with groups prefix, layer, role, kind; optional stack, expert
    tensor_pattern: str
    # checkpoint role -> ffnquant weight ("w_up", "w_gate", "w_down", or "w_gate+w_up" for fused halves)
    roles: Mapping[str, str]
    # roles a dense / gated layer needs
    dense_roles: tuple[str, ...] = ()
    gated_roles: tuple[str, ...] = ()
    transposed: bool = False  # Conv1D stores weights [in, out]
    stacks: tuple[tuple[str, tuple[str, ...]], ...] = (("", ("num_hidden_layers",)),)
    d_ff_per_d_model: int | None = None  # GPT-2: n_inner defaults to 4 * n_embd
    n_experts_key: str | None = None
    # a second pattern for fused 3-D expert tensors ([experts, out, in]); roles as above
    fused_experts_pattern: str | None = None
    install: Install = Install.MODULE
    # module names (regex, fullmatch) of the FFN in a loaded transformers model; {layer} and
    # {stack} are filled in. For SPLIT, also the attribute names (first linear, act, second).
    module_pattern: str = ""
    split_attrs: tuple[str, str, str] = ("", "", "")
    # the FFN module's forward takes the block's residual as its second argument and adds it to its output (BLOOM,
    # MPT; found by `hf.discover`): a replacement adds it too, and checks compare the output less the residual
    residual_arg: bool = False
    # the norm whose output is the FFN's input and ONLY the FFN's input (regex, fullmatch, on module names of
    # the loaded model; {layer}, {stack}, {ffn} (the FFN module's name) and {ffn_parent} (its parent's) are
    # filled in, the names regex-escaped): where an input scale folds (hf.fold). How it applies its gain:
    norm_pattern: str = ""
    norm_gain: NormGain = NormGain.GAIN
    # (config) -> why folding an input scale into that norm would not be exact ('' when it is)
    norm_fold_refusal: Callable[[Mapping[str, Any]], str] = _always_folds
    # found from the model itself (`hf.discover`): sizes as found ("d_model", "d_ff", "n_layers", "n_experts",
    # "blocks": the blocks whose FFN is quantized), what stays float and why; the norm before each FFN is then
    # found from the graph when the model runs (`hf.fold`), not from norm_pattern
    fixed: Mapping[str, Any] | None = None
    discovered: bool = False
    float_parts: tuple[str, ...] = ()
    norm_from_graph: bool = False
    # the roles of fused 3-D expert tensors (fused_experts_pattern)
    fused_expert_roles: tuple[str, ...] = ("gate_up_proj", "down_proj")
    linear_class: str = "Linear"  # the class of the FFN's matrix modules in the loaded model
    # `Activation.OWN`/`OWN_GATE` (found by `hf.discover`): the model's own activation module, built on the meta device,
    # and its attribute in the FFN's module; each layer's copy is filled from the checkpoint's
    # `<ffn prefix>.<activation_attr>.<tensor>` (`hf.checkpoint`)
    activation_template: Any = None
    activation_attr: str = ""
    # blocks whose own module's template holds other tensors than `activation_template` (Zamba 2's shared MLPs:
    # each of its blocks keeps the adapters of its own calls alone): {block: template}
    activation_templates: Mapping[int, Any] = field(default_factory=dict, compare=False)
    # a fused gate+up matrix whose gate and up rows alternate (gpt-oss' experts, read so by their own gate function)
    interleaved: bool = False
    # fused experts' tensors holding each expert's matrix [in, out] (all: `transposed`), and whether they are flat
    # [experts x rows, cols] (DBRX's); `hf.routed.expert_matrices`
    input_major: tuple[str, ...] = ()
    flat_experts: bool = False
    # experts' matrices in child modules of a module that routes its tokens itself (JetMoE's; `hf.routed.call_modules`)
    matrix_experts: bool = False
    experts_class: str = ""  # the class of a fused experts module (Llama4TextExperts: its loader's per-expert split)

    def d_model(self, config: Mapping[str, Any], where: str) -> int:
        if self.fixed is not None:
            return self.fixed["d_model"]
        return _positive(_get(config, self.d_model_keys, where), self.d_model_keys[0], where)

    def d_ff(self, config: Mapping[str, Any], where: str) -> int:
        if self.fixed is not None:
            return self.fixed["d_ff"]
        if self.d_ff_per_d_model is not None:
            value = _get(config, self.d_ff_keys, where, default=self.d_ff_per_d_model * self.d_model(config, where))
        else:
            value = _get(config, self.d_ff_keys, where)
        return _positive(value, self.d_ff_keys[0], where)

    def n_layers(self, config: Mapping[str, Any], where: str) -> dict[str, int]:
        """Layers per stack ('' for single-stack models); a later key falls back to the first stack's."""
        if self.fixed is not None:
            return {"": self.fixed["n_layers"]}
        out: dict[str, int] = {}
        for stack, keys in self.stacks:
            value = None
            for k in keys:
                if config.get(k) is not None:
                    value = config[k]
                    break
            if value is None and out:
                value = next(iter(out.values()))  # T5: num_decoder_layers defaults to num_layers
            if value is None:
                raise FFNQuantError(f"{where}: config.json has none of {', '.join(keys)}")
            out[stack] = _positive(value, keys[0], where) if value else 0
        return out

    def n_experts(self, config: Mapping[str, Any], where: str) -> int | None:
        if self.fixed is not None:
            return self.fixed["n_experts"]
        if self.n_experts_key is None:
            return None
        return _positive(_get(config, (self.n_experts_key,), where), self.n_experts_key, where)

    def needed_roles(self, gated: bool) -> tuple[str, ...]:
        return self.gated_roles if gated else self.dense_roles

    def fold_refusal(self, config: Mapping[str, Any]) -> str | None:
        """Why an FFN input scale cannot fold exactly into the norm before the FFN for this config; None if it can."""
        if self.norm_from_graph:
            return None  # decided per layer from the loaded model's graph (`hf.fold`)
        if not self.norm_pattern:
            return "no norm whose output is only the FFN's input is known for this architecture"
        return self.norm_fold_refusal(config) or None


_P = r"(?P<prefix>(?:.+\.)?"  # optional leading module path (model., transformer., bert., ...)
_LLAMA_ROLES = {"gate_proj": "w_gate", "up_proj": "w_up", "down_proj": "w_down"}


def _llama_like(name: str) -> Arch:
    return Arch(
        name=name,
        kind=ModelKind.CAUSAL_LM,
        d_model_keys=("hidden_size",),
        d_ff_keys=("intermediate_size",),
        activation=lambda c, w: (str(c.get("hidden_act") or "silu"), True),
        tensor_pattern=_P + r"layers\.(?P<layer>\d+)\.mlp)\.(?P<role>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)",
        roles=_LLAMA_ROLES,
        gated_roles=("gate_proj", "up_proj", "down_proj"),
        module_pattern=r"(?:.+\.)?layers\.{layer}\.mlp",
        # LlamaDecoderLayer (MistralDecoderLayer, Qwen2DecoderLayer): mlp(post_attention_layernorm(h)) + h
        norm_pattern=r"{ffn_parent}\.post_attention_layernorm",
    )


ARCHITECTURES: Mapping[str, Arch] = {
    "llama": _llama_like("llama"),
    "mistral": _llama_like("mistral"),
    "qwen2": _llama_like("qwen2"),
    "gemma": Arch(
        name="gemma",
        kind=ModelKind.CAUSAL_LM,
        d_model_keys=("hidden_size",),
        d_ff_keys=("intermediate_size",),
        activation=_gemma_activation,
        tensor_pattern=_P + r"layers\.(?P<layer>\d+)\.mlp)\.(?P<role>gate_proj|up_proj|down_proj)\.(?P<kind>weight|bias)",
        roles=_LLAMA_ROLES,
        gated_roles=("gate_proj", "up_proj", "down_proj"),
        module_pattern=r"(?:.+\.)?layers\.{layer}\.mlp",
        # GemmaDecoderLayer as Llama's; GemmaRMSNorm computes n * (1 + weight)
        norm_pattern=r"{ffn_parent}\.post_attention_layernorm",
        norm_gain=NormGain.ONE_PLUS_GAIN,
    ),
    "phi3": Arch(
        name="phi3",
        kind=ModelKind.CAUSAL_LM,
        d_model_keys=("hidden_size",),
        d_ff_keys=("intermediate_size",),
        activation=lambda c, w: (str(c.get("hidden_act") or "silu"), True),
        tensor_pattern=_P + r"layers\.(?P<layer>\d+)\.mlp)\.(?P<role>gate_up_proj|down_proj)\.(?P<kind>weight|bias)",
        roles={"gate_up_proj": "w_gate+w_up", "down_proj": "w_down"},  # Phi3MLP: chunk(2) gives gate, up
        gated_roles=("gate_up_proj", "down_proj"),
        module_pattern=r"(?:.+\.)?layers\.{layer}\.mlp",
        # Phi3DecoderLayer: mlp(post_attention_layernorm(h)), dropout, + h
        norm_pattern=r"{ffn_parent}\.post_attention_layernorm",
    ),
    "mixtral": Arch(
        name="mixtral",
        kind=ModelKind.CAUSAL_LM,
        d_model_keys=("hidden_size",),
        d_ff_keys=("intermediate_size",),
        activation=lambda c, w: (str(c.get("hidden_act") or "silu"), True),
        tensor_pattern=_P + r"layers\.(?P<layer>\d+)\.block_sparse_moe\.experts\.(?P<expert>\d+))\.(?P<role>w1|w2|w3)\.(?P<kind>weight|bias)",
        roles={"w1": "w_gate", "w3": "w_up", "w2": "w_down"},
        gated_roles=("w1", "w3", "w2"),
        n_experts_key="num_local_experts",
        # transformers >= 5 stores experts fused: gate_up_proj [E, 2 f, d] (gate first), down_proj [E, d, f]
        fused_experts_pattern=_P + r"layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe)\.experts)\.(?P<role>gate_up_proj|down_proj)",
        install=Install.EXPERTS,
        module_pattern=r"(?:.+\.)?layers\.{layer}\.(?:block_sparse_moe|mlp)\.experts",
        norm_pattern=r"(?:.+\.)?layers\.{layer}\.post_attention_layernorm",
        norm_fold_refusal=lambda c: _MIXTRAL_NO_FOLD,
    ),
    "t5": Arch(
        name="t5",
        kind=ModelKind.SEQ2SEQ,
        d_model_keys=("d_model",),
        d_ff_keys=("d_ff",),
        activation=_t5_activation,
        tensor_pattern=_P + r"(?P<stack>encoder|decoder)\.block\.(?P<layer>\d+)\.layer\.\d+\.DenseReluDense)\.(?P<role>wi|wi_0|wi_1|wo)\.(?P<kind>weight|bias)",
        roles={"wi": "w_up", "wi_0": "w_gate", "wi_1": "w_up", "wo": "w_down"},
        dense_roles=("wi", "wo"),
        gated_roles=("wi_0", "wi_1", "wo"),
        stacks=(("encoder", ("num_layers",)), ("decoder", ("num_decoder_layers", "num_layers"))),
        module_pattern=r"(?:.+\.)?{stack}\.block\.{layer}\.layer\.\d+\.DenseReluDense",
        # T5LayerFF: DenseReluDense(layer_norm(h)) + h, the T5LayerNorm a sibling of DenseReluDense
        norm_pattern=r"{ffn_parent}\.layer_norm",
    ),
    "gpt2": Arch(
        name="gpt2",
        kind=ModelKind.CAUSAL_LM,
        d_model_keys=("n_embd", "hidden_size"),
        d_ff_keys=("n_inner",),
        d_ff_per_d_model=4,
        activation=lambda c, w: (str(c.get("activation_function") or "gelu_new"), False),
        tensor_pattern=_P + r"h\.(?P<layer>\d+)\.mlp)\.(?P<role>c_fc|c_proj)\.(?P<kind>weight|bias)",
        roles={"c_fc": "w_up", "c_proj": "w_down"},
        dense_roles=("c_fc", "c_proj"),
        transposed=True,
        stacks=(("", ("n_layer", "num_hidden_layers")),),
        module_pattern=r"(?:.+\.)?h\.{layer}\.mlp",
        # GPT2Block: mlp(ln_2(h)) + h
        norm_pattern=r"{ffn_parent}\.ln_2",
    ),
    "bert": Arch(
        name="bert",
        kind=ModelKind.ENCODER,
        d_model_keys=("hidden_size",),
        d_ff_keys=("intermediate_size",),
        activation=lambda c, w: (str(c.get("hidden_act") or "gelu"), False),
        tensor_pattern=_P + r"encoder\.layer\.(?P<layer>\d+))\.(?P<role>intermediate\.dense|output\.dense)\.(?P<kind>weight|bias)",
        roles={"intermediate.dense": "w_up", "output.dense": "w_down"},
        dense_roles=("intermediate.dense", "output.dense"),
        install=Install.SPLIT,
        module_pattern=r"(?:.+\.)?encoder\.layer\.{layer}",
        split_attrs=("intermediate.dense", "intermediate.intermediate_act_fn", "output.dense"),
        norm_pattern=r"{ffn}\.attention\.output\.LayerNorm",
        norm_fold_refusal=lambda c: _BERT_NO_FOLD,
    ),
    "opt": Arch(
        name="opt",
        kind=ModelKind.CAUSAL_LM,
        d_model_keys=("hidden_size",),
        d_ff_keys=("ffn_dim",),
        activation=lambda c, w: (str(c.get("activation_function") or "relu"), False),
        tensor_pattern=_P + r"decoder\.layers\.(?P<layer>\d+))\.(?P<role>fc1|fc2)\.(?P<kind>weight|bias)",
        roles={"fc1": "w_up", "fc2": "w_down"},
        dense_roles=("fc1", "fc2"),
        install=Install.SPLIT,
        module_pattern=r"(?:.+\.)?decoder\.layers\.{layer}",
        split_attrs=("fc1", "activation_fn", "fc2"),
        # OPTDecoderLayer, pre-LN: fc2(act(fc1(final_layer_norm(h)))) + h (the FFN module is the whole layer)
        norm_pattern=r"{ffn}\.final_layer_norm",
        norm_fold_refusal=_opt_fold_refusal,
    ),
}


def get_arch(model_type: object, where: str) -> Arch:
    """The Arch for a config.json `model_type`; unknown types list the supported ones."""
    key = str(model_type).strip().lower() if model_type is not None else None
    if key not in ARCHITECTURES:
        err = unknown_choice("model_type", model_type, sorted(ARCHITECTURES))
        raise FFNQuantError(f"{where}: unsupported architecture: {err}")
    return ARCHITECTURES[key]
