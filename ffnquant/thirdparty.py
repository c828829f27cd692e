"""Third-party noise kept out of the user's terminal: log records of libraries ffnquant uses that ask the
user to do something ffnquant does not need (filtered by name and text, never silenced wholesale)."""

from __future__ import annotations

import logging

__all__ = ["quiet_bitsandbytes", "matmul_nbits_quantizer"]


# bitsandbytes' CPU backend logs a warning at import when the optional `kernels` package (a Hub
# kernel loader ffnquant does not use) is missing, asking the user to `pip install kernels`; its own
# native CPU kernels run either way. That line is third-party noise in ffnquant's terminal output.
_NOISY_LOGGERS = ("bitsandbytes.backends.cpu.ops", "bitsandbytes.backends.mps.ops")
_NOISE = ("pip install kernels", "from kernels-community")


class _KernelsNoiseFilter(logging.Filter):
    """Drops bitsandbytes' 'pip install kernels' records; every other record passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a malformed record is not ours to judge
            return True
        return not any(n in message for n in _NOISE)


_FILTER = _KernelsNoiseFilter()


def quiet_bitsandbytes() -> None:
    """Filter bitsandbytes' 'pip install kernels' warning out of logging (idempotent, imports nothing).

    Call before anything imports bitsandbytes: the warning is logged once, at import.
    """
    for name in _NOISY_LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)


def matmul_nbits_quantizer():
    """onnxruntime's MatMulNBits quantizer module, imported without its side effect on logging.

    At import it calls `logging.basicConfig(level=INFO)`, after which every INFO record of every
    library (its own "start to quantize node ..." lines, onnx_ir's exporter passes) reaches the
    user's terminal. The root logger's level and handlers are put back as they were, and the
    quantizer's own logger keeps warnings only.
    """
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    from onnxruntime.quantization import matmul_nbits_quantizer as module

    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    logging.getLogger(module.__name__).setLevel(logging.WARNING)
    return module
