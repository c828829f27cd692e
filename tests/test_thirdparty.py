"""Third-party noise: importing onnxruntime's MatMulNBits quantizer through ffnquant leaves logging as it was."""

from __future__ import annotations

import subprocess
import sys

import pytest

CHECK = """
import logging
root = logging.getLogger()
before = (root.level, list(root.handlers))
from ffnquant.infra.thirdparty import matmul_nbits_quantizer
mnq = matmul_nbits_quantizer()
assert hasattr(mnq, "MatMulNBitsQuantizer")
assert (root.level, list(root.handlers)) == before, (root.level, root.handlers)
assert logging.getLogger(mnq.__name__).getEffectiveLevel() >= logging.WARNING
logging.getLogger("onnx_ir.passes").info("must not be printed")
"""


def test_the_quantizer_import_does_not_turn_on_info_logging():
    """onnxruntime calls logging.basicConfig(level=INFO) at import: every library's INFO lines (its own
    'start to quantize node', onnx_ir's passes) then reached the user's terminal."""
    pytest.importorskip("onnxruntime")
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "must not be printed" not in out.stderr and "[INFO]" not in out.stderr


def test_a_loaders_report_is_kept_off_the_terminal_and_its_error_line_on_the_exception(capsys):
    """transformers prints why a conversion failed in its loading report (through its logger's handler, which holds
    the process's stderr) and raises a RuntimeError pointing 'above': inside quiet_model_io the report stays off
    the terminal, and its 'Error:' line is what the caller can say."""
    import logging

    from ffnquant.infra.thirdparty import captured_detail, quiet_model_io

    pytest.importorskip("transformers")  # its logging sets up the library's logger once, on first import
    logger = logging.getLogger("transformers.core_model_loading")
    top = logging.getLogger("transformers")
    before = top.level
    top.setLevel(logging.ERROR)  # a caller's verbosity (the harness sets errors only): the warning is still read
    try:
        with pytest.raises(RuntimeError) as caught:
            with quiet_model_io():
                logger.warning("Key | Status\nError: Concatenate on tensors destined for x.conv1d.weight. Ckpt contains: 0")
                raise RuntimeError("look at the CONVERSION entries of the above report!")
        assert top.level == logging.ERROR
    finally:
        top.setLevel(before)
    assert captured_detail(caught.value) == "Concatenate on tensors destined for x.conv1d.weight. Ckpt contains: 0"
    assert "Concatenate" not in capsys.readouterr().err
    assert captured_detail(RuntimeError("raised elsewhere")) == ""
