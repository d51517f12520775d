// Host launchers for the CUDA block-quantization kernels (format: hf_zeropp/kernels/reference.py).
//
// Deliberately free of torch and CUDA headers so that the kernels (quant_kernels.cu, allocation_kernels.cu) compile
// with nvcc alone and the torch binding (cuda_binding.cpp) compiles with the host compiler alone. Every launcher
// enqueues its work on `stream` (a cudaStream_t) for the current device and returns 0 on success or the cudaError_t
// of a failed launch; error_string() turns that code into CUDA's message. `hadamard` is the rotation group size (0:
// none; otherwise a power of two <= 128 dividing block_size; reference.hadamard_rows). Pointers are device pointers to
// contiguous row-major arrays; shapes and arguments are expected to be validated by the caller. Empty inputs (no rows
// or zero length) launch nothing.
#pragma once

#include <cstdint>

namespace hf_zeropp {

enum class DType : int { F32 = 0, F16 = 1, BF16 = 2 };

// x (rows, length) -> codes (rows, packed_length(length, bits)) int8, scales (rows, ceil(length / block_size)).
int launch_quantize(const void* x, DType x_dtype, int64_t rows, int64_t length, int bits, int64_t block_size,
                    bool stochastic, int64_t seed, int64_t hadamard, int8_t* codes, float* scales, void* stream);

// codes/scales as produced by launch_quantize -> out (rows, length) in out_dtype.
int launch_dequantize(const int8_t* codes, const float* scales, int64_t rows, int64_t length, int bits,
                      int64_t block_size, int64_t hadamard, void* out, DType out_dtype, void* stream);

// Flat x of nodes * node_size * stages * length elements, viewed as (nodes * node_size * stages, length) source
// slices: output row (s * node_size + d) * nodes + m is source slice (m * node_size + d) * stages + s, quantized.
int launch_swizzle_quantize(const void* x, DType x_dtype, int64_t nodes, int64_t node_size, int64_t stages,
                            int64_t length, int bits, int64_t block_size, bool stochastic, int64_t seed,
                            int64_t hadamard, int8_t* codes, float* scales, void* stream);

// k stacked inputs codes (k, rows, packed_length(length, in_bits)), scales (k, rows, nb) -> their fp32 sum in input
// order, requantized to out_codes (no rotation: rotated inputs stay in the rotated domain, the sum being linear) (rows, packed_length(length, out_bits)), out_scales (rows, nb).
int launch_dequant_reduce_quant(const int8_t* codes, const float* scales, int64_t k, int64_t rows, int64_t length,
                                int in_bits, int64_t block_size, int out_bits, bool stochastic, int64_t seed,
                                int8_t* out_codes, float* out_scales, void* stream);

// k stacked inputs as above -> rotate(fp32 sum in input order) * scale -> out (rows, length) in out_dtype.
int launch_dequant_reduce(const int8_t* codes, const float* scales, int64_t k, int64_t rows, int64_t length,
                          int bits, int64_t block_size, float scale, int64_t hadamard, void* out, DType out_dtype,
                          void* stream);

// The per-block-width format (hf_zeropp/kernels/allocation.py; kernels in allocation_kernels.cu), fp32 only,
// block_size a multiple of 8, floor 0 or 2 to 8. widths (rows * nb int32) and starts (rows * nb int64) are device
// workspace for the blocks' widths and first code bytes: the binding takes it from torch's caching allocator, so the
// launchers allocate nothing (no cudaMalloc, no sync).
// x (rows, length) -> codes (rows, packed_length(length, bits)) int8, absmax scales (rows, nb).
int launch_quantize_allocated(const float* x, int64_t rows, int64_t length, int bits, int64_t block_size,
                              bool stochastic, int64_t seed, int64_t floor, int32_t* widths, int64_t* starts,
                              int8_t* codes, float* scales, void* stream);

// codes/scales as produced by launch_quantize_allocated with the same bits, block_size and floor -> out (rows, length).
int launch_dequantize_allocated(const int8_t* codes, const float* scales, int64_t rows, int64_t length, int bits,
                                int64_t block_size, int64_t floor, int32_t* widths, int64_t* starts, float* out,
                                void* stream);

const char* error_string(int code);

}  // namespace hf_zeropp
