"""The main job as a pipeline of stages: profile, quantize, export, benchmark and report.

- `config`: `RunConfig` (frozen, validated, TOML round trip) and `load_config`;
- `variants`: every recipe of one FFN quantized, exported and scored;
- `model`: a real model's FFN layers (captured inputs, per layer, end to end);
- `latency`: the runtimes' timings of the same recipes;
- `findings`: range section, recommendations and findings from the measured rows;
- `document`: the report document; `job`: `run(config)`, the orchestration and the one reader of the
  RunConfig (each stage receives the fields it uses, not the config).
"""

from __future__ import annotations

from ..recipe import Recipe, parse_recipe
from .config import CONFIG_VERSION, DEFAULT_SCHEMES, DEFAULT_TOKENS, FLOAT_BASELINES, RunConfig, load_config
from .job import run
from .results import Progress, RunResult

__all__ = [
    "CONFIG_VERSION", "DEFAULT_SCHEMES", "DEFAULT_TOKENS", "FLOAT_BASELINES", "Progress", "Recipe", "RunConfig",
    "RunResult", "load_config", "parse_recipe", "run",
]
