"""Third-party noise kept out of the user's terminal: log records of libraries ffnquant uses that ask the
user to do something ffnquant does not need (filtered by name and text, never silenced wholesale)."""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Iterator

__all__ = ["captured_detail", "quiet_bitsandbytes", "matmul_nbits_quantizer", "quiet_model_io"]


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


@contextlib.contextmanager
def quiet_model_io() -> Iterator[None]:
    """Progress bars and info logs of transformers and compressed-tensors kept off the terminal while ffnquant
    writes or loads a model folder (ffnquant's commands show their own progress). compressed-tensors draws tqdm
    bars it has no switch for, so the block's stderr is captured; its loguru logger and transformers' progress
    bar are switched off and restored afterwards. Exceptions still propagate with their messages."""
    restore_bar = False
    try:
        import transformers.utils.logging as tl

        restore_bar = tl.is_progress_bar_enabled()
        tl.disable_progress_bar()
    except ImportError:
        tl = None
    try:
        from loguru import logger as loguru_logger
    except ImportError:
        loguru_logger = None
    if loguru_logger is not None:
        loguru_logger.disable("compressed_tensors")
    captured = io.StringIO()
    # transformers' logger writes through a handler holding the process's stderr: its records (a loading report)
    # go to the capture instead, the terminal kept clear
    handler = logging.StreamHandler(captured)
    tlogger = logging.getLogger("transformers")
    handlers, tlogger.handlers = tlogger.handlers, [handler]
    # at warning level while captured, whatever verbosity the caller set: the report is read, never shown
    level = tlogger.level
    tlogger.setLevel(min(level or logging.WARNING, logging.WARNING))
    try:
        with contextlib.redirect_stderr(captured):
            yield
    except Exception as exc:
        # what the library printed before raising (transformers' loading report names the tensors a conversion
        # failed on): kept on the exception for the caller's one line (`captured_detail`)
        exc.ffnquant_stderr = captured.getvalue()  # type: ignore[attr-defined]
        raise
    finally:
        tlogger.handlers = handlers
        tlogger.setLevel(level)
        if tl is not None and restore_bar:
            tl.enable_progress_bar()
        if loguru_logger is not None:
            loguru_logger.enable("compressed_tensors")


def captured_detail(exc: BaseException) -> str:
    """The first 'Error: ...' line a library printed before raising `exc` inside `quiet_model_io` (transformers'
    loading report: "Concatenate on tensors destined for ... Ckpt contains: 0"), or ''."""
    text = getattr(exc, "ffnquant_stderr", "") or ""
    return next((line.strip()[len("Error:"):].strip() for line in text.splitlines()
                 if line.strip().startswith("Error:")), "")
