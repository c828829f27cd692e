"""Norm-folded smoothing on a trained model is exact: fp32 logits with every FFN's SmoothQuant input scale folded
into the preceding RMSNorm against the untouched model.

    PYTHONPATH=. python benchmarks/fold_exactness.py [--model models/smollm2-135m-instruct] [--alpha 0.5]
        [--out reports/trained-llm]

Writes fold_exactness.{json,md}: the issue's bound is 1e-5 relative (max |a - b| / max |a| over all logits).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ffnquant.infra.atomic import write_json, write_text
from ffnquant.infra.envinfo import environment
from ffnquant.hf.fold import FOLD_TOLERANCE, fold_exactness
from ffnquant.infra.render import markdown_table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="models/smollm2-135m-instruct")
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--out", default="reports/trained-llm")
    args = ap.parse_args(argv)
    t = time.perf_counter()
    res = fold_exactness(args.model, alpha=args.alpha)
    res = {"command": "PYTHONPATH=. python benchmarks/fold_exactness.py " + " ".join(sys.argv[1:] if argv is None else argv),
           **res, "seconds": time.perf_counter() - t, "tolerance": FOLD_TOLERANCE, "environment": environment()}
    rows = [("folded model vs untouched", res.get("max_rel_diff"), res.get("mean_rel_diff"))]
    for key, what in (("unfolded", "smoothed FFNs doing their own multiply vs untouched"),
                      ("folded_vs_unfolded", "the fold alone (folded vs smoothed, unfolded)"),
                      ("float_ffns", "ffnquant's unsmoothed float FFNs vs untouched")):
        if isinstance(res.get(key), dict):
            rows.append((what, res[key].get("max_rel_diff"), res[key].get("mean_rel_diff")))
    ok = res.get("max_rel_diff") is not None and res["max_rel_diff"] <= FOLD_TOLERANCE
    env = res["environment"]
    md = [f"# Norm-folded smoothing on {args.model}: {'exact' if ok else 'NOT exact'} within {FOLD_TOLERANCE:g}", "",
          f"Command: `{res['command'].strip()}`", "",
          f"Every FFN's input smoothed (SmoothQuant, alpha {args.alpha}), the 1/s folded into the preceding norm's "
          "weight, fp32 logits compared with the untouched model's on the held-out text. Relative difference: "
          "max |a - b| / max |a| (and mean |a - b| / mean |a|) over every logit of every token.", "",
          markdown_table(["comparison", "max rel diff", "mean rel diff"], rows), "",
          f"_{env.get('timestamp_utc')} on {env.get('cpu')}, torch {env['packages'].get('torch')}, transformers "
          f"{env['packages'].get('transformers', '-')}; {res['seconds']:.0f} s_", ""]
    folder = Path(args.out)
    folder.mkdir(parents=True, exist_ok=True)
    write_json(folder / "fold_exactness.json", res)
    write_text(folder / "fold_exactness.md", "\n".join(md))
    print("\n".join(md))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
