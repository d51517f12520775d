// What the CPU (cpu_kernels.cpp) and CUDA (cuda_binding.cpp) bindings share: the output shapes of the block format
// and the registration of their kernels as torch.ops.hf_zeropp.* (schemas: hf_zeropp/kernels/ops.py).
//
// Each binding implements the seven kernels as in-place fills of caller-allocated outputs; the functional ops
// (quantize, swizzle_quantize, dequant_reduce_quant, quantize_allocated) allocate their outputs here, once for both
// devices, and the ops that write into a collective's buffer (dequantize, dequant_reduce, dequantize_allocated) are
// registered as the fills themselves. quantize_allocated takes quantize's arguments in quantize's order, its last
// (`floor`) where quantize has `hadamard`, so it shares quantize's wrapper.
#pragma once

#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <tuple>

namespace hf_zeropp {

constexpr int64_t packed_length(int64_t length, int64_t bits) { return bits == 8 ? length : (length + 1) / 2; }

constexpr int64_t num_blocks(int64_t length, int64_t block_size) { return (length + block_size - 1) / block_size; }

// int8 codes and fp32 scales for `rows` rows of `length` elements, on the device of `like`.
inline std::tuple<at::Tensor, at::Tensor> empty_quantized(const at::Tensor& like, int64_t rows, int64_t length,
                                                          int64_t bits, int64_t block_size) {
  TORCH_CHECK(block_size >= 1, "block_size must be positive, got ", block_size);
  return {at::empty({rows, packed_length(length, bits)}, like.options().dtype(at::kChar)),
          at::empty({rows, num_blocks(length, block_size)}, like.options().dtype(at::kFloat))};
}

using QuantizeFill = void (*)(const at::Tensor&, int64_t, int64_t, bool, int64_t, int64_t, const at::Tensor&,
                              const at::Tensor&);
using SwizzleFill = void (*)(const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t, bool, int64_t, int64_t,
                             const at::Tensor&, const at::Tensor&);
using RequantizeFill = void (*)(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, int64_t, bool,
                                int64_t, const at::Tensor&, const at::Tensor&);

template <QuantizeFill fill>
std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t bits, int64_t block_size, bool stochastic,
                                            int64_t seed, int64_t hadamard) {
  TORCH_CHECK(x.dim() == 2, "x must have 2 dimensions (rows, length), got shape ", x.sizes());
  auto out = empty_quantized(x, x.size(0), x.size(1), bits, block_size);
  fill(x, bits, block_size, stochastic, seed, hadamard, std::get<0>(out), std::get<1>(out));
  return out;
}

template <SwizzleFill fill>
std::tuple<at::Tensor, at::Tensor> swizzle_quantize(const at::Tensor& x, int64_t nodes, int64_t node_size,
                                                    int64_t stages, int64_t bits, int64_t block_size, bool stochastic,
                                                    int64_t seed, int64_t hadamard) {
  TORCH_CHECK(nodes >= 1 && node_size >= 1 && stages >= 1, "nodes, node_size and stages must be positive, got ",
              nodes, ", ", node_size, ", ", stages);
  const int64_t slices = nodes * node_size * stages;
  auto out = empty_quantized(x, slices, x.numel() / slices, bits, block_size);
  fill(x, nodes, node_size, stages, bits, block_size, stochastic, seed, hadamard, std::get<0>(out),
       std::get<1>(out));  // checks that x splits into `slices` equal slices
  return out;
}

template <RequantizeFill fill>
std::tuple<at::Tensor, at::Tensor> dequant_reduce_quant(const at::Tensor& codes, const at::Tensor& scales,
                                                        int64_t in_bits, int64_t block_size, int64_t length,
                                                        int64_t out_bits, bool stochastic, int64_t seed) {
  TORCH_CHECK(codes.dim() == 3, "codes must stack k inputs (k, rows, bytes), got shape ", codes.sizes());
  auto out = empty_quantized(codes, codes.size(1), length, out_bits, block_size);
  fill(codes, scales, in_bits, block_size, length, out_bits, stochastic, seed, std::get<0>(out), std::get<1>(out));
  return out;
}

}  // namespace hf_zeropp

// Registers one binding's fills as the kernels of torch.ops.hf_zeropp.* for `DISPATCH_KEY` (CPU or CUDA).
#define HF_ZEROPP_REGISTER_KERNELS(DISPATCH_KEY)                                                   \
  TORCH_LIBRARY_IMPL(hf_zeropp, DISPATCH_KEY, m) {                                                 \
    m.impl("quantize", &hf_zeropp::quantize<&quantize_>);                                          \
    m.impl("dequantize", &dequantize_);                                                            \
    m.impl("swizzle_quantize", &hf_zeropp::swizzle_quantize<&swizzle_quantize_>);                  \
    m.impl("dequant_reduce_quant", &hf_zeropp::dequant_reduce_quant<&dequant_reduce_quant_>);      \
    m.impl("dequant_reduce", &dequant_reduce_);                                                    \
    m.impl("quantize_allocated", &hf_zeropp::quantize<&quantize_allocated_>);                      \
    m.impl("dequantize_allocated", &dequantize_allocated_);                                        \
  }
