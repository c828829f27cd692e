"""Independent perplexity / KL scorer for quantized causal LMs.

Written without ffnquant on purpose: it imports only torch, transformers (which needs
compressed-tensors to load compressed folders), numpy and the standard library, so the
figures it prints are a second opinion on ffnquant's own evaluator.

For every candidate folder and every text it reports, against the float reference:

* reference and candidate perplexity;
* the perplexity change with a 95% confidence interval from paired per-sequence differences
  (ratio estimator r = sum_s d_s / sum_s n_s, d_s = sum over sequence s of
  nll_cand - nll_ref, n_s its predicted tokens; se = sqrt(S/(S-1) sum_s (d_s - r n_s)^2) /
  sum_s n_s; change = exp(r) - 1, interval exp(r -+ t_{0.975,S-1} se) - 1);
* KL(P_ref || P_cand) of the full next-token distributions per predicted token (mean,
  median, p99, p99.9, max);
* top-1 agreement (share of predicted tokens where the two argmaxes agree).

Windows follow ffnquant/hf/corpus.py's convention, re-implemented here: each text is a list of
documents (a .txt file is one, or several separated by form feeds; .jsonl / .jsonl.gz holds one JSON
object per line with the document under "text"). Each document is tokenized with
add_special_tokens=False and followed by the tokenizer's EOS, then cut into consecutive pieces of
seq_len tokens (seq_len-1 after a BOS, when the tokenizer adds one), the first at the document's
start; windows are taken round-robin (every document's first window, then every second, ...);
windows shorter than 16 tokens are dropped, except the budget's last window, which is cut to what is
left of --max-tokens (window tokens, BOS and EOS included).

Example:

    python benchmarks/independent_score.py --reference models/smollm2-135m-instruct \
        --candidate models/peer/llmc-w8a8-ffn \
        --text prose=ffnquant/data/corpora/prose-evaluation.jsonl.gz --max-tokens 50000 \
        --out reports/trained-llm/peer/score
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import platform
import shlex
import sys
import time
from importlib import metadata

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

MIN_WINDOW = 16


# ----------------------------------------------------------------------------- statistics

def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta (modified Lentz)."""
    tiny = 1e-300
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    lbt = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(lbt) * _betacf(a, b, x) / a
    return 1.0 - math.exp(lbt) * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """Student's t CDF via the regularized incomplete beta."""
    x = df / (df + t * t)
    tail = 0.5 * _betainc(df / 2.0, 0.5, x)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """Inverse of t_cdf by bisection (p in (0.5, 1))."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def paired_change(d: np.ndarray, n: np.ndarray) -> dict:
    """Ratio estimator of the mean per-token NLL difference over S sequences."""
    S = len(d)
    N = float(n.sum())
    r = float(d.sum()) / N
    if S > 1:
        se = math.sqrt(S / (S - 1) * float(((d - r * n) ** 2).sum())) / N
        tq = t_quantile(0.975, S - 1)
    else:
        se, tq = float("nan"), float("nan")
    return {
        "sequences": S,
        "predicted_tokens": int(N),
        "mean_nll_diff": r,
        "se": se,
        "t_0975": tq,
        "ppl_change": math.exp(r) - 1.0,
        "ci95": [math.exp(r - tq * se) - 1.0, math.exp(r + tq * se) - 1.0],
    }


# ----------------------------------------------------------------------------- texts

def read_documents(path: str) -> list[str]:
    if path.endswith(".gz"):
        opener = lambda: gzip.open(path, "rt", encoding="utf-8")  # noqa: E731
        stem = path[:-3]
    else:
        opener = lambda: open(path, encoding="utf-8")  # noqa: E731
        stem = path
    with opener() as f:
        if stem.endswith(".jsonl"):
            docs = []
            for line in f:
                line = line.strip()
                if not line:
                    continue
                obj = json.loads(line)
                docs.append(obj if isinstance(obj, str) else obj["text"])
            return docs
        return [d for d in f.read().split("\f") if d.strip()]


def make_windows(tokenizer, docs: list[str], seq_len: int, max_tokens: int | None) -> list[list[int]]:
    """Token windows, following ffnquant/hf/corpus.py's convention (re-implemented here, not imported):
    each document is tokenized without special tokens and followed by the EOS; it is cut into pieces of
    seq_len tokens (seq_len - 1 after a BOS, when the tokenizer adds one); windows are taken round-robin
    (every document's first window, then every document's second, ...), so a budget spans many documents;
    a window shorter than MIN_WINDOW is dropped, except the budget's last one, cut to what is left (>= 2)."""
    probe = tokenizer("a")["input_ids"]
    bos = tokenizer.bos_token_id
    prefix = [bos] if (bos is not None and probe and probe[0] == bos) else []
    end = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    step = seq_len - len(prefix)
    ids = [tokenizer(d, add_special_tokens=False)["input_ids"] + end for d in docs]
    kept, short, total = [], [], 0
    k = 0
    while True:
        rest = [x for x in ids if len(x) > k * step]
        if not rest:
            break
        for x in rest:
            w = prefix + x[k * step:(k + 1) * step]
            if max_tokens is not None and len(w) > max_tokens - total:
                w = w[:max_tokens - total]
                if len(w) >= 2:
                    kept.append(w)
                return kept
            if len(w) < min(MIN_WINDOW, seq_len):
                short.append(w)
                continue
            kept.append(w)
            total += len(w)
            if max_tokens is not None and total >= max_tokens:
                return kept
        k += 1
    return kept or [w for w in short if len(w) >= 2]


