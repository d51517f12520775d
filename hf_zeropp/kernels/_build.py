"""Compile the C++ (CPU) and CUDA kernel extensions on first use with torch.utils.cpp_extension, and cache them.

``pip install`` compiles nothing: the sources ship with the package and are built the first time a backend is
asked for (or ahead of time by ``python -m hf_zeropp.kernels build``). torch keys its build cache on the sources
and flags, so an edited kernel is rebuilt and an unchanged one is loaded in well under a second. A failed build
warns once and leaves the reference backend in charge; asking for the failed backend by name raises with the
compiler's message.
"""

from __future__ import annotations

import os
import shutil
import threading
import warnings
from pathlib import Path
from types import ModuleType

import torch

CPU_EXTENSION = "hf_zeropp_cpu_kernels"
CUDA_EXTENSION = "hf_zeropp_cuda_kernels"

# Single roundings everywhere: contraction into FMA would make compiled results differ from the reference.
CPU_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17"]
CUDA_CFLAGS = ["-O3", "--fmad=false", "-std=c++17"]

_lock = threading.Lock()
_loaded: dict[str, ModuleType] = {}
_failures: dict[str, str] = {}


def source_dir() -> Path:
    """Kernel sources: ``hf_zeropp/_csrc`` in an installed wheel, the repository's ``cuda/`` in a checkout."""
    package = Path(__file__).resolve().parent.parent
    for candidate in (package / "_csrc", package.parent / "cuda"):
        if (candidate / "cpu_kernels.cpp").is_file():
            return candidate
    raise FileNotFoundError(
        f"hf_zeropp kernel sources not found next to {package} (looked for _csrc/ and ../cuda/); "
        "reinstall hf_zeropp from a checkout with `pip install -e .`"
    )


def cuda_arch_flags() -> list[str]:
    """gencode flags for the visible GPUs (TORCH_CUDA_ARCH_LIST wins when set, as in torch's own builds)."""
    if os.environ.get("TORCH_CUDA_ARCH_LIST") or not torch.cuda.is_available():
        return []
    capabilities = {torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}
    return [f"-gencode=arch=compute_{a}{b},code=sm_{a}{b}" for a, b in sorted(capabilities)]


def _compile(name: str, verbose: bool) -> ModuleType:
    from torch.utils import cpp_extension

    sources = source_dir()
    if name == CPU_EXTENSION:
        return cpp_extension.load(
            name=name,
            sources=[str(sources / "cpu_kernels.cpp")],
            extra_cflags=CPU_CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=verbose,
        )
    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device is visible to torch")
    if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
        raise RuntimeError("nvcc not found; install the CUDA toolkit or set CUDA_HOME")
    return cpp_extension.load(
        name=name,
        sources=[str(sources / "cuda_binding.cpp"), str(sources / "quant_kernels.cu")],
        extra_cflags=["-O3", "-std=c++17"],
        extra_cuda_cflags=CUDA_CFLAGS + cuda_arch_flags(),
        verbose=verbose,
    )


def load(name: str, *, verbose: bool = False, raise_on_failure: bool = False) -> ModuleType | None:
    """The compiled extension ``name``, building it if needed; None (after one warning) if it cannot be built."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        if name not in _failures:
            try:
                _loaded[name] = _compile(name, verbose)
                return _loaded[name]
            except Exception as error:  # a compiler or toolchain problem must not stop training
                _failures[name] = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"hf_zeropp: could not build the {name} kernels ({_failures[name].splitlines()[0]}); "
                    "using the reference (plain torch) backend. Run `python -m hf_zeropp.kernels build` "
                    "for the full compiler output.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    if raise_on_failure:
        raise RuntimeError(f"hf_zeropp: the {name} kernels are unavailable: {_failures[name]}")
    return None


def failure(name: str) -> str | None:
    return _failures.get(name)
