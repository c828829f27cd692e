"""Shared fixtures and the numpy reference of the seed formulas."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: N workers share the cores, torch's threads too
    import torch

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)))

# numpy versions of the seed texts' formulas, independent of torch.
_erf = np.vectorize(math.erf)


def np_activation(name: str, z: np.ndarray) -> np.ndarray:
    if name == "relu":
        return np.maximum(z, 0.0)
    if name == "gelu":
        return 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))
    if name == "gelu_tanh":
        return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z**3)))
    if name == "silu":
        return z / (1.0 + np.exp(-z))
    if name == "sigmoid":
        return 1.0 / (1.0 + np.exp(-z))
    if name == "identity":
        return z
    raise KeyError(name)


@pytest.fixture
def numpy_reference():
    return np_activation


@pytest.fixture
def recipe_parses(monkeypatch):
    """A list that grows by one text per `Recipe.parse` call (to check that a command parses a recipe once)."""
    from ffnquant.recipe import Recipe

    seen: list[str] = []
    real = Recipe.parse.__func__

    def counting(cls, text):
        seen.append(str(text))
        return real(cls, text)

    monkeypatch.setattr(Recipe, "parse", classmethod(counting))
    return seen


@pytest.fixture
def interpret(monkeypatch):
    """Triton's interpreter for this test only (CPU tensors): the kernel modules decorate their kernels per mode
    at first launch, so the variable only has to be set before it, and other tests keep their environment."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