# ----------------------------------------------------------------------------- models

def load_model(folder: str):
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    return model


def quantization_evidence(model, reference) -> dict:
    """How the candidate differs from a plain float model, in three independent ways:

    1. on load: which Linears carry compressed-tensors' quantization attributes and in which
       dtype their weights are stored (int8 for a compressed int-quantized folder);
    2. after a first forward pass (compressed-tensors decompresses the weights there, once):
       how many Linears' weights differ from the reference's;
    3. a probe of the first quantized Linear on inputs with a wide per-token range: its output
       is compared with the float matmul of its (decompressed) weight, and with that matmul on
       inputs fake-quantized to int8 per token by hand (symmetric, scale = absmax / 127.5,
       compressed-tensors' convention for int8, clamp to [-128, 127]). A relative error of ~0
       against the latter and not the former shows the activations really are quantized
       dynamically per token in the forward pass the scores come from."""
    qmods, dtypes = [], {}
    for name, mod in model.named_modules():
        w = getattr(mod, "weight", None)
        if not isinstance(mod, torch.nn.Linear) or w is None:
            continue
        dtypes[str(w.dtype)] = dtypes.get(str(w.dtype), 0) + 1
        if getattr(mod, "quantization_scheme", None) is not None:
            qmods.append(name)
    schemes = {}
    for name in qmods:
        scheme = model.get_submodule(name).quantization_scheme
        key = json.dumps({"weights": _args(scheme.weights), "input_activations": _args(scheme.input_activations)},
                         sort_keys=True)
        schemes[key] = schemes.get(key, 0) + 1
    with torch.no_grad():  # first forward: triggers compressed-tensors' decompress-on-first-forward hook
        model(torch.tensor([[0, 1, 2, 3]]))
    ref_params = dict(reference.named_parameters())
    changed, unchanged = [], []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            ref_w = ref_params.get(name + ".weight")
            if ref_w is not None and ref_w.shape == mod.weight.shape:
                (unchanged if torch.equal(_dequant(mod), ref_w.detach()) else changed).append(name)
    ev = {
        "linears_with_quantization_scheme": len(qmods),
        "quantized_sample": qmods[:3] + (["..."] if len(qmods) > 3 else []),
        "linear_weight_dtypes_on_load": dtypes,
        "linears_differing_from_reference_after_first_forward": len(changed),
        "linears_equal_to_reference_after_first_forward": len(unchanged),
        "differing_sample": changed[:3],
        "schemes": [dict(json.loads(k), modules=v) for k, v in schemes.items()],
    }
    if qmods:
        ev["probe"] = _probe(model.get_submodule(qmods[0]), qmods[0])
    return ev


def _args(a):
    if a is None:
        return None
    d = a.model_dump() if hasattr(a, "model_dump") else dict(a)
    keep = ("num_bits", "type", "symmetric", "strategy", "dynamic", "group_size", "observer")
    return {k: (d[k] if isinstance(d[k], (int, float, bool, type(None))) else str(d[k])) for k in keep if k in d}


def _dequant(mod) -> torch.Tensor:
    w = mod.weight.detach()
    if w.is_floating_point():
        return w
    wf = w.float()
    zp = getattr(mod, "weight_zero_point", None)
    if zp is not None:
        wf = wf - zp.detach().float()
    return wf * mod.weight_scale.detach().float()


