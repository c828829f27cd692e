"""Per-layer quantization plans for a real model: candidates, a search under an end-to-end target, verification.

`target` (what must hold: `ppl+1%`, `sqnr>=30`, and the objective), `search` (the multiple-choice knapsack),
`candidates` (each layer's recipes scored), `sensitivity` (what a layer's error costs end to end),
`latency_table` (each candidate timed at the model's shapes on onnxruntime), `runtime_latency` (the same on
torch, Triton or bitsandbytes kernels, CPU or GPU), `planfile` (plan.toml), `job` (the whole loop).
"""

from .planfile import Plan, load_plan
from .target import Objective, Target

__all__ = ["Plan", "load_plan", "Target", "Objective"]
