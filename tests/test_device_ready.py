"""`scripts/gpu_bench.sh --dry-run` under the GPU device image's packages only.

The device has no package registry, so an import of something its image lacks kills a paid-for
lease. These tests run the dry run in a Python whose imports are restricted to the image's list
(scripts/device_image_packages.txt), the wheels scripts/fetch_gpu_wheels.sh carries, the stdlib
and ffnquant: a `sitecustomize.py` put first on PYTHONPATH installs a `sys.meta_path` finder that
refuses every other distribution installed here with "... (not on the device image)".
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
PACKAGE_LIST = REPO / "scripts" / "device_image_packages.txt"
# What travels in .whl/ (scripts/fetch_gpu_wheels.sh), and the package under test itself.
CARRIED = ("bitsandbytes", "tomli-w", "ffnquant")
# Here onnxruntime is imported from the onnxruntime-gpu distribution; the device has the CPU
# `onnxruntime` distribution, which is imported under the same name.
ALLOWED_IMPORTS = frozenset({"onnxruntime"})
# Distributions on the image whose version here is newer and needs packages the image's version does not: their
# own requirements (as installed here, transitively) are theirs, not ffnquant's. huggingface_hub 2.x (here, under
# transformers 5.25) speaks HTTP through httpx2/httpcore2/truststore; the image's 1.x uses httpx.
NEWER_HERE = ("huggingface-hub",)
# This machine runs an older Python than the device's 3.12, whose stdlib dropped these.
# (distutils is left alone: setuptools' shim provides it on 3.12 too.)
REMOVED_IN_PY312 = frozenset({"asynchat", "asyncore", "imp", "smtpd"})
# ffnquant imports that may fail on the device, each behind a guard with a clear message.
OPTIONAL_IMPORTS = {
    "jsonschema": "ffnquant.report.validate_report only (the test extra)",
    "tomli": "Python < 3.11 only; the device has tomllib",
    "psutil": "ffnquant.infra.resources.available_memory only where /proc/meminfo is absent (not Linux); guarded",
    "compressed_tensors": "export --format compressed-tensors only (the deploy extra); deploy.ctensors says how to install it",
    "ray": "--executor ray only (the ray extra); imported lazily, and its absence is a one-line error",
    "loguru": "compressed-tensors' logger, quieted by thirdparty.quiet_model_io when present; guarded",
    "datasets": "parquet / save_to_disk texts only (the data extra); hf.corpus.datasets_module says how to install it",
    "onnxruntime_genai": "the ONNX export's genai check only; deploy.genai.genai_unavailable says how to install it",
}
MARK = "not on the device image"
# optional imports of the device's own packages that are not on the device image (tried, and done without there)
OPTIONAL_OF_ALLOWED = {"kernels"}
LOG_VAR = "DEVICE_IMAGE_BLOCK_LOG"


def _norm(dist: str) -> str:
    """PEP 503 name: 'Tomli_W' and 'tomli-w' are one distribution."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def device_distributions() -> set[str]:
    """Normalised distribution names importable on the device: the image's list plus what we carry."""
    names = set(CARRIED)
    for line in PACKAGE_LIST.read_text(encoding="utf-8").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.add(line)
    return {_norm(n) for n in names}


def _requirements_closure(dists: tuple[str, ...]) -> set[str]:
    """Normalised names of what `dists`, as installed here, require, transitively (extras left out)."""
    seen, todo = set(), [_norm(d) for d in dists]
    while todo:
        name = todo.pop()
        try:
            reqs = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in reqs:
            req = Requirement(text)
            # the device's Python 3.12, no extras
            if req.marker is not None and not req.marker.evaluate({"python_version": "3.12", "extra": ""}):
                continue
            dep = _norm(req.name)
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def blocked_imports() -> set[str]:
    """Top-level import names that only distributions missing from the device provide."""
    allowed = device_distributions() | _requirements_closure(NEWER_HERE)
    blocked = set(REMOVED_IN_PY312) if sys.version_info < (3, 12) else set()
    for module, dists in importlib.metadata.packages_distributions().items():
        if module in sys.stdlib_module_names or module in ALLOWED_IMPORTS:
            continue
        # a namespace shared with an allowed distribution (nvidia.*, say) stays importable
        if not any(_norm(d) in allowed for d in dists):
            blocked.add(module)
    return blocked