def _probe(mod, name: str) -> dict:
    gen = torch.Generator().manual_seed(0)
    w = _dequant(mod).float()
    x = torch.randn(8, w.shape[1], generator=gen) * torch.logspace(-1, 1, 8).unsqueeze(1)
    x[:, 0] *= 30.0  # an outlier channel, as in real activations
    with torch.no_grad():
        y = mod(x.unsqueeze(0)).squeeze(0).float()
        s = x.abs().amax(dim=1, keepdim=True) / 127.5
        xq = torch.clamp(torch.round(x / s), -128, 127) * s
        e_float = float((y - x @ w.T).norm() / y.norm())
        e_tok = float((y - xq @ w.T).norm() / y.norm())
    reading = ("inputs fake-quantized per token to int8 (matches by-hand per-token int8 of the inputs)"
               if e_tok < 1e-5 and e_float > 1e-4 else
               "inputs NOT quantized (matches the float matmul)" if e_float < 1e-5 else "inconclusive")
    return {"module": name, "weight_int_levels": _levels(mod),
            "rel_err_vs_float_matmul": e_float, "rel_err_vs_per_token_int8_inputs": e_tok, "reading": reading}


def _levels(mod):
    """Distinct weight values per output row after dividing by the row's scale (<= 255 for int8)."""
    scale = getattr(mod, "weight_scale", None)
    if scale is None:
        return None
    q = _dequant(mod) / scale.detach().float()
    return {"max_abs_dev_from_integer": float((q - q.round()).abs().max()),
            "max_abs_level": float(q.round().abs().max())}


# ----------------------------------------------------------------------------- scoring

@torch.no_grad()
def score(reference, candidates: dict, windows: list[list[int]], log_every: int = 10) -> dict:
    """One pass over the windows: the reference's logits are computed once per window and
    compared with every candidate's, so only one window's distributions are ever held."""
    per = {c: {"d": [], "n": [], "nll_ref": 0.0, "nll_cand": 0.0, "kl": [], "agree": 0} for c in candidates}
    nll_ref_total, n_total = 0.0, 0
    t0 = time.time()
    for i, w in enumerate(windows):
        ids = torch.tensor([w])
        tgt = ids[0, 1:]
        ref_lp = torch.log_softmax(reference(ids).logits[0, :-1].float(), dim=-1)
        ref_nll = -ref_lp.gather(1, tgt[:, None])[:, 0].double()
        ref_p = ref_lp.exp()
        ref_top = ref_lp.argmax(-1)
        nll_ref_total += float(ref_nll.sum())
        n_total += len(tgt)
        for c, model in candidates.items():
            lp = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            nll = -lp.gather(1, tgt[:, None])[:, 0].double()
            kl = (ref_p * (ref_lp - lp)).sum(-1, dtype=torch.float64).clamp_min(0.0)
            st = per[c]
            st["d"].append(float((nll - ref_nll).sum()))
            st["n"].append(len(tgt))
            st["nll_cand"] += float(nll.sum())
            st["kl"].append(kl.numpy())
            st["agree"] += int((lp.argmax(-1) == ref_top).sum())
        if log_every and (i + 1) % log_every == 0:
            print(f"  window {i + 1}/{len(windows)}  {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    out = {"reference_ppl": math.exp(nll_ref_total / n_total), "predicted_tokens": n_total,
           "window_tokens": sum(len(w) for w in windows), "windows": len(windows),
           "seconds": time.time() - t0, "candidates": {}}
    for c, st in per.items():
        kl = np.concatenate(st["kl"])
        res = paired_change(np.array(st["d"]), np.array(st["n"], dtype=np.float64))
        res["candidate_ppl"] = math.exp(st["nll_cand"] / n_total)
        res["reference_ppl"] = out["reference_ppl"]
        res["kl"] = {"mean": float(kl.mean()), "median": float(np.median(kl)),
                     "p99": float(np.quantile(kl, 0.99)), "p99.9": float(np.quantile(kl, 0.999)),
                     "max": float(kl.max())}
        res["top1_agreement"] = st["agree"] / n_total
        out["candidates"][c] = res
    return out


# ----------------------------------------------------------------------------- stamp

def machine_stamp() -> dict:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    vers = {}
    for pkg in ("torch", "transformers", "compressed-tensors", "numpy"):
        try:
            vers[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            vers[pkg] = None
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "platform": platform.platform(), "versions": vers}


def fmt_pct(x: float) -> str:
    return f"{100 * x:+.2f}%"


