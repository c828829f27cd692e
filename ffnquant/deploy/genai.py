"""An ONNX decoder folder as onnxruntime-genai loads it: `genai_config.json` naming the cached decoder graph and its
inputs, the model's tokenizer files beside it, and the check that genai's own generate loop produces the tokens of
ffnquant's loop (`deploy.onnx_decoder.greedy_generate`) on the same graph.

The decoder graph is already in the layout genai's model builder writes (`deploy.onnx_decoder`: `input_ids`,
`attention_mask`, `position_ids`, `past_key_values.%d.key/value` -> `logits`, `present.%d.key/value`); the config says
so in genai's own keys (its configuration reference). `type` is the model's `model_type`: genai keys its handling of
a decoder-only model on it and refuses a type it does not know; such a model is written as genai's generic
decoder-only type, "decoder" (`with_known_type`: genai itself asked, on the config alone), and said so.
onnxruntime-genai is optional (`pip install onnxruntime-genai --no-deps`); without it the files are still written and
the check says why it did not run.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..errors import first_line
from ..infra.atomic import write_text
from .onnx_decoder import PAST, PRESENT

__all__ = ["GENAI_CONFIG", "GENERIC_TYPE", "TOKENIZER_FILES", "with_known_type", "session_config", "genai_config", "write_genai_files", "genai_unavailable",
           "genai_generate", "genai_check"]

GENAI_CONFIG = "genai_config.json"
# what transformers' tokenizers save and genai's tokenizer (onnxruntime-extensions) reads
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _one_id(value: Any) -> Any:
    return value[0] if isinstance(value, (list, tuple)) and value else value


def session_config() -> dict[str, str]:
    """The session config entries every ffnquant CPU session sets (`onnx.onnxquant.ort_session`), for genai's session
    to compute what the proof measured: a weight-only DequantizeLinear -> MatMul kept at accuracy level 0 (onnxruntime's
    default fuses it into MatMulNBits at level 4, which quantizes the activations on the fly), and the int8 entries
    this CPU needs for exact int8 activations (`onnx.ortcpu.session_entries`). genai passes a session option it does
    not know to onnxruntime as a config entry."""
    from ..onnx.onnxmatmul import EXACT_WEIGHT_ONLY
    from ..onnx.ortcpu import session_entries

    return {EXACT_WEIGHT_ONLY: "0", **session_entries()}


def genai_config(config: Any, layout: Any, filename: str, generation: Any = None) -> dict[str, Any]:
    """genai_config.json's content for the cached decoder `filename` of a model with transformers `config` and cache
    `layout` (`onnx_decoder.CacheLayout`: kv heads and head size per layer). `generation`: the model's
    GenerationConfig (its EOS ids, which may be several), else the config's. The session carries
    `session_config()`."""
    text = _text_config(config)
    kv_heads, head_size = layout.keys[0]
    eos = getattr(generation, "eos_token_id", None) if generation is not None else None
    eos = eos if eos is not None else getattr(text, "eos_token_id", None)
    pad = getattr(text, "pad_token_id", None)
    pad = pad if pad is not None else _one_id(eos)
    from ..hf.inputs import position_limit

    context = position_limit(text.to_dict()) or 2048
    return {
        "model": {
            "bos_token_id": getattr(text, "bos_token_id", None),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": [], **session_config()},
                "filename": filename,
                "head_size": int(head_size),
                "hidden_size": int(text.hidden_size),
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids",
                           "past_key_names": PAST.format("%d", "key"), "past_value_names": PAST.format("%d", "value")},
                "outputs": {"logits": "logits", "present_key_names": PRESENT.format("%d", "key"),
                            "present_value_names": PRESENT.format("%d", "value")},
                "num_attention_heads": int(text.num_attention_heads),
                "num_hidden_layers": int(layout.n_layers),
                "num_key_value_heads": int(kv_heads),
            },
            "eos_token_id": eos,
            "pad_token_id": pad,
            "type": str(getattr(text, "model_type", None) or getattr(config, "model_type", "")),
            "vocab_size": int(text.vocab_size),
        },
        # greedy: what ffnquant's loop and its proof compare
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def write_genai_files(folder: str | Path, source: str | Path, config: Mapping[str, Any]) -> list[str]:
    """`config` as `folder`/genai_config.json and the tokenizer files of the model folder `source` copied beside it
    (those it has of `TOKENIZER_FILES`); the names written. The caller stages `folder`."""
    folder, source = Path(folder), Path(source)
    write_text(folder / GENAI_CONFIG, json.dumps(config, indent=1) + "\n")
    written = [GENAI_CONFIG]
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not (folder / name).exists():
            shutil.copyfile(source / name, folder / name)
            written.append(name)
    return written


# onnxruntime-genai's decoder-only type without model-specific handling: what a model type genai does not know runs as
GENERIC_TYPE = "decoder"


def with_known_type(config: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """`config` (a genai_config) with a `type` genai runs: its own where genai knows it, else GENERIC_TYPE; and the
    note saying so (None when unchanged). genai is asked on the config alone, in a scratch folder: a type it does
    not know is refused before any graph is read ("Unsupported model_type"). Unchanged without genai."""
    import tempfile

    out = json.loads(json.dumps(config))
    model_type = out["model"]["type"]
    if genai_unavailable() is not None or model_type == GENERIC_TYPE:
        return out, None
    import onnxruntime_genai as og

    with tempfile.TemporaryDirectory(prefix="ffnquant-genai-") as tmp:
        (Path(tmp) / GENAI_CONFIG).write_text(json.dumps(out))
        try:
            og.Model(tmp)
        except Exception as exc:  # no graph here: any other refusal is about the missing file
            if "Unsupported model_type" not in str(exc):
                return out, None
        else:
            return out, None
    out["model"]["type"] = GENERIC_TYPE
    return out, (f"onnxruntime-genai {og.__version__} knows no model_type {model_type!r}: written as its generic "
                 f"decoder-only type {GENERIC_TYPE!r} (the graph is ffnquant's, in genai's layout)")


def genai_unavailable() -> str | None:
    """Why onnxruntime-genai cannot run here, or None."""
    try:
        import onnxruntime_genai  # noqa: F401
    except Exception as exc:  # an ImportError, or a wheel built against another onnxruntime
        return (f"onnxruntime-genai is not importable ({first_line(exc)}): pip install onnxruntime-genai --no-deps")
    return None


def genai_generate(folder: str | Path, prompts: Sequence[Sequence[int]], new_tokens: int) -> list[list[int]]:
    """Greedy decoding of each prompt (batch 1, as ffnquant's check runs it) by onnxruntime-genai's `Generator` on
    the folder's genai_config.json: the new tokens, EOS included, nothing after it."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    out = []
    for prompt in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + new_tokens, batch_size=1)
        generator = og.Generator(model, params)
        generator.append_tokens([list(map(int, prompt))])
        while not generator.is_done():
            generator.generate_next_token()
        out.append([int(t) for t in generator.get_sequence(0)[len(prompt):]])
        del generator
    return out


