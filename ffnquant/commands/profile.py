"""`ffnquant profile`: activation ranges at every FFN site, per variant, written as the range report."""

from __future__ import annotations

import argparse

from ..atlas import layer_atlas
from ..data import parse_source
from ..errors import FFNQuantError
from ..hf import EvalSettings, ModelKind, calibrate_model, parse_layers
from ..hf.layerwise import model_top_positions
from ..hf.memory import plan_memory, profile_needs
from ..hf.stream import token_batches_of
from ..infra.atomic import OutputTransaction
from ..infra.render import fmt, text_table
from ..numerics.histogram import StreamingHistogram
from ..numerics.observe import DEFAULT_BINS
from ..ranges import claims, findings, profile_variants
from ..report.ranges import write_range_report
from ..spec import SITES
from .common import (add_device_argument, add_memory_arguments, add_model_arguments, add_spec_arguments, positive_int, specs_from_args,
                     token_notes)

NAME = "profile"
HELP = "profile activation ranges at every FFN tensor site and write the range report (JSON, Markdown, plots)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument(
        "--source",
        default="gaussian",
        help="calibration tokens: gaussian, llm_like, file:PATH or PATH.npy / PATH.safetensors[::TENSOR] (default gaussian)",
    )
    parser.add_argument("--data-seed", type=int, default=0, help="seed of a synthetic token source (default 0)")
    parser.add_argument("--outlier-channels", type=int, default=4, help="llm_like: number of large input channels (default 4)")
    parser.add_argument("--outlier-scale", type=float, default=50.0, help="llm_like: their magnitude (default 50)")
    parser.add_argument("--tokens", type=positive_int, default=8192, help="calibration tokens per variant (default 8192)")
    parser.add_argument("--batch-size", type=positive_int, default=1024, help="tokens per forward pass (default 1024)")
    parser.add_argument("--bins", type=positive_int, default=DEFAULT_BINS, help=f"histogram bins, a multiple of 4 (default {DEFAULT_BINS})")
    parser.add_argument("--out", default="reports", help="output folder (default reports/)")
    add_model_arguments(parser)
    parser.add_argument("--no-positions", action="store_true",
                        help="with --model: skip the second model run that finds the token positions of each site's "
                             "largest values (the layer atlas then has the range figures only)")
    add_memory_arguments(parser)
    add_device_argument(parser, "--model's model")


def _cell(table, site: str) -> str:
    if site not in table:
        return "-"
    o = table[site]
    return f"{fmt(o.crest_factor, 3)}/{fmt(o.kurtosis, 3)}"


def _model_measured(args: argparse.Namespace, tables: dict) -> dict | None:
    """What the model's layers were measured on, from their tables: width, tokens per layer, the text (or
    captured files) and, for a text, the tokens requested against those it gave."""
    if not tables:
        return None
    first = next(iter(tables.values()))
    model_type = next(iter(tables)).split(":", 1)[0]
    widths = sorted({t.spec.d_model for t in tables.values() if t.spec is not None})
    tokens = sorted({t.n_tokens for t in tables.values()})
    source = first.meta.get("source_label", "the model's inputs")
    budget = first.meta.get("calibration_text")
    count = f"{tokens[0]:,}" + (f" to {tokens[-1]:,}" if len(tokens) > 1 else "")
    summary = (f"{model_type} ({args.model}), {len(tables)} FFN layer(s) at d_model "
               f"{', '.join(str(w) for w in widths)}, {count} tokens per layer of {source}")
    if budget and budget.get("short"):
        summary += f" ({budget['requested']:,} tokens requested: the text is too short)"
    return {"summary": summary, "model_type": model_type, "d_model": widths, "source": source,
            "tokens_per_layer": {k: t.n_tokens for k, t in tables.items()}, "calibration_text": budget}


def _settings(args: argparse.Namespace):
    return EvalSettings(max_calib_tokens=args.model_tokens, bins=args.bins)