def markdown(result: dict) -> str:
    m = result["machine"]
    lines = [
        "# Independent score (benchmarks/independent_score.py; no ffnquant code)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores (torch threads {m['torch_threads']}); "
        + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
        "",
        f"Reference: `{result['reference']}`; seq_len {result['seq_len']}; windows: {result['windowing']}",
        "",
        "| candidate | text | windows | predicted tokens | ref ppl | cand ppl | ppl change [95% CI] | "
        "KL mean | KL median | KL p99 | KL p99.9 | KL max | top-1 agree |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for tname, t in result["texts"].items():
        for c, r in t["candidates"].items():
            k = r["kl"]
            lines.append(
                f"| `{c}` | {tname} | {r['sequences']} | {r['predicted_tokens']:,} | {r['reference_ppl']:.4f} | "
                f"{r['candidate_ppl']:.4f} | {fmt_pct(r['ppl_change'])} [{fmt_pct(r['ci95'][0])}, "
                f"{fmt_pct(r['ci95'][1])}] | {k['mean']:.5f} | {k['median']:.5f} | {k['p99']:.4f} | "
                f"{k['p99.9']:.4f} | {k['max']:.3f} | {100 * r['top1_agreement']:.2f}% |")
    lines.append("")
    for tname, t in result["texts"].items():
        lines.append(f"- {tname}: `{t['path']}`, {t['documents']} documents, {t['window_tokens']:,} window tokens, "
                     f"scored in {t['seconds']:.0f} s")
    lines.append("")
    lines.append("## Quantization evidence per candidate")
    lines.append("")
    for c, ev in result["evidence"].items():
        lines.append(f"- `{c}`: load {ev.get('load_seconds', 0):.1f} s; " + json.dumps(
            {k: v for k, v in ev.items() if k != "load_seconds"}, sort_keys=True))
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reference", required=True)
    ap.add_argument("--candidate", action="append", required=True,
                    help="candidate HF folder (repeatable); NAME=FOLDER names it")
    ap.add_argument("--text", action="append", required=True, help="NAME=PATH (repeatable)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=None, help="window tokens per text")
    ap.add_argument("--skip-tokens", type=int, default=0,
                    help="leave out the first windows (in window order) until this many tokens are passed: the windows "
                         "of --max-tokens SKIP+N after them, as ffnquant's heldout_verify --skip-tokens takes them")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", default=None, help="output stem: writes STEM.json and STEM.md")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    command = " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:]) \
        if argv is None else " ".join(shlex.quote(a) for a in argv)
    tokenizer = AutoTokenizer.from_pretrained(args.reference)
    reference = load_model(args.reference)
    candidates, evidence = {}, {}
    for spec in args.candidate:
        name, folder = spec.split("=", 1) if "=" in spec and not os.path.isdir(spec) else (spec, spec)
        t0 = time.time()
        candidates[name] = load_model(folder)
        evidence[name] = {"load_seconds": time.time() - t0}
        evidence[name].update(quantization_evidence(candidates[name], reference))
        evidence[name]["folder"] = folder
        print(f"{name}: {json.dumps(evidence[name])}", file=sys.stderr, flush=True)

    probe = tokenizer("a")["input_ids"]
    has_bos = bool(probe) and tokenizer.bos_token_id is not None and probe[0] == tokenizer.bos_token_id
    result = {
        "command": command, "machine": machine_stamp(), "reference": args.reference, "seq_len": args.seq_len,
        "max_tokens": args.max_tokens, "skip_tokens": args.skip_tokens,
        "windowing": (f"ffnquant/hf/corpus.py's convention, re-implemented: BOS in front of each window: {has_bos} "
                      f"(bos {tokenizer.bos_token_id}); each document followed by EOS {tokenizer.eos_token_id}; "
                      f"windows round-robin over documents (all first windows, then all second, ...); windows < "
                      f"{MIN_WINDOW} tokens dropped except the budget's last, cut to fit; max-tokens counts window "
                      "tokens (BOS/EOS included)"),
        "evidence": evidence, "texts": {},
    }
    for spec in args.text:
        tname, path = spec.split("=", 1)
        docs = read_documents(path)
        windows = make_windows(tokenizer, docs, args.seq_len, args.max_tokens)
        if args.skip_tokens:
            seen, kept = 0, []
            for w in windows:
                if seen >= args.skip_tokens:
                    kept.append(w)
                seen += len(w)
            windows = kept
        print(f"{tname}: {len(docs)} documents, {len(windows)} windows, "
              f"{sum(map(len, windows))} tokens", file=sys.stderr, flush=True)
        r = score(reference, candidates, windows)
        r.update({"path": path, "documents": len(docs)})
        result["texts"][tname] = r
        for c, cr in r["candidates"].items():
            print(f"{tname} {c}: ppl {cr['reference_ppl']:.4f} -> {cr['candidate_ppl']:.4f} "
                  f"{fmt_pct(cr['ppl_change'])} [{fmt_pct(cr['ci95'][0])}, {fmt_pct(cr['ci95'][1])}] "
                  f"KL mean {cr['kl']['mean']:.5f} top1 {100 * cr['top1_agreement']:.2f}%",
                  file=sys.stderr, flush=True)
    md = markdown(result)
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
