"""A model folder checked against its config.json before any model is built from it: attention heads, key/value
heads and head width consistent, float dtypes, the token embedding's and attention projections' shapes, a finite
embedding. Used by `checkpoint.inspect_model`; one line naming the file, tensor or key."""

from __future__ import annotations

from typing import Any, Mapping

import torch

from ..errors import FFNQuantError
from ..numerics.primitives import all_finite
from .arch import _HEAD_DIM_KEYS, _HEADS_KEYS, _KV_HEADS_KEYS, attention_shape

__all__ = ["check_attention_config", "check_other_tensors"]

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16", "float64", "float32", "float16", "bfloat16"}
_EMBEDDINGS = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "shared.weight", "embed_in.weight")


def check_attention_config(config: Mapping[str, Any], d: int, cfg_file: str) -> None:
    """Heads, key/value heads and head width consistent with each other and the hidden size, before a model is
    built from them (transformers fails deep in a forward pass, or after pages of output, otherwise)."""
    def first(keys: tuple[str, ...]) -> tuple[str, Any] | None:
        return next(((k, config[k]) for k in keys if config.get(k) is not None), None)

    def positive(item: tuple[str, Any]) -> int:
        key, value = item
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise FFNQuantError(f"{cfg_file}: {key} must be a positive integer, got {value!r}")
        return value

    heads = first(_HEADS_KEYS)
    if heads is None:
        return  # no attention described: nothing to check (ffnquant counts it only when named)
    n_heads = positive(heads)
    kv = first(_KV_HEADS_KEYS)
    if kv is not None:
        n_kv = positive(kv)
        if n_kv > n_heads or n_heads % n_kv:
            raise FFNQuantError(f"{cfg_file}: {kv[0]} {n_kv} must divide {heads[0]} {n_heads} (each key/value head "
                                "serves a whole group of query heads)")
    head_dim = first(_HEAD_DIM_KEYS)
    if head_dim is not None:
        positive(head_dim)
    elif d % n_heads:
        raise FFNQuantError(f"{cfg_file}: hidden size {d} is not a multiple of {heads[0]} {n_heads}, and no head_dim "
                            "is given")


def check_other_tensors(weights: Any, config: Mapping[str, Any], d: int,
                        shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
    """The tensors beside the FFN as config.json describes them: float dtypes, the token embedding's shape and a
    finite embedding (a NaN there poisons every figure, named here), and every tensor's shape against `shapes`, the
    model transformers builds from config.json (`hf.discover`), whatever its attention's layout (gated queries,
    latent attention, per-layer head widths). Without them (an architecture known by name), the attention
    projections against heads x head width."""
    attn = None if shapes else attention_shape(config, d)
    vocab = config.get("vocab_size")
    # the embedding may be narrower than the model, projected to it (OPT's word_embed_proj_dim, ELECTRA's
    # embedding_size, RemBERT's input_embedding_size)
    emb_width = next((config[k] for k in ("word_embed_proj_dim", "embedding_size", "input_embedding_size")
                      if isinstance(config.get(k), int) and not isinstance(config.get(k), bool)), d)
    for name, file in weights.file_of.items():
        shape = weights.shape(name)
        dtype = weights.dtype(name)
        if dtype is not None and not name.endswith((".weight", ".bias")):
            continue  # buffers (position ids, masks) may be integers
        if dtype is not None and dtype not in _FLOAT_DTYPES:
            raise FFNQuantError(f"{str(file)!r}: tensor {name!r} has dtype {dtype}; ffnquant reads float checkpoints "
                                "(float32, float16, bfloat16), not pre-quantized ones")
        role = name.rsplit(".", 2)[-2:] if name.count(".") >= 1 else [name]
        if name.endswith(_EMBEDDINGS) and isinstance(vocab, int) and not isinstance(vocab, bool) and len(shape) == 2:
            # the model transformers builds says the shape where it is known (Mllama's table has 8 rows beyond
            # vocab_size for its image tokens)
            if tuple(shape) != (vocab, emb_width) and not (shapes and name in shapes):
                raise FFNQuantError(f"{str(file)!r}: tensor {name!r} has shape {list(shape)}, but config.json "
                                    f"(vocab_size={vocab}, hidden size={emb_width}) implies {[vocab, emb_width]}")
            table = weights.get(name)
            if not all_finite(table):  # one reduction; the mask below only to name the token
                bad = ~torch.isfinite(table)
                row = int(bad.any(dim=1).nonzero()[0, 0])
                value = float(table[row][bad[row]][0])
                raise FFNQuantError(f"{str(file)!r}: tensor {name!r} (the token embedding) holds {value} for token id "
                                    f"{row} ({int(bad.sum())} non-finite value(s)); every figure would be NaN")
        want_shape = shapes.get(name) if shapes else None
        if want_shape is not None and tuple(shape) != tuple(want_shape):
            raise FFNQuantError(f"{str(file)!r}: tensor {name!r} has shape {list(shape)}, but the model transformers "
                                f"builds from config.json has {list(want_shape)} there")
        if attn is not None and ".self_attn." in name and role[-1] == "weight" and len(shape) == 2:
            q, kv = attn["n_heads"] * attn["head_dim"], attn["n_kv_heads"] * attn["head_dim"]
            want = {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q)}.get(role[0])
            if want is not None and tuple(shape) != want:
                raise FFNQuantError(f"{str(file)!r}: tensor {name!r} has shape {list(shape)}, but config.json "
                                    f"({attn['n_heads']} heads, {attn['n_kv_heads']} key/value heads of width "
                                    f"{attn['head_dim']}, hidden size {d}) implies {list(want)}")
