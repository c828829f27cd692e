"""Argument helpers shared by the subcommands, so every command parses sizes and variants alike."""

from __future__ import annotations

import argparse

from ..errors import FFNQuantError
from ..spec import FFNSpec, Variant, parse_variants

__all__ = ["add_spec_arguments", "specs_from_args", "positive_int"]


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_spec_arguments(parser: argparse.ArgumentParser, default_variants: str = "all") -> None:
    """--variants, --d-model, --d-ff, --multiple-of, --ffn-dim-multiplier, --bias/--no-bias, --seed."""
    valid = ", ".join(v.value for v in Variant)
    parser.add_argument("--variants", default=default_variants, help=f"comma-separated variants or 'all' ({valid})")
    parser.add_argument("--d-model", type=positive_int, default=512, help="model width d (default 512)")
    parser.add_argument("--d-ff", type=positive_int, default=None, help="FFN width (default: the width rule)")
    parser.add_argument("--multiple-of", type=positive_int, default=None, help="round gated d_ff up to this (default 128)")
    parser.add_argument("--ffn-dim-multiplier", type=float, default=None, help="Llama 3's multiplier on the gated width")
    bias = parser.add_mutually_exclusive_group()
    bias.add_argument("--bias", dest="bias", action="store_true", default=None, help="force biases on")
    bias.add_argument("--no-bias", dest="bias", action="store_false", help="force biases off")
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed (default 0)")


def specs_from_args(args: argparse.Namespace) -> list[FFNSpec]:
    """The FFNSpecs the arguments describe, validated."""
    variants = parse_variants(args.variants)
    if args.d_ff is not None and args.ffn_dim_multiplier is not None:
        raise FFNQuantError("--d-ff and --ffn-dim-multiplier are exclusive: give the width or the rule's multiplier")
    return [
        FFNSpec(
            v,
            d_model=args.d_model,
            d_ff=args.d_ff,
            bias=args.bias,
            multiple_of=args.multiple_of,
            ffn_dim_multiplier=args.ffn_dim_multiplier,
        )
        for v in variants
    ]
