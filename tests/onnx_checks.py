"""ONNX artifact checks that depend on this CPU's int8 kernels (ffnquant.onnx.ortcpu measures them).

On x86 CPUs without VNNI onnxruntime's u8 x s8 kernel saturates 16-bit pair sums: an artifact then
runs worse than its graph computes. The graph's own figure (`accuracy_onnx_graph`, graph optimizations
off) is what an artifact is checked against there; the kernel's figure is what the reports show as run.
"""

from __future__ import annotations

from typing import Any, Mapping

from ffnquant.onnx.ortcpu import int8_kernels


def graph_db(item: Mapping[str, Any]) -> float:
    """The SQNR (dB) an ONNX artifact's graph computes, from a quantize result's artifact dict or a report row;
    where this CPU's kernel differs, the graph's own figure, and the note must say why."""
    kernel, graph = item.get("int8_kernel"), item.get("accuracy_onnx_graph", {}).get("sqnr_db", item.get("onnx_graph_sqnr_db"))
    ran = item["accuracy_onnx"]["sqnr_db"] if "accuracy_onnx" in item else item["onnx_sqnr_db"]
    if graph is None:
        assert kernel is None
        return ran
    assert not (int8_kernels().u8_exact and int8_kernels().s8_exact), "a graph figure on a CPU whose kernels are exact"
    assert "saturate" in kernel and ran is not None
    return graph


def graph_session(path, activation: str = "uint8"):
    """An onnxruntime CPU session that computes the artifact's graph exactly: ffnquant's own session where
    this CPU's kernel for `activation` is exact, the as-written session (no kernel fused in) where it saturates."""
    from ffnquant.onnx.onnxquant import ort_session

    return ort_session(path, as_written=not int8_kernels().exact(activation))
