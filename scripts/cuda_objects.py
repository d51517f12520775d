"""Compile the CUDA kernels ahead, on a machine without a GPU, and link them on the GPU machine.

A lent GPU machine has minutes, not hours: there, nvcc spent about 4.5 of them compiling the kernel sources (four
versions in parallel), while linking them compiled ahead took 10 s. The ``.cu`` files include no torch header, so
they compile with nvcc alone; only the torch binding (``cuda_binding.cpp``) must be compiled against the GPU
machine's torch.

    python -m scripts.cuda_objects compile OUT [--arch 90]   # here: nvcc, same flags as the extension build
    python -m scripts.cuda_objects link OUT                  # there: binding + these objects, into the kernel cache

``link`` refuses objects compiled from other sources (the manifest holds each source's SHA-256) and writes the
library where :mod:`hf_zeropp.kernels._build` looks for a build of these exact sources, so the kernels then load as
if built there. scripts/gpu_check.sh uses it when given ``CUDA_OBJECTS``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import time
from pathlib import Path

from hf_zeropp.kernels import _build

MANIFEST = "manifest.json"
# torch's own flags for .cu files of an extension (cpp_extension.COMMON_NVCC_FLAGS), so the objects equal its build
TORCH_NVCC_FLAGS = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__", "--expt-relaxed-constexpr"]


def _kernel_sources() -> list[Path]:
    return [_build.source_dir() / name for name in _build.SOURCES[_build.CUDA_EXTENSION] if name.endswith(".cu")]


def _digests() -> dict[str, str]:
    """SHA-256 of every kernel source and header: an object is only as current as the headers it included."""
    folder = _build.source_dir()
    files = [*_kernel_sources(), *sorted(p for p in folder.iterdir() if p.suffix in (".h", ".cuh"))]
    return {path.name: hashlib.sha256(path.read_bytes()).hexdigest() for path in files}


def compile_objects(out: Path, arch: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    gencode = f"-gencode=arch=compute_{arch},code=sm_{arch}"
    jobs = []
    for source in _kernel_sources():
        command = ["nvcc", *_build.CUDA_CFLAGS, *TORCH_NVCC_FLAGS, gencode, "-Xcompiler", "-fPIC", "-c", str(source),
                   "-o", str(out / f"{source.stem}.o")]
        jobs.append((source.name, subprocess.Popen(command)))
    failed = [name for name, job in jobs if job.wait() != 0]
    if failed:
        sys.exit(f"nvcc failed on {', '.join(failed)}")
    (out / MANIFEST).write_text(json.dumps({"arch": arch, "sources": _digests()}, indent=2))
    print(f"compiled {len(jobs)} kernel sources for sm_{arch} into {out}")


def link_objects(out: Path) -> None:
    import torch
    from torch.utils import cpp_extension

    manifest = json.loads((out / MANIFEST).read_text())
    stale = sorted(name for name, digest in _digests().items() if manifest["sources"].get(name) != digest)
    if stale:
        sys.exit(f"{out} was compiled from other versions of {', '.join(stale)}; run `compile` again")
    if not torch.cuda.is_available():
        sys.exit("no CUDA device is visible: link on the GPU machine")
    major, minor = torch.cuda.get_device_capability()
    if f"{major}{minor}" != manifest["arch"]:
        sys.exit(f"{out} holds sm_{manifest['arch']} code but this GPU is sm_{major}{minor}; compile with "
                 f"--arch {major}{minor}")
    name = _build.extension_name(_build.CUDA_EXTENSION)
    build_dir = _build.cache_dir() / name
    build_dir.mkdir(parents=True, exist_ok=True)
    objects = [str((out / f"{source.stem}.o").resolve()) for source in _kernel_sources()]
    start = time.time()
    cpp_extension.load(name=name, sources=[str(_build.source_dir() / "cuda_binding.cpp")],
                       build_directory=str(build_dir), is_python_module=False, with_cuda=True,
                       extra_cflags=["-O3", "-std=c++17"], extra_ldflags=[*objects, "-lcudart"])
    (build_dir / "ready").write_text(str(build_dir / f"{name}.so"))
    print(f"linked {name} from {len(objects)} objects (sm_{manifest['arch']}) in {time.time() - start:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("action", choices=["compile", "link"])
    parser.add_argument("out", type=Path, help="folder of the objects and their manifest")
    parser.add_argument("--arch", default="90", help="compute capability for compile, e.g. 90 (H100/H200)")
    args = parser.parse_args()
    if args.action == "compile":
        compile_objects(args.out, args.arch)
    else:
        link_objects(args.out)


if __name__ == "__main__":
    main()
