"""ffnquant/__init__.py: importing the package sets MKL's conditional numerical reproducibility before torch loads
MKL (the same run gives the same figures), and keeps a caller's own setting."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("given, expected", [(None, "AUTO,STRICT"), ("COMPATIBLE", "COMPATIBLE")],
                         ids=["unset", "caller-set"])
def test_importing_ffnquant_makes_mkl_reproducible_unless_the_caller_said_otherwise(given, expected):
    env = {k: v for k, v in os.environ.items() if k != "MKL_CBWR"}
    if given is not None:
        env["MKL_CBWR"] = given
    code = "import os, sys, ffnquant; print(os.environ['MKL_CBWR'], 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == [expected, "False"]  # set before torch (and so MKL) is loaded
