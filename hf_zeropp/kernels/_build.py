"""Compile the C++ (CPU) and CUDA kernels on first use with torch.utils.cpp_extension, cache them, and load them into
the dispatcher as the CPU / CUDA kernels of ``torch.ops.hf_zeropp.*`` (:mod:`hf_zeropp.kernels.ops`).

``pip install`` compiles nothing: the sources ship with the package and are built the first time a backend is
asked for (or ahead of time by ``python -m hf_zeropp.kernels build``). The build is cached under a name that
carries a hash of every source file (headers included), the torch version and the flags: two checkouts or venvs
with the same sources share one build, and an edited kernel gets a new one — torch's own cache is keyed by the
extension name only, so with a fixed name they would rebuild each other's. A finished build is loaded directly
(``torch.ops.load_library``), without asking cpp_extension, whose ninja file names the source paths and would
rebuild for a checkout at another path. A failed build warns once and leaves
the reference (plain torch) kernels in charge; asking for the failed backend by name raises with the compiler's
message.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
import warnings
from pathlib import Path

import torch

CPU_EXTENSION = "hf_zeropp_cpu_kernels"
CUDA_EXTENSION = "hf_zeropp_cuda_kernels"
SOURCES = {CPU_EXTENSION: ["cpu_kernels.cpp"],
           CUDA_EXTENSION: ["cuda_binding.cpp", "quant_kernels.cu", "allocation_kernels.cu"]}

# Single roundings everywhere: contraction into FMA would make compiled results differ from the reference.
CPU_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=off", "-std=c++17"]
CUDA_CFLAGS = ["-O3", "--fmad=false", "-std=c++17"]

_lock = threading.Lock()
_loaded: dict[str, str] = {}  # extension -> path of the loaded library
_failures: dict[str, str] = {}


def source_dir() -> Path:
    """Kernel sources: ``HF_ZEROPP_KERNEL_SOURCES`` when set (another version of the kernels, built under its own
    hash, as scripts/gpu_check.sh does to time two versions on one machine), else ``hf_zeropp/_csrc`` in an
    installed wheel, else the repository's ``cuda/`` in a checkout."""
    if os.environ.get("HF_ZEROPP_KERNEL_SOURCES"):
        return Path(os.environ["HF_ZEROPP_KERNEL_SOURCES"]).resolve()
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


def extension_name(extension: str, sources: Path | None = None) -> str:
    """``extension`` plus a hash of every file in the source folder (headers too), the torch version and the flags:
    the build's identity, so equal sources share one cached build and any edit gets its own."""
    sources = sources or source_dir()
    digest = hashlib.sha256()
    headers = sorted(p.name for p in sources.iterdir() if p.suffix in (".h", ".cuh"))
    for file in [*SOURCES[extension], *headers]:
        digest.update(file.encode() + b"\0" + (sources / file).read_bytes() + b"\0")
    flags = (CPU_CFLAGS if extension == CPU_EXTENSION
             else [*CUDA_CFLAGS, *cuda_arch_flags(), os.environ.get("TORCH_CUDA_ARCH_LIST", "")])
    digest.update(" ".join([torch.__version__, str(torch.version.cuda), sys.version, *flags]).encode())
    return f"{extension}_{digest.hexdigest()[:16]}"


def cache_dir() -> Path:
    """Where builds live: ``HF_ZEROPP_KERNEL_CACHE``, else ``TORCH_EXTENSIONS_DIR``, else ``~/.cache/hf_zeropp``."""
    root = os.environ.get("HF_ZEROPP_KERNEL_CACHE") or os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "hf_zeropp" / "kernels"


def _compile(extension: str, verbose: bool, sources: Path | None = None) -> str:
    from torch.utils import cpp_extension

    if extension == CUDA_EXTENSION:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device is visible to torch")
        if shutil.which("nvcc") is None and not os.environ.get("CUDA_HOME"):
            raise RuntimeError("nvcc not found; install the CUDA toolkit or set CUDA_HOME")
    sources = sources or source_dir()
    name = extension_name(extension, sources)
    build_dir = cache_dir() / name
    library = build_dir / f"{name}.so"
    ready = build_dir / "ready"  # written once a build is complete: the library is whole and matches the name
    if ready.is_file():  # a cached build of these exact sources, maybe from another checkout: just load it
        torch.ops.load_library(str(library))
        return str(library)
    if os.environ.get("LOCAL_RANK", "0") == "0":  # the node's other ranks wait for this build (below)
        print(f"hf_zeropp: building the {extension} kernels into {build_dir} (~40 s, once per source version)",
              file=sys.stderr, flush=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    common = dict(name=name, sources=[str(sources / f) for f in SOURCES[extension]], build_directory=str(build_dir),
                  is_python_module=False, verbose=verbose)
    # cpp_extension builds under a lock file in build_dir (ranks starting together build once) and loads the library
    if extension == CPU_EXTENSION:
        cpp_extension.load(**common, extra_cflags=CPU_CFLAGS, extra_ldflags=["-fopenmp"])
    else:
        cpp_extension.load(**common, extra_cflags=["-O3", "-std=c++17"],
                           extra_cuda_cflags=CUDA_CFLAGS + cuda_arch_flags())
    partial = ready.with_name(f"ready.{os.getpid()}")
    partial.write_text(str(library))
    os.replace(partial, ready)
    return str(library)


def load(extension: str, *, verbose: bool = False, raise_on_failure: bool = False) -> bool:
    """Register the compiled kernels of ``extension`` with torch, building them if needed; False (after one
    warning) if they cannot be built."""
    if extension in _loaded:  # the common case, without the lock (and traceable by torch.compile)
        return True
    with _lock:
        if extension not in _loaded and extension not in _failures:
            try:
                _loaded[extension] = _compile(extension, verbose)
            except Exception as error:  # a compiler or toolchain problem must not stop training
                _failures[extension] = f"{type(error).__name__}: {error}"
                warnings.warn(
                    f"hf_zeropp: could not build the {extension} kernels ({_failures[extension].splitlines()[0]}); "
                    "using the reference (plain torch) kernels. Run `python -m hf_zeropp.kernels build` "
                    "for the full compiler output.",
                    RuntimeWarning,
                    stacklevel=3,
                )
    if extension in _loaded:
        return True
    if raise_on_failure:
        raise RuntimeError(f"hf_zeropp: the {extension} kernels are unavailable: {_failures[extension]}")
    return False


def failure(extension: str) -> str | None:
    return _failures.get(extension)
