"""The kernels as torch custom ops, ``torch.ops.hf_zeropp.*``: one schema each, defined here once.

Registering them with the dispatcher (rather than calling a pybind module) is what lets torch pick the kernel by
the tensors' device, lets ``torch.profiler`` show each call by name, and lets ``torch.compile`` trace through
them with the shape-only (fake) implementations below. Kernels per dispatch key:

* CPU and CUDA: the compiled C++/CUDA code (``cuda/cpu_kernels.cpp``, ``cuda/cuda_binding.cpp``), registered when
  :mod:`hf_zeropp.kernels._build` loads the library;
* every other case (no compiled library for the device, e.g. the build failed): the plain-torch reference, which
  is the specification, registered as the ``CompositeExplicitAutograd`` kernel.

Rows run along the last dimension of 2-D tensors; outputs that land in a collective's buffer (``dequantize``,
``dequant_reduce``) are written in place into ``out`` (``Tensor(a!)``), so no copy is needed. Arguments are
validated once, in :mod:`hf_zeropp.kernels`; the compiled kernels check again what they touch.
"""

from __future__ import annotations

import torch

from . import allocation, reference
from .reference import num_blocks, packed_length

NAMESPACE = "hf_zeropp"
SCHEMAS = {
    "quantize": "(Tensor x, int bits, int block_size, bool stochastic, int seed, int hadamard) -> (Tensor, Tensor)",
    "dequantize": "(Tensor codes, Tensor scales, int bits, int block_size, int hadamard, Tensor(a!) out) -> ()",
    "swizzle_quantize": "(Tensor x, int nodes, int node_size, int stages, int bits, int block_size, bool stochastic, "
                        "int seed, int hadamard) -> (Tensor, Tensor)",
    "dequant_reduce_quant": "(Tensor codes, Tensor scales, int in_bits, int block_size, int length, int out_bits, "
                            "bool stochastic, int seed) -> (Tensor, Tensor)",
    "dequant_reduce": "(Tensor codes, Tensor scales, int bits, int block_size, float scale, int hadamard, "
                      "Tensor(a!) out) -> ()",
    "quantize_allocated": "(Tensor x, int bits, int block_size, bool stochastic, int seed, int floor) "
                          "-> (Tensor, Tensor)",
    "dequantize_allocated": "(Tensor codes, Tensor scales, int bits, int block_size, int floor, Tensor(a!) out) -> ()",
}

_library = torch.library.Library(NAMESPACE, "DEF")  # kept alive: dropping it would unregister the ops
for _name, _schema in SCHEMAS.items():
    _library.define(_name + _schema)


def _empty_quantized(like: torch.Tensor, rows, length, bits: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return (like.new_empty((rows, packed_length(length, bits)), dtype=torch.int8),
            like.new_empty((rows, num_blocks(length, block_size)), dtype=torch.float32))


# ---- shape-only implementations (FakeTensor / torch.compile tracing) ----

@torch.library.register_fake(f"{NAMESPACE}::quantize")
def _quantize_fake(x, bits, block_size, stochastic, seed, hadamard):
    return _empty_quantized(x, x.shape[0], x.shape[1], bits, block_size)


@torch.library.register_fake(f"{NAMESPACE}::dequantize")
def _dequantize_fake(codes, scales, bits, block_size, hadamard, out):
    return None


@torch.library.register_fake(f"{NAMESPACE}::swizzle_quantize")
def _swizzle_quantize_fake(x, nodes, node_size, stages, bits, block_size, stochastic, seed, hadamard):
    slices = nodes * node_size * stages
    return _empty_quantized(x, slices, x.numel() // slices, bits, block_size)


@torch.library.register_fake(f"{NAMESPACE}::dequant_reduce_quant")
def _dequant_reduce_quant_fake(codes, scales, in_bits, block_size, length, out_bits, stochastic, seed):
    return _empty_quantized(codes, codes.shape[1], length, out_bits, block_size)


@torch.library.register_fake(f"{NAMESPACE}::dequant_reduce")
def _dequant_reduce_fake(codes, scales, bits, block_size, scale, hadamard, out):
    return None


@torch.library.register_fake(f"{NAMESPACE}::quantize_allocated")
def _quantize_allocated_fake(x, bits, block_size, stochastic, seed, floor):
    return _empty_quantized(x, x.shape[0], x.shape[1], bits, block_size)


@torch.library.register_fake(f"{NAMESPACE}::dequantize_allocated")
def _dequantize_allocated_fake(codes, scales, bits, block_size, floor, out):
    return None


# ---- the reference as the kernel of last resort ----

def _reference_dequantize(codes, scales, bits, block_size, hadamard, out):
    out.copy_(reference.dequantize(codes, scales, bits, block_size, out.shape[1], out.dtype, hadamard))


def _reference_dequant_reduce(codes, scales, bits, block_size, scale, hadamard, out):
    out.copy_(reference.dequant_reduce(codes, scales, bits, block_size, out.shape[1], scale, out.dtype, hadamard))


def _reference_dequantize_allocated(codes, scales, bits, block_size, floor, out):
    out.copy_(allocation.dequantize(codes, scales, bits, block_size, out.shape[1], floor))


REFERENCE = {
    "quantize": reference.quantize,  # same arguments as the op's schema
    "dequantize": _reference_dequantize,
    "swizzle_quantize": reference.swizzle_quantize,
    "dequant_reduce_quant": reference.dequant_reduce_quant,
    "dequant_reduce": _reference_dequant_reduce,
    "quantize_allocated": allocation.quantize,
    "dequantize_allocated": _reference_dequantize_allocated,
}
for _name, _kernel in REFERENCE.items():
    _library.impl(_name, _kernel, "CompositeExplicitAutograd")