def _memory_plan(args: argparse.Namespace, info):
    """How the model runs (whole, or layer by layer; `hf.memory.plan_memory`), decided before any work; None when
    its FFN inputs come from --captured files (the model does not run)."""
    if args.captured is not None:
        if args.sequential:
            raise FFNQuantError("--sequential runs the model layer by layer; --captured reads its FFN inputs from "
                                "files instead: give one of them")
        return None

    settings = _settings(args)
    ids = token_batches_of(info, args.text, "calibration", settings, args.model_tokens)
    needs = profile_needs(info, calib_tokens=sum(int(b.numel()) for b in ids),
                          n_layers=len(parse_layers(args.layers, info.n_layers)), batch_tokens=int(ids[0].numel()))
    return plan_memory(info, needs, max_memory=args.max_memory, sequential=args.sequential)


def _model_layers(args: argparse.Namespace, info, memory):
    """The model's RangeTables keyed '<model_type>:<label>', its settings, and the top positions measured on the
    way (a causal LM, through the engine) or its layers (the atlas runs their FFNs again to locate the largest
    values: encoders, and FFN inputs from --captured files)."""
    settings = _settings(args)
    if memory is not None and info.kind is ModelKind.CAUSAL_LM:
        from ..hf.layerwise import calibrate_layerwise

        tables, top, measured = calibrate_layerwise(info, args.layers, args.text, settings,
                                                    positions=not args.no_positions, resident=not memory.sequential,
                                                    spill=memory.spill, allow_pickle=args.allow_pickle)
        keyed = {f"{info.model_type}:{label}": table for label, table in tables.items()}
        return settings, keyed, (top, measured)
    layers, tables = calibrate_model(info, layers=args.layers, text=args.text, captured=args.captured,
                                     settings=settings, allow_pickle=args.allow_pickle)
    return settings, {f"{info.model_type}:{layer.label}": tables[layer.label] for layer in layers}, layers


def _atlas(args: argparse.Namespace, info, layers, settings, tables: dict) -> tuple[dict, str]:
    """The layer atlas of the model's tables, with the token positions of the top values when they can be measured
    (`layers` the model's FFN layers, or the (positions, what they were measured on) a streamed run measured);
    and a sentence saying what the positions were measured on (or why not)."""
    top: dict = {}
    if args.no_positions:
        note = "not measured (--no-positions)."
    elif args.captured:
        note = ("not measured: captured files do not record where their sequences start (run without --captured to "
                "measure them on the model).")
    else:
        if isinstance(layers, tuple):
            top, m = layers
            how = "in the same run of the model over the calibration windows of the ranges"
        else:
            top, m = model_top_positions(info, layers, text=args.text, settings=settings,
                                         allow_pickle=args.allow_pickle)
            how = "in a second run of the model over the same calibration windows as the ranges"
        note = (f"measured {how}: "
                f"{m['n_tokens']:,} tokens of {m['source']} in {m['n_sequences']} window(s) of up to {m['seq_len']} "
                "tokens; position = index within its window (windows are plain cuts of the text, no BOS token "
                "added).")
        if m["skipped_experts"]:
            note += (f" Experts ({', '.join(m['skipped_experts'])}) left out: the router's choice drops their "
                     "tokens' positions.")
    return layer_atlas(tables, top), note


def _atlas_lines(atlas: dict) -> list[str]:
    """The atlas's headline for the terminal: per site the worst layer by kurtosis and its largest value."""
    lines = []
    for site in atlas["sites"]:
        worst = atlas["worst"][site]["kurtosis"]
        if not worst:
            continue
        row = next(r for r in atlas["layers"] if r["key"] == worst[0]["key"])
        cell = row["sites"][site]
        text = (f"- {site}: hardest {row['label']} (kurtosis {fmt(cell['kurtosis'], 3)}, crest "
                f"{fmt(cell['crest_factor'], 3)}, absmax {fmt(cell['absmax'], 3)}")
        pos = cell.get("positions")
        if pos and pos["top"]:
            t = pos["top"][0]
            text += (f" at position {t['position']}, channel {t['channel']}; "
                     f"{100 * pos['position0_share']:.0f}% of its top {100 * pos['top_fraction']:g}% at position 0")
        lines.append(text + ")")
    return lines