def genai_check(folder: str | Path, rows: Sequence[Mapping[str, Any]], new_tokens: int) -> dict[str, Any]:
    """onnxruntime-genai's greedy tokens on `folder` against ffnquant's loop on the same graph (`rows`: each
    {prompt, tokens}): {ran, reason, equal, rows, version}. Equal: the same tokens up to an ending EOS, which
    ffnquant's loop keeps and genai's sequence leaves out. Never raises for genai's refusal: its message is the
    result."""
    why = genai_unavailable()
    if why is not None:
        return {"ran": False, "reason": why}
    import onnxruntime_genai as og

    try:
        got = genai_generate(folder, [r["prompt"] for r in rows], new_tokens)
    except Exception as exc:  # genai refusing the folder is the finding, with its own words
        return {"ran": False, "reason": f"onnxruntime-genai refused the folder: {first_line(exc)}",
                "version": og.__version__}
    eos = json.loads((Path(folder) / GENAI_CONFIG).read_text())["model"].get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])

    def ended(tokens: Sequence[int]) -> list[int]:  # genai's sequence stops before the EOS it produced
        return list(tokens[:-1]) if tokens and tokens[-1] in eos else list(tokens)

    out = [{"prompt": list(r["prompt"]), "genai": g, "ffnquant": list(r["tokens"]),
            "equal": ended(g) == ended(r["tokens"])} for r, g in zip(rows, got)]
    return {"ran": True, "reason": None, "equal": all(r["equal"] for r in out), "rows": out,
            "tokens_compared": sum(len(r["ffnquant"]) for r in out), "version": og.__version__}
