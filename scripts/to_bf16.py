"""A model folder saved again in bf16, as SmolLM2, Llama, Qwen and Gemma ship: the trained subjects' bf16 copies.

    python scripts/to_bf16.py models/smollm2-135m-instruct models/smollm2-135m-instruct-bf16
    python scripts/to_bf16.py models/gemma3-270m models/gemma3-270m-bf16

transformers loads the source in bf16 (each float32 value rounded once) and saves it; the tokenizer is saved
beside it, and every other file of the source that is not a weight or a config (licence, notice, provenance) is
copied. An existing destination is never overwritten.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

_WRITTEN = {"config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json"}
_WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python scripts/to_bf16.py SOURCE_DIR DEST_DIR", file=sys.stderr)
        return 2
    src, dst = Path(argv[0]), Path(argv[1])
    if not (src / "config.json").is_file():
        print(f"to_bf16: {src} is not a model folder (no config.json)", file=sys.stderr)
        return 2
    if dst.exists():
        print(f"to_bf16: {dst} exists; choose a new folder", file=sys.stderr)
        return 2
    import torch
    import transformers as T

    T.logging.set_verbosity_error()
    staging = dst.with_name(dst.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model = T.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    model.save_pretrained(staging)
    T.AutoTokenizer.from_pretrained(src).save_pretrained(staging)
    for entry in src.iterdir():
        if entry.is_file() and entry.name not in _WRITTEN and not entry.name.endswith(_WEIGHTS) \
                and not (staging / entry.name).exists():
            shutil.copy2(entry, staging / entry.name)
    staging.rename(dst)
    print(f"{dst}: {sum(p.stat().st_size for p in dst.glob('*.safetensors')):,} bytes of bf16 weights")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
