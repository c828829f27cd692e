"""Tiny Hugging Face model folders built locally (no downloads), shared by the tests that need real checkpoints.

`write_llama_like` writes a checkpoint by hand (safetensors only, no transformers needed);
`configs` / `tokenizer` / `save_tiny` build transformers models from config classes with random
weights and save them with their own word-level tokenizer, as `save_pretrained` does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

D, F_, VOCAB = 32, 64, 96


def write_llama_like(folder: Path, d: int = D, f: int = F_, layers: int = 2, model_type: str = "llama") -> dict:
    """A checkpoint written by hand (safetensors only): enough for the loader, no transformers needed."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    state = {}
    for i in range(layers):
        p = f"model.layers.{i}.mlp"
        state[f"{p}.gate_proj.weight"] = torch.randn(f, d, generator=gen)
        state[f"{p}.up_proj.weight"] = torch.randn(f, d, generator=gen)
        state[f"{p}.down_proj.weight"] = torch.randn(d, f, generator=gen)
        state[f"model.layers.{i}.input_layernorm.weight"] = torch.ones(d)
    save_file(state, str(folder / "model.safetensors"))
    config = {"model_type": model_type, "hidden_size": d, "intermediate_size": f, "num_hidden_layers": layers,
              "hidden_act": "silu"}
    (folder / "config.json").write_text(json.dumps(config))
    return state


def configs(T):
    common = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=F_, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    t5 = dict(vocab_size=VOCAB, d_model=D, d_ff=F_, num_layers=2, num_heads=4, d_kv=8, decoder_start_token_id=0,
              pad_token_id=0, eos_token_id=1)
    return {
        "llama": (T.LlamaConfig(**common), "swiglu", "silu"),
        "mistral": (T.MistralConfig(**common), "swiglu", "silu"),
        "qwen2": (T.Qwen2Config(**common), "swiglu", "silu"),
        "gemma": (T.GemmaConfig(**common, head_dim=8), "geglu", "gelu_tanh"),
        "phi3": (T.Phi3Config(**common), "swiglu", "silu"),
        "mixtral": (T.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2), "swiglu", "silu"),
        "t5": (T.T5Config(**t5), "relu", "relu"),
        "t5-gated-gelu": (T.T5Config(**t5, feed_forward_proj="gated-gelu"), "geglu", "gelu_tanh"),
        "gpt2": (T.GPT2Config(vocab_size=VOCAB, n_embd=D, n_layer=2, n_head=4, n_positions=64, n_inner=F_,
                              bos_token_id=1, eos_token_id=2), "gelu_tanh", "gelu_tanh"),
        "bert": (T.BertConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=F_, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=64), "gelu", "gelu"),
        "opt": (T.OPTConfig(vocab_size=VOCAB, hidden_size=D, ffn_dim=F_, num_hidden_layers=2, num_attention_heads=4,
                            max_position_embeddings=64, word_embed_proj_dim=D, bos_token_id=1, eos_token_id=2,
                            pad_token_id=0), "relu", "relu"),
    }