# Kept small and free of third-party imports: it runs at the start of every Python the dry run
# starts. BLOCKED is filled in by the test; blocked attempts are appended to $DEVICE_IMAGE_BLOCK_LOG.
_SITECUSTOMIZE = '''\
"""Refuse imports of packages the GPU device image lacks (written by tests/test_device_ready.py)."""
import importlib.util
import os
import sys

BLOCKED = frozenset(%(blocked)r)
_MARK = %(mark)r


def _importer():
    """The first frame outside importlib and this file: who asked for the module."""
    f = sys._getframe(2)
    while f is not None and (
        f.f_code.co_filename.startswith("<frozen") or "importlib" in f.f_code.co_filename
        or f.f_code.co_filename == __file__
    ):
        f = f.f_back
    return "?" if f is None else f"{f.f_globals.get('__name__')} ({f.f_code.co_filename}:{f.f_lineno})"


def _log(kind, name):
    path = os.environ.get(%(log_var)r)
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(f"{kind}\\t{name}\\t{_importer()}\\n")


class DeviceImageFinder:
    """First on sys.meta_path: a blocked top-level name fails as it would on the device."""

    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if path is None and fullname in BLOCKED:
            _log("import", fullname)
            raise ModuleNotFoundError(f"No module named {fullname!r} ({_MARK})", name=fullname)
        return None


_find_spec = importlib.util.find_spec


def find_spec(name, package=None):
    """Availability probes get None, as on the device, instead of the finder's error."""
    if not name.startswith(".") and name.partition(".")[0] in BLOCKED:
        _log("probe", name)
        return None
    return _find_spec(name, package)


importlib.util.find_spec = find_spec
sys.meta_path.insert(0, DeviceImageFinder)
# .pth files run before this file; anything blocked they imported got past the finder.
_early = sorted(BLOCKED.intersection(sys.modules))
if _early:
    print(f"sitecustomize: {_early} were imported before the blocker and are {_MARK}", file=sys.stderr)
'''


@pytest.fixture(scope="module")
def restricted_env(tmp_path_factory) -> dict[str, str]:
    """Environment whose Pythons can import only what the device image (plus .whl/) has."""
    site_dir = tmp_path_factory.mktemp("device_image_site")
    blocked = sorted(blocked_imports())
    (site_dir / "sitecustomize.py").write_text(
        _SITECUSTOMIZE % {"blocked": blocked, "mark": MARK, "log_var": LOG_VAR}, encoding="utf-8"
    )
    # the caller's own overrides of gpu_bench.sh's knobs would change what is tested
    knobs = {"OUT", "NAME", "D_MODEL", "RUNTIMES", "SCHEMES", "VARIANTS", "TOKENS", "BUDGET_S", "MAX_TOTAL_S"}
    env = {k: v for k, v in os.environ.items() if k not in knobs}
    # first on the path so this sitecustomize wins; the repo next, as gpu_bench.sh puts it too
    env["PYTHONPATH"] = os.pathsep.join([str(site_dir), str(REPO)])
    env["PYTHON"] = sys.executable  # gpu_bench.sh's interpreter: the one running these tests
    env["MPLBACKEND"] = "Agg"
    env[LOG_VAR] = str(site_dir / "blocked.log")
    return env


def _blocked_log(env: dict[str, str]) -> str:
    path = Path(env[LOG_VAR])
    return path.read_text(encoding="utf-8") if path.exists() else ""


