"""`ffnquant export`: fp32 and fp16 ONNX for each variant, parity-checked against torch."""

from __future__ import annotations

import argparse

from ..atomic import OutputTransaction
from ..export import DEFAULT_OPSET, export_spec
from ..render import text_table
from .common import add_spec_arguments, specs_from_args

NAME = "export"
HELP = "export FFN variants to fp32/fp16 ONNX and check them against torch on onnxruntime"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)
    parser.add_argument("--out", default="export", help="output folder (default export/)")
    parser.add_argument("--dtypes", default="fp32,fp16", help="comma-separated: fp32, fp16 (default fp32,fp16)")
    parser.add_argument("--opset", type=int, default=DEFAULT_OPSET, help=f"ONNX opset, >= 17 (default {DEFAULT_OPSET})")


def run(args: argparse.Namespace) -> int:
    from ..errors import FFNQuantError

    specs = specs_from_args(args)  # validate everything before writing anything
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [d for d in dtypes if d not in ("fp32", "fp16")]
    if bad or not dtypes:
        raise FFNQuantError(f"unknown dtype(s) {bad or dtypes}; valid: fp32, fp16")
    if args.opset < 17:
        raise FFNQuantError(f"--opset must be >= 17, got {args.opset}")
    rows = []
    # every file is staged and moved into place only once all passed parity: a failure leaves --out as it was
    with OutputTransaction() as tx:
        out = tx.folder(args.out)
        for spec in specs:
            result = export_spec(spec, out, dtypes=dtypes, seed=args.seed, opset=args.opset)
            for dtype in dtypes:
                check = result.parity[dtype]
                rows.append(
                    (spec.variant.value, dtype, str(tx.final(result.paths[dtype])), check.max_abs_error, check.tolerance,
                     "pass" if check.passed else "FAIL", check.provider)
                )
    print(text_table(["variant", "dtype", "file", "max |onnx - torch|", "tolerance", "parity", "provider"], rows))
    return 0