def tokenizer(T):
    """A word-level tokenizer trained locally on the shipped sample texts (no downloads)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from ffnquant.hf.capture import default_text_path

    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(vocab_size=VOCAB, special_tokens=["<pad>", "<s>", "</s>", "<unk>"])
    tok.train([str(default_text_path("calibration")), str(default_text_path("evaluation"))], trainer)
    return T.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                     bos_token="<s>", eos_token="</s>")


def save_tiny(T, name: str, folder: Path, tok=None) -> tuple[Path, str, str]:
    """Build the architecture `name` of `configs` with seeded random weights and save it (safetensors) with a
    tokenizer into `folder`; returns (folder, expected variant, expected activation)."""
    config, variant, act = configs(T)[name]
    torch.manual_seed(0)
    if config.model_type == "t5":
        model = T.T5ForConditionalGeneration(config)
    elif config.model_type == "bert":
        model = T.BertModel(config)
    else:
        model = T.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)
    (tok if tok is not None else tokenizer(T)).save_pretrained(folder)
    return folder, variant, act


def tiny_folders(tmp_path_factory, names=None) -> dict[str, tuple[Path, str, str]]:
    """`save_tiny` for each of `names` (default every architecture of `configs`) in a fresh temporary folder;
    skips the calling test with the reason when transformers is not installed."""
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    T.logging.set_verbosity_error()
    root = tmp_path_factory.mktemp("hf")
    tok = tokenizer(T)
    return {name: save_tiny(T, name, root / name, tok) for name in (names or configs(T))}


# The causal-LM model types the architecture matrix runs (tests/test_hf_matrix.py): the families people quantize
# today, dense and mixture-of-experts, gated and not, Linear and Conv1D, parallel and sequential blocks. Every other
# type runs in the benchmark (`benchmarks/architecture_matrix.py --types all`); Falcon-H1 left CI for its time (its
# config's Infinity is read in tests/test_hf.py).
CAUSAL_TYPES = ("llama", "mistral", "qwen2", "gemma", "phi3", "gpt2", "opt", "mixtral", "qwen3", "gemma2", "gemma3_text",
                "olmo2", "granite", "cohere", "stablelm", "starcoder2", "gpt_neox", "falcon", "phi", "smollm3", "glm",
                "exaone4", "qwen2_moe", "qwen3_moe", "deepseek_v3", "nemotron", "arcee", "bloom", "mpt",
                "qwen3_next", "qwen3_5_text", "deepseek_v2", "granitemoe", "roberta", "apertus", "bitnet",
                "minimax_m3_vl_text", "dbrx", "jetmoe", "gemma3n_text", "xlnet", "xlm", "gemma4_text", "zamba",
                "xmod")

# Tiny widths under every name a config class may use for them; each config takes the ones it has.
# max_position_embeddings 136: RoBERTa's positions start past its padding id, so 128-token windows take 130
_TINY = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=F_, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=136, head_dim=8, n_embd=D, n_layer=2, n_head=4, n_inner=F_,
             n_positions=128, ffn_dim=F_, ffn_hidden_size=F_, moe_intermediate_size=F_, shared_expert_intermediate_size=F_,
             num_experts=4, num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
             n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
             n_group=1, topk_group=1, bos_token_id=1, eos_token_id=2, pad_token_id=0, word_embed_proj_dim=D,
             sliding_window=16, num_kv_heads=2)


# what a type's config needs beside `_TINY` to build at that size (its own validators); a dict under a sub-config's
# name (text_config, vision_config, ...) is laid over that sub-config's tiny values
_PER_LAYER_INPUT = {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 8}  # not 262k x 256
_GEMMA3N_TEXT = {"num_kv_shared_layers": 0, "layer_types": ["sliding_attention", "full_attention"],
                 "activation_sparsity_pattern": [0.0, 0.0]} | _PER_LAYER_INPUT
_INKLING2_TEXT = {"unpadded_vocab_size": VOCAB, "swa_num_attention_heads": 4, "swa_num_key_value_heads": 2,
                  "swa_head_dim": 8, "layer_types": ["hybrid_sliding", "hybrid"]}
_MEDIA_TOKENS = {"image_token_id": 1, "video_token_id": 1, "audio_token_id": 1}
_DOTS3_TEXT = {"index_n_heads": 4, "index_head_dim": 16, "shared_experts_intermediate_size": F_}  # indexer, shared
_TYPE_TINY = {
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 16, "attn_layer_indices": [1]},
    "granitemoehybrid": {"mamba_n_heads": 4},
    "nemotron_h": {"mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 2},
    "codegen": {"rotary_dim": 8}, "gptj": {"rotary_dim": 8},
    # Dory's attention masks a sequence longer than its sliding window wrongly in transformers 5.25 (its output
    # fails on 100 tokens at a window of 16 or 64, runs at 256): a window as long as a real checkpoint's
    "dory": {"sliding_window": 256},
    "gemma3n_text": _GEMMA3N_TEXT, "gemma3n": {"text_config": _GEMMA3N_TEXT},
    # RoPE per layer type, M-RoPE's three sections over head_dim 8's four frequencies
    "cohere_compass_text": {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0,
                                                                  "mrope_section": [2, 1, 1]}}},
    # DbrxAttention reads attn_config.rope_theta: a real checkpoint's attn_config holds it (the class has no field);
    # its experts' width is ffn_config.hidden_size, the model's in a real checkpoint
    # d_model by its own name: given as hidden_size (an alias), DbrxConfig copies its default 2048 into the experts'
    # ffn_config.hidden_size before the alias is applied, and the model's experts do not match its width
    # the byte-level encoder's and decoder's projections to and from the global transformer as wide as it is
    "blt": {"encoder_config": {"hidden_size_global": D}, "decoder_config": {"hidden_size_global": D}},
    # (clip_qkv as DBRX's checkpoints set it: transformers' attention clamps with both bounds None otherwise, and fails)
    "dbrx": {"d_model": D, "attn_config": {"kv_n_heads": 2, "rope_theta": 500000.0, "clip_qkv": 8.0},
             "ffn_config": {"hidden_size": D, "ffn_hidden_size": F_, "moe_num_experts": 4, "moe_top_k": 2}},
    # the vision tower dense (no per-layer experts), the adapters as wide as the towers and the text
    "dots3_note": {"vision_config": {"mlp_layer_types": ["dense", "dense"], "adapter_in_dim": D, "adapter_out_dim": D},
                   "audio_config": {"adapter_input_size": D, "adapter_out_dim": D},
                   "text_config": _DOTS3_TEXT | {"num_key_value_heads": 4}},  # latent attention: kv heads = heads
    "dots3_note_text": _DOTS3_TEXT,
    # a draft model reading every layer's keys and values from its target: all its layers share (0: derived afresh)
    # (its defaults fail its own validator: a text model without per-layer inputs)
    "gemma4_assistant": {"backbone_hidden_size": D, "text_config": {"num_kv_shared_layers": 0,
                                                                   "hidden_size_per_layer_input": 0,
                                                                   "vocab_size_per_layer_input": 0}},
    "gemma4_unified_assistant": {"backbone_hidden_size": D, "text_config": {"num_kv_shared_layers": 0}},
    # the image/video/audio placeholders inside the tiny vocabulary (given inputs_embeds, the forward looks their
    # 258k ids up in its 96-row embedding): <s> (1), which the word-level tokenizer never puts in a text
    "gemma4": {"text_config": _PER_LAYER_INPUT} | _MEDIA_TOKENS,
    # its per-layer inputs narrower than its MLP, as in its checkpoints (256 beside 9216)
    "gemma4_text": _PER_LAYER_INPUT,
    "gemma4_unified": _MEDIA_TOKENS,
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "inkling2_text": _INKLING2_TEXT,
    "inkling2_loop_text": _INKLING2_TEXT | {"n_layers_per_attn_res_block": 1, "loop_layer_index_start": 1,
                                            "loop_layer_index_end": 2, "loop_num_passes": 2, "loop_gate_rank": 8},
    # NVFP4 keys need head_dim % 16; an indexed layer after a sliding one; experts in layer 1
    "kolibri1_1": {"head_dim": 16, "index_num_heads": 2, "layer_types": ["sliding_attention", "indexed_attention"],
                   "mlp_only_layers": [0], "mlp_only_intermediate_size": F_},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    "mamba2": {"num_heads": 8, "n_groups": 2, "state_size": 16},
    # its MLP is ffn_dim // 2 wide: at the harness's 64 as wide as the model, which is no FFN shape
    "moshi": {"ffn_dim": 2 * F_},
    "plbart": {"decoder_attention_heads": 4, "decoder_ffn_dim": F_, "encoder_ffn_dim": F_, "decoder_layers": 2},
    "whisper": {"decoder_attention_heads": 4, "decoder_ffn_dim": F_, "encoder_ffn_dim": F_, "decoder_layers": 2,
                "decoder_start_token_id": 1, "begin_suppress_tokens": None},
    # an indexed (QSA) layer after a GatedDeltaNet one, as the real model alternates them
    "qwen4_exp_text": {"layer_types": ["linear_attention", "indexed_attention"], "indexer_n_heads": 4,
                       "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 16, "indexer_compress_ratio": 4},
    # its MLP is intermediate_size // 2 wide: at the harness's 64 as wide as the model, which is no FFN shape
    "recurrent_gemma": {"block_types": ["recurrent", "attention"], "intermediate_size": 2 * F_},
    "reformer": {"attn_layers": ["local", "lsh"], "axial_pos_embds_dim": [16, 16], "attention_head_size": 8,
                 "feed_forward_size": F_},
    # d_head: the alias hidden_size sets d_model only after __post_init__ derived d_head from the default width
    "xlnet": {"d_head": 8, "d_inner": F_},
    # head_dim (the alias of attention_head_dim) as wide as each derives it: 2 * hidden_size / heads
    # (Zamba ties every hybrid layer's shared transformer to the first's: two of them, each with its Mamba mixer;
    # Zamba 2's as its checkpoints have it, one shared block called twice, each call with its own adapters)
    "zamba": {"layers_block_type": ["hybrid", "hybrid"], "head_dim": 16},
    "zamba2": {"layers_block_type": ["hybrid", "hybrid"], "head_dim": 16},
    "zaya": {"num_experts_per_tok": 1},
    # X-MOD runs only with a language for its adapters: set as a user sets it (transformers reads config.json's)
    "xmod": {"default_language": "en_XX"},
}


def causal_config(T, model_type: str):
    """A tiny config of any causal-LM model type of the installed transformers (the widths of `_TINY` it has)."""
    extra = _TYPE_TINY.get(model_type, {})
    try:
        base = T.AutoConfig.for_model(model_type)
    except Exception:  # noqa: BLE001 - defaults its own validator refuses (Gemma 4 Assistant's): with the type's extras
        base = T.AutoConfig.for_model(model_type, **extra)
    known = set(base.to_dict())

    def has(k: str) -> bool:
        try:
            return hasattr(base, k)
        except Exception:  # noqa: BLE001 - a per-layer attribute of a heterogeneous config
            return k in known  # (Gemma 4's head_dim, Dots 3's kv_lora_rank)

    def settable(k: str) -> bool:
        return has(k) and not isinstance(getattr(type(base), k, None), property)

    kwargs = {k: v for k, v in _TINY.items() if settable(k) or k == "ffn_hidden_size" and model_type == "falcon"}
    kwargs.update(extra)
    for name, sub in base.to_dict().items():  # a multimodal model's text, vision and audio configs: tiny too
        if isinstance(sub, dict) and "model_type" in sub and (name not in kwargs or isinstance(extra.get(name), dict)):
            # its per-layer values (layer types, per-layer overrides, lists of one entry per layer) derived afresh
            n = sub.get("num_hidden_layers")
            per_layer = {k for k, v in sub.items() if k in ("layer_types", "per_layer_config")
                         or isinstance(v, list) and isinstance(n, int) and n > 2 and len(v) == n}
            kwargs[name] = {k: v for k, v in sub.items() if k not in per_layer} | \
                {k: v for k, v in _TINY.items() if k in sub and k != "vocab_size" or k == "vocab_size" and k in sub} | \
                extra.get(name, {})
    if has("kv_lora_rank"):  # multi-head latent attention (DeepSeek-V2/V3 and kin): as many key/value
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # heads as query heads, as real ones have
    config = T.AutoConfig.for_model(model_type, **kwargs)
    if not getattr(config, "is_encoder_decoder", False):  # an encoder class used as a causal LM (BERT's) masks as one
        config.is_decoder = True
    types = getattr(config, "layer_types", None)
    attr = type(config).attribute_map.get("layer_types", "layer_types")  # Bamba's, Zamba's: layers_block_type
    settable_types = not isinstance(getattr(type(config), attr, None), property) and \
        not {"layer_types", attr} & set(extra)  # a type's own layer types (`_TYPE_TINY`) are kept
    if settable_types and isinstance(types, list) and "linear_attention" in types and "full_attention" not in types:
        # a hybrid (Qwen3-Next, Qwen3.5) cut to two layers keeps one of full attention, as a real one has every few
        # layers: with linear attention alone transformers cannot size a KV cache's mask, nor generate
        config.layer_types = ["linear_attention", "full_attention"]
    return config


# draft models and the type of the model each drafts for (`--target-model`): a tiny model of that type, of the same
# widths, is their target
DRAFT_TARGETS = {"gemma4_assistant": "gemma4_text", "gemma4_unified_assistant": "gemma4_unified"}


def save_causal_tiny(T, model_type: str, folder: Path, tok=None, **overrides) -> Path:
    """A tiny random-weight causal LM of `model_type` saved with save_pretrained (safetensors) and a tokenizer;
    `overrides`: config values set beside `_TINY`'s."""
    torch.manual_seed(0)
    config = causal_config(T, model_type)
    for key, value in overrides.items():
        setattr(config, key, value)
    model = T.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder, safe_serialization=True)
    (tok if tok is not None else tokenizer(T)).save_pretrained(folder)
    return folder


