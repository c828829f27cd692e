#!/usr/bin/env python3
"""What ffnquant finds in trained checkpoints from the models themselves, and how exactly it holds.

For each model folder: the FFN discovered from the module tree (`hf.discover`: where it is, its roles, the
activation the probe settled on, what stays float), then on the loaded model, per layer:
- ffnquant's FFN against the model's own module on the same input (`hf.graph.check_reproduction`);
- where an input scale folds (`hf.graph.fold_sites`): the producing norm, its gain form, other readers, and the
  logits' relative change when a random scale is folded there (or why it is refused).
The input is the first 128 tokens of the shipped prose evaluation corpus, with the model's own tokenizer.

Usage:
  PYTHONPATH=. python benchmarks/discovery_check.py models/smollm2-135m-instruct models/gemma3-270m \
      --out reports/discovery
Writes OUT/discovery.json and OUT/discovery.md (stamped with the machine, versions and the command).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

import torch


def check(folder: str) -> dict:
    from ffnquant.hf import inspect_model, load_ffn_layers
    from ffnquant.hf.capture import load_hf_model, load_tokenizer
    from ffnquant.hf.corpus import document_text, load_documents
    from ffnquant.hf.graph import check_reproduction, fold_sites

    t = time.perf_counter()
    info = inspect_model(folder)
    inspect_s = time.perf_counter() - t
    model = load_hf_model(info)
    tok = load_tokenizer(info.path)
    text = document_text(load_documents("prose", "evaluation")[0])
    ids = torch.tensor([tok(text)["input_ids"][:128]])
    layers = load_ffn_layers(info)
    t = time.perf_counter()
    repro = check_reproduction(model, info, layers, ids)
    sites = fold_sites(model, info, [layer.info for layer in layers], ids)
    arch = info.arch
    return {
        "folder": Path(folder).name, "model_type": info.model_type, "class": type(model).__name__,
        "discovered": arch.discovered, "ffn_module": arch.module_pattern, "roles": dict(arch.roles),
        "variant": info.spec.variant.value, "activation": info.spec.activation.value,
        "d_model": info.spec.d_model, "d_ff": info.spec.d_ff, "n_ffns": len(info.layers),
        "float_parts": list(arch.float_parts), "inspect_s": inspect_s, "checks_s": time.perf_counter() - t,
        "layers": [{"layer": layer.label, "reproduction_rel_diff": repro[layer.label],
                    **sites[layer.info].to_dict()} for layer in layers],
    }


def markdown(results: list[dict], env: dict, command: str) -> str:
    lines = ["# FFNs found from trained models themselves", "",
             f"Command: `{command}`", "",
             f"_{env['timestamp_utc']} on {env['cpu']}, torch {env['packages'].get('torch')}, "
             f"transformers {env['packages'].get('transformers')}_", ""]
    for r in results:
        worst = max(x["reproduction_rel_diff"] for x in r["layers"])
        folds = [x for x in r["layers"] if not x["refusal"]]
        lines += [f"## {r['folder']} ({r['model_type']}, {r['class']})", "",
                  f"- FFN: `{r['ffn_module']}`, roles {r['roles']}, {r['variant']} ({r['activation']}), "
                  f"d_model {r['d_model']}, d_ff {r['d_ff']}, {r['n_ffns']} FFNs; found in {r['inspect_s']:.1f} s "
                  "from the model built on the meta device",
                  f"- stays float: {'; '.join(r['float_parts']) or 'nothing'}",
                  f"- ffnquant's FFN against the model's own module, same input: worst relative difference "
                  f"{worst:.1e} over {len(r['layers'])} layers",
                  f"- input scales fold in {len(folds)}/{len(r['layers'])} layers", "",
                  "| layer | reproduction | norm | gain form | fold check (logits) | refused because |",
                  "|---|---|---|---|---|---|"]
        for x in r["layers"]:
            check_ = "-" if x["check_rel_diff"] is None else f"{x['check_rel_diff']:.1e}"
            lines.append(f"| {x['layer']} | {x['reproduction_rel_diff']:.1e} | {x['norm'] or '-'} | {x['gain'] or '-'} | "
                         f"{check_} | {x['refusal'] or ''} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    from ffnquant.infra.atomic import write_json, write_text
    from ffnquant.infra.envinfo import environment

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--out", default="reports/discovery")
    args = ap.parse_args()
    command = "PYTHONPATH=. python benchmarks/discovery_check.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    results = []
    for folder in args.models:
        print(f"discovery_check: {folder}", flush=True)
        results.append(check(folder))
    env = environment()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "discovery.json", {"command": command, "environment": env, "models": results})
    write_text(out / "discovery.md", markdown(results, env, command))
    print(f"wrote {out / 'discovery.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
