"""The kernels as torch custom ops: schemas and fake implementations pass ``torch.library.opcheck``, the profiler
names them, ``torch.compile`` traces through them (a compiled model under ZeRO++: tests/engine/test_compile.py), and the
kernel build is cached by its sources (two checkouts share one build)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_zeropp
import hf_zeropp.kernels as K
from hf_zeropp.kernels import _build
from hf_zeropp.kernels import ops as ops_module

pytestmark = pytest.mark.skipif(K.active_backend("cpu") != "cpp", reason="the cpp kernels did not build here")


def _samples():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 300, generator=g).to(torch.bfloat16)
    stacked8 = K.quantize(torch.randn(2, 3, 300, generator=g), 8, 64)
    stacked4 = K.quantize(torch.randn(2, 3, 300, generator=g), 4, 64)
    ops = torch.ops.hf_zeropp
    return [
        (ops.quantize.default, (x, 8, 64, False, 0, 0)),
        (ops.quantize.default, (x.float(), 4, 64, True, 7, 32)),
        (ops.dequantize.default, (*K.quantize(x, 4, 64), 4, 64, 0, torch.empty(3, 300))),
        (ops.dequantize.default, (*K.quantize(x, 8, 64, hadamard=16), 8, 64, 16, torch.empty(3, 300,
                                                                                               dtype=torch.bfloat16))),
        (ops.swizzle_quantize.default, (x.reshape(-1), 2, 3, 2, 4, 32, False, 0, 0)),
        (ops.swizzle_quantize.default, (x.float().reshape(-1), 3, 1, 1, 8, 64, True, 3, 64)),
        (ops.dequant_reduce_quant.default, (*stacked8, 8, 64, 300, 4, False, 0)),
        (ops.dequant_reduce_quant.default, (*stacked4, 4, 64, 300, 8, True, 5)),
        (ops.dequant_reduce.default, (*stacked4, 4, 64, 0.25, 0, torch.empty(3, 300))),
        (ops.dequant_reduce.default, (*stacked8, 8, 64, 1.0, 64, torch.empty(3, 300, dtype=torch.float16))),
        (ops.quantize_allocated.default, (x.float(), 4, 64, False, 0, 0)),
        (ops.quantize_allocated.default, (x.float() * torch.logspace(-3, 3, 300), 8, 32, True, 9, 2)),
        (ops.dequantize_allocated.default, (*K.quantize_allocated(x, 4, 64, floor=3), 4, 64, 3, torch.empty(3, 300))),
    ]


@pytest.mark.parametrize("index", range(13))
def test_opcheck(index):
    op, args = _samples()[index]
    torch.library.opcheck(op, args)


def test_the_compiled_kernels_are_the_registered_cpu_kernels_and_equal_the_reference():
    for op in ops_module.SCHEMAS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"hf_zeropp::{op}", "CPU"), op
    x = torch.randn(4, 1000)
    through_dispatcher = torch.ops.hf_zeropp.quantize(x, 4, 128, True, 11, 0)
    assert torch._C._dispatch_has_kernel_for_dispatch_key("hf_zeropp::quantize", "CPU")
    reference = K.quantize(x, 4, 128, stochastic=True, seed=11, backend="reference")
    assert torch.equal(through_dispatcher[0], reference.codes) and torch.equal(through_dispatcher[1], reference.scales)


@pytest.mark.parametrize("backend", ["cpp", "reference"])
def test_the_profiler_names_every_kernel(backend):
    x = torch.randn(2, 512)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        q = K.quantize(x, 4, 64, backend=backend)
        K.dequantize(*q, bits=4, block_size=64, length=512, backend=backend)
        s = K.swizzle_quantize(x.reshape(-1), 2, 2, 1, 4, 64, backend=backend)
        stacked = s.codes.view(2, 2, -1), s.scales.view(2, 2, -1)
        K.dequant_reduce_quant(*stacked, in_bits=4, out_bits=4, block_size=64, length=256, backend=backend)
        K.dequant_reduce(*stacked, bits=4, block_size=64, length=256, backend=backend)
        K.dequantize_allocated(*K.quantize_allocated(x, 4, 64, backend=backend), bits=4, block_size=64, length=512,
                               backend=backend)
    names = {event.name for event in prof.events()}
    for op in ("quantize", "dequantize", "swizzle_quantize", "dequant_reduce_quant", "dequant_reduce",
               "quantize_allocated", "dequantize_allocated"):
        assert f"hf_zeropp::{op}" in names, (op, sorted(n for n in names if "hf_zeropp" in n))


def test_torch_compile_traces_through_the_kernels_in_one_graph():
    def round_trip(x: torch.Tensor) -> torch.Tensor:
        q = K.quantize(x * 2, 4, 64)
        return K.dequantize(*q, bits=4, block_size=64, length=x.shape[-1]) + 1

    torch._dynamo.reset()
    compiled = torch.compile(round_trip, fullgraph=True, backend="aot_eager", dynamic=True)
    for length in (256, 300):
        x = torch.randn(3, length)
        assert torch.equal(compiled(x), round_trip(x))


def test_two_checkouts_with_the_same_sources_share_one_build(tmp_path):
    K.active_backend("cpu")  # built (or loaded) from this checkout's sources
    name = _build.extension_name(_build.CPU_EXTENSION)
    build = _build.cache_dir() / name
    before = {p.name: p.stat().st_mtime_ns for p in build.iterdir()}
    other_checkout = tmp_path / "checkout"  # the package and its kernel sources at another path
    shutil.copytree(Path(hf_zeropp.__file__).parent, other_checkout / "hf_zeropp",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(_build.source_dir(), other_checkout / "cuda")
    loaded = subprocess.run(
        [sys.executable, "-c", "import hf_zeropp.kernels as K; print(K.__file__, K.active_backend('cpu'))"],
        env={**os.environ, "PYTHONPATH": str(other_checkout)}, cwd=tmp_path, capture_output=True, text=True,
        timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == [str(other_checkout / "hf_zeropp" / "kernels" / "__init__.py"), "cpp"]
    assert "building" not in loaded.stderr, loaded.stderr
    assert {p.name: p.stat().st_mtime_ns for p in build.iterdir()} == before  # nothing rebuilt or rewritten
    header = other_checkout / "cuda" / "counter_hash.h"
    header.write_text(header.read_text() + "\n// edit\n")
    assert _build.extension_name(_build.CPU_EXTENSION, other_checkout / "cuda") != name  # a header edit: new build


def test_another_version_of_the_kernels_is_named_by_its_folder_and_built_under_its_own_hash(tmp_path, monkeypatch):
    """HF_ZEROPP_KERNEL_SOURCES points the build at another version of the sources (two versions timed on one
    machine): it gets its own build, so the two never overwrite each other."""
    ours = _build.extension_name(_build.CUDA_EXTENSION)
    variant = tmp_path / "variant"
    shutil.copytree(_build.source_dir(), variant)
    (variant / "quant_kernels.cu").write_text((variant / "quant_kernels.cu").read_text() + "\n// another version\n")
    monkeypatch.setenv("HF_ZEROPP_KERNEL_SOURCES", str(variant))
    assert _build.source_dir() == variant.resolve()
    assert _build.extension_name(_build.CUDA_EXTENSION) != ours
    monkeypatch.delenv("HF_ZEROPP_KERNEL_SOURCES")
    assert _build.extension_name(_build.CUDA_EXTENSION) == ours