def tiny_or_skip(model_type: str, folder: Path) -> Path:
    """`save_causal_tiny` of `model_type` with the word-level tokenizer, transformers' logs at errors only; the
    test skipped where transformers is missing or cannot build the type."""
    T = pytest.importorskip("transformers", reason="transformers not installed (pip install '.[hf]')")
    T.logging.set_verbosity_error()
    try:
        return save_causal_tiny(T, model_type, folder, tokenizer(T))
    except Exception as exc:  # noqa: BLE001 - a transformers without the type
        pytest.skip(f"{model_type} not buildable here: {exc}")


def write_vllm_llama(folder, layers: int = 4):
    """A tiny bf16 Llama vLLM's CPU kernels take (hidden 128, head_dim 64), with the word-level tokenizer."""
    import torch
    import transformers as T

    config = T.LlamaConfig(vocab_size=96, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=256,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="bfloat16")
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    tokenizer(T).save_pretrained(folder)
    return folder


def write_vllm_moe(folder, model_type: str = "qwen3_moe"):
    """A tiny bf16 MoE model of `model_type` vLLM's CPU kernels take (hidden 128, head_dim 64, experts 128 wide),
    with the word-level tokenizer."""
    import torch
    import transformers as T

    T.logging.set_verbosity_error()
    config = causal_config(T, model_type)
    for key, value in dict(hidden_size=128, head_dim=64, num_attention_heads=2, num_key_value_heads=1,
                           intermediate_size=256, moe_intermediate_size=128, max_position_embeddings=256).items():
        if hasattr(config, key):
            setattr(config, key, value)
    torch.manual_seed(0)
    model = T.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    model.save_pretrained(folder)
    tokenizer(T).save_pretrained(folder)
    return folder


def one_recipe_plan(folder: Path, recipe: str, path: Path) -> Path:
    """A plan.toml at `path` giving every layer of the model in `folder` the recipe `recipe`."""
    from ffnquant.hf import inspect_model
    from ffnquant.planning.planfile import Plan, model_fingerprint
    from ffnquant.recipe import Recipe

    info = inspect_model(folder)
    path.write_text(Plan(model_fingerprint(info), {i: Recipe.parse(recipe) for i in range(info.n_layers)},
                         "ppl+1%", "bytes").to_toml())
    return path


def export_one_recipe(folder: Path, recipe: str, out: Path, fmt: str = "compressed-tensors") -> int:
    """`ffnquant export` of `folder` with a plan giving every layer `recipe` (written beside `out`), on the tests'
    small token counts: the command's exit code."""
    from ffnquant.cli import main

    plan = one_recipe_plan(folder, recipe, out.parent / f"{out.name}.plan.toml")
    return main(["export", "--model", str(folder), "--plan", str(plan), "--format", fmt, "--calib-tokens", "256",
                 "--eval-tokens", "128", "--seq-len", "128", "--no-progress", "--out", str(out)])