def test_package_list_is_well_formed():
    """One known distribution per line; the carried wheels are not on the image already."""
    names = device_distributions()
    assert {"torch", "numpy", "onnx", "onnxruntime", "safetensors", "matplotlib", "rich"} <= names
    assert all(re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", n) for n in names)
    blocked = blocked_imports()
    assert "jsonschema" in blocked  # installed here (the test extra), absent there
    assert not {"numpy", "torch", "onnxruntime", "bitsandbytes", "tomli_w", "ffnquant"} & blocked


@pytest.mark.parametrize(
    ("statement", "ok"),
    [
        ("import jsonschema", False),
        ("import jsonschema.validators", False),
        ("import importlib.util as u; assert u.find_spec('jsonschema') is None", True),
        ("import numpy", True),
        ("import bitsandbytes, tomli_w", True),
        ("import onnxruntime", True),
        ("import json, tomllib", True),
        ("import ffnquant.runtimes", True),
    ],
    ids=lambda v: v if isinstance(v, str) else ("allowed" if v else "refused"),
)
def test_blocker(restricted_env, statement, ok):
    """The sitecustomize refuses what the device lacks, with the message, and nothing else."""
    proc = subprocess.run(
        [sys.executable, "-c", statement], env=restricted_env, capture_output=True, text=True, timeout=60
    )
    if ok:
        assert proc.returncode == 0, proc.stderr
        # a package may try an optional dependency the device lacks and go on without it, as it does there
        # (bitsandbytes tries `kernels`, which transformers >= 5.25 installs here): only such a name may be refused
        refused = set(re.findall(r"'([\w.]+)' \(" + MARK, proc.stderr))
        assert refused <= OPTIONAL_OF_ALLOWED, proc.stderr
    else:
        assert proc.returncode != 0
        assert "ModuleNotFoundError" in proc.stderr and MARK in proc.stderr, proc.stderr


def test_ffnquant_imports_only_what_the_device_has():
    """Every import statement in ffnquant, CUDA-only paths included, names a device package.

    The dry run on a CPU skips the code behind CUDA-only runtimes; this reads the source instead.
    """
    blocked = blocked_imports()
    installed = importlib.metadata.packages_distributions()
    missing = {}
    for path in sorted((REPO / "ffnquant").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                tops = [a.name.partition(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = [node.module.partition(".")[0]]
            else:
                continue
            for top in tops:
                known = top in sys.stdlib_module_names or top == "ffnquant" or top in installed
                if top not in OPTIONAL_IMPORTS and (top in blocked or not known):
                    missing.setdefault(top, []).append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not missing, f"imports {MARK} (add the wheel to scripts/fetch_gpu_wheels.sh or guard them): {missing}"


@pytest.mark.slow
def test_gpu_bench_dry_run_imports_only_what_the_device_has(restricted_env, tmp_path):
    """The dry run (same code paths as the GPU run) finishes and reports under the device's packages."""
    out = tmp_path / "out"
    env = {
        **restricted_env,
        "OUT": str(out),
        # shortened: one variant, one token count, tiny budgets; runtimes and schemes stay
        # the script's defaults so every runtime's import path is exercised
        "VARIANTS": "swiglu",
        "TOKENS": "1",
        "BUDGET_S": "0.005",
        "MAX_TOTAL_S": "60",
    }
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu_bench.sh"), "--dry-run"],
        env=env, capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    output = proc.stdout + proc.stderr
    blocked = _blocked_log(env)
    detail = f"\n--- blocked attempts (kind, module, importer) ---\n{blocked}\n--- output tail ---\n{output[-6000:]}"
    assert proc.returncode == 0, f"dry run exited {proc.returncode}{detail}"
    assert MARK not in output, f"the dry run needed a package the device image lacks{detail}"
    for suffix in (".md", ".json"):
        report = out / f"latency_gpu_dryrun{suffix}"
        assert report.is_file() and report.stat().st_size > 0, f"no {report.name}{detail}"
    assert MARK not in (out / "latency_gpu_dryrun.md").read_text(encoding="utf-8"), detail


@pytest.mark.slow
def test_gpu_session_dry_run_runs_every_stage_under_the_device_packages(restricted_env, tmp_path):
    """`scripts/gpu_session.sh --dry-run`: a tiny random model planned by the engine (--device cpu), the kernel
    benchmarks (Triton's interpreter) and the plan's latency table (torch-cpu) run to their reports under the
    device's packages; the sweep's dry run is the test above."""
    out = tmp_path / "out"
    env = {**restricted_env, "OUT": str(out), "SKIP_SWEEP": "1"}
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_session.sh"), "--dry-run"],
                          env=env, capture_output=True, text=True, timeout=400, cwd=REPO)
    output = proc.stdout + proc.stderr
    blocked = _blocked_log(env)
    logs = "".join(f"\n--- {p.name} ---\n{p.read_text(encoding='utf-8')[-3000:]}" for p in sorted(out.glob("*.log")))
    detail = f"\n--- blocked ---\n{blocked}\n--- output ---\n{output[-4000:]}{logs}"
    assert proc.returncode == 0, detail
    session = (out / "session.log").read_text(encoding="utf-8")
    for stage in ("engine_cuda", "w4a16_kernels", "actquant_kernels", "gpu_plan_latency"):
        assert re.search(rf"{stage}: exit 0 after \d+ s", session), f"{stage} failed{detail}"
    assert MARK not in output + logs, f"a stage needed a package the device image lacks{detail}"
    for report in ("engine-cuda", "w4a16-kernels", "actquant-kernels", "gpu-plan-latency"):
        folder = out / report
        assert any(folder.glob("*.json")) and any(folder.glob("*.md")), f"no report in {folder}{detail}"
    assert "session: " in session