def run(args: argparse.Namespace) -> int:
    # Validate everything before profiling or writing anything.
    specs = specs_from_args(args)
    StreamingHistogram(args.bins)
    if args.outlier_channels < 0 or args.outlier_channels > args.d_model:
        raise FFNQuantError(f"--outlier-channels must be in [0, d_model={args.d_model}], got {args.outlier_channels}")
    if args.data_seed < 0:
        raise FFNQuantError(f"--data-seed must be non-negative, got {args.data_seed}")
    source = parse_source(args.source, seed=args.data_seed, n_outlier_channels=args.outlier_channels, outlier_scale=args.outlier_scale)
    available = source.available(args.d_model)  # loads and validates a file source
    if available is not None and args.tokens > available:
        raise FFNQuantError(f"{source.label} has {available} tokens; --tokens {args.tokens} asks for more")

    info = memory = None
    if args.model:
        from ..hf import inspect_model

        info = inspect_model(args.model, allow_pickle=args.allow_pickle)  # a bad folder fails before any profiling
        memory = _memory_plan(args, info)  # a run that cannot fit is refused here, before any work
    elif args.sequential is not None:
        raise FFNQuantError("--sequential/--no-sequential choose how a --model runs: give --model")
    # The report is staged and moved into place only when complete: a failure leaves --out as it was.
    with OutputTransaction() as tx:
        out = tx.folder(args.out)  # an unusable --out fails here, before the profiling
        tables = profile_variants(specs, source, args.tokens, seed=args.seed, batch_size=args.batch_size, bins=args.bins)
        synthetic = f"{source.label} (variants: {args.tokens:,} tokens, d_model {args.d_model})"
        # The model's own layers, calibrated on its own inputs, side by side with the synthetic variants.
        model_tables, atlas = {}, None
        if args.model:
            settings, model_tables, layers = _model_layers(args, info, memory)
            atlas, positions_note = _atlas(args, info, layers, settings, model_tables)
        tables.update(model_tables)
        measured = _model_measured(args, model_tables)
        meta = {
            "command": "ffnquant profile",
            "source": source.to_dict(),
            # what each group of columns was measured on: the report's header states it
            "source_label": synthetic + (f"; {measured['summary']}" if measured else ""),
            "model_measured": measured,
            "n_tokens": args.tokens,
            "seed": args.seed,
            "d_model": args.d_model,
            "bins": args.bins,
            "batch_size": args.batch_size,
            "variants": list(tables),
            "model": args.model,
            "model_layers": args.layers if args.model else None,
            "memory": memory.to_dict() if memory is not None else None,
        }
        paths = {k: tx.final(p) for k, p in write_range_report(tables, out, meta).items()}
        if atlas is not None:  # the layer atlas beside the range report, in the same transaction
            from ..report.atlas import write_atlas

            atlas_meta = {"command": "ffnquant profile", "model": args.model, "model_measured": measured,
                          "positions_measured_on": positions_note}
            paths.update({f"atlas_{k}": tx.final(p) for k, p in write_atlas(atlas, out, meta=atlas_meta).items()})

    print(f"activation ranges: {len(specs)} variant(s) on {args.tokens:,} tokens of {source.label}, "
          f"d_model {args.d_model}, random weights of seed {args.seed}")
    if measured:
        print(f"model layers: {measured['summary']}, trained weights")
        for line in token_notes([measured.get("calibration_text")]):
            print(line)
        if memory is not None:
            print(f"memory: {memory.summary()}")
    headers = ["variant"] + [f"{s} crest/kurt" for s in SITES] + ["hidden zeros", "dead"]
    rows = []
    for v, t in tables.items():
        hidden = t["hidden"] if "hidden" in t else None
        rows.append(
            [v] + [_cell(t, s) for s in SITES]
            + ([f"{100 * hidden.zero_fraction:.1f}%", hidden.dead_units] if hidden else ["-", "-"])
        )
    print(text_table(headers, rows))
    print()
    print("findings:")
    for f in findings(tables):
        print(f"- {f['text']}")
    print("claims:")
    for c in claims(tables):
        print(f"- [{c['status']}] {c['claim']} ({c['detail']})")
    if atlas is not None:
        print()
        print(f"layer atlas, hardest layer per site; token positions {positions_note}")
        for line in _atlas_lines(atlas):
            print(line)
    print()
    for key, path in paths.items():
        print(f"wrote {path}")
    return 0
