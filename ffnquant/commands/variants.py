"""`ffnquant variants`: the FFN family at a given width."""

from __future__ import annotations

import argparse

from ..infra.render import text_table
from .common import add_spec_arguments, specs_from_args

NAME = "variants"
HELP = "list the FFN variants with their widths, parameters and FLOPs per token"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_spec_arguments(parser)


def run(args: argparse.Namespace) -> int:
    rows = [
        (s.variant.value, s.n_matrices, s.d_ff, s.bias, s.n_params, s.flops_per_token)
        for s in specs_from_args(args)
    ]
    print(text_table(["variant", "matrices", "d_ff", "bias", "parameters", "FLOPs/token"], rows))
    return 0
