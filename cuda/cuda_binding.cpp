// torch binding of the CUDA block-quantization kernels (quant_kernels.cu, allocation_kernels.cu): argument checks,
// device guard, stream; registered as the CUDA kernels of torch.ops.hf_zeropp.* (torch_ops.h).
//
// Every function writes into caller-allocated outputs (out-parameter style), so that a collective's buffer can be
// filled in place; shapes follow hf_zeropp/kernels/reference.py. Work is enqueued on the current stream of the
// inputs' device.

#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/safe_numerics.h>
#include <ATen/ATen.h>

#include "quant_kernels.h"
#include "torch_ops.h"

namespace {

using hf_zeropp::DType;

using hf_zeropp::num_blocks;
using hf_zeropp::packed_length;

void check_bits(int64_t bits, const char* name) {
  TORCH_CHECK(bits == 8 || bits == 4, name, "=", bits, " is not supported; use 8 or 4");
}

void check_hadamard(int64_t hadamard, int64_t block_size) {
  TORCH_CHECK(hadamard >= 0 && hadamard <= 128 && hadamard != 1 && (hadamard & (hadamard - 1)) == 0, "hadamard=",
              hadamard, " must be 0 or a power of two from 2 to 128");
  TORCH_CHECK(hadamard == 0 || block_size % hadamard == 0, "block_size=", block_size,
              " is not a multiple of hadamard=", hadamard);
}

void check_block_size(int64_t block_size, int64_t bits) {
  TORCH_CHECK(block_size >= 1, "block_size=", block_size, " must be a positive integer");
  TORCH_CHECK(bits == 8 || block_size % 2 == 0, "block_size=", block_size,
              " is odd, but 4-bit codes pack two per byte and a byte may not straddle two blocks");
}

// `t` lives on the CUDA device `device`, is contiguous and has `dim` dimensions.
void check_layout(const at::Tensor& t, const char* name, const at::Device& device, int64_t dim) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, name, " is on ", t.device(), " but the other tensors are on ", device);
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimensions, got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, name, " has shape ", t.sizes(), " but ", expected, " is expected");
}

DType float_dtype(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    default: TORCH_CHECK(false, name, " must be float32, float16 or bfloat16, got ", t.scalar_type());
  }
}

void* current_stream(const at::Device& device) { return c10::cuda::getCurrentCUDAStream(device.index()).stream(); }

void check_launch(int status, const char* function) {
  TORCH_CHECK(status == 0, "hf_zeropp ", function, ": CUDA kernel launch failed: ", hf_zeropp::error_string(status));
}

// Codes (k, rows, packed) and scales (k, rows, blocks) stacked from k quantized inputs of rows of `length`.
void check_stacked(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block_size,
                   int64_t length) {
  check_layout(codes, "codes", codes.device(), 3);
  check_dtype(codes, "codes", at::kChar);
  check_layout(scales, "scales", codes.device(), 3);
  check_dtype(scales, "scales", at::kFloat);
  TORCH_CHECK(codes.size(0) >= 1, "at least one input (k >= 1) is needed, got codes of shape ", codes.sizes());
  check_shape(codes, "codes", {codes.size(0), codes.size(1), packed_length(length, bits)});
  check_shape(scales, "scales", {codes.size(0), codes.size(1), num_blocks(length, block_size)});
}

// Codes (rows, packed) and scales (rows, blocks) of rows of `length` values, on `device`.
void check_codes_and_scales(const at::Tensor& codes, const at::Tensor& scales, const at::Device& device, int64_t rows,
                            int64_t length, int64_t bits, int64_t block_size, const char* codes_name = "codes",
                            const char* scales_name = "scales") {
  check_layout(codes, codes_name, device, 2);
  check_dtype(codes, codes_name, at::kChar);
  check_shape(codes, codes_name, {rows, packed_length(length, bits)});
  check_layout(scales, scales_name, device, 2);
  check_dtype(scales, scales_name, at::kFloat);
  check_shape(scales, scales_name, {rows, num_blocks(length, block_size)});
}

void quantize_(const at::Tensor& x, int64_t bits, int64_t block_size, bool stochastic, int64_t seed,
               int64_t hadamard, const at::Tensor& codes, const at::Tensor& scales) {
  check_bits(bits, "bits");
  check_block_size(block_size, bits);
  check_hadamard(hadamard, block_size);
  check_layout(x, "x", x.device(), 2);
  const DType dtype = float_dtype(x, "x");
  const int64_t rows = x.size(0), length = x.size(1);
  check_codes_and_scales(codes, scales, x.device(), rows, length, bits, block_size);

  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(hf_zeropp::launch_quantize(x.const_data_ptr(), dtype, rows, length, static_cast<int>(bits), block_size,
                                          stochastic, seed, hadamard, codes.mutable_data_ptr<int8_t>(),
                                          scales.mutable_data_ptr<float>(), current_stream(x.device())),
               "quantize_");
}

void dequantize_(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block_size,
                 int64_t hadamard, const at::Tensor& out) {
  check_bits(bits, "bits");
  check_block_size(block_size, bits);
  check_hadamard(hadamard, block_size);
  check_layout(out, "out", out.device(), 2);
  const DType dtype = float_dtype(out, "out");
  const int64_t rows = out.size(0), length = out.size(1);
  check_codes_and_scales(codes, scales, out.device(), rows, length, bits, block_size);

  const c10::cuda::CUDAGuard guard(out.device());
  check_launch(hf_zeropp::launch_dequantize(codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), rows,
                                            length, static_cast<int>(bits), block_size, hadamard,
                                            out.mutable_data_ptr(), dtype,
                                            current_stream(out.device())),
               "dequantize_");
}

void swizzle_quantize_(const at::Tensor& x, int64_t nodes, int64_t node_size, int64_t stages, int64_t bits,
                       int64_t block_size, bool stochastic, int64_t seed, int64_t hadamard,
                       const at::Tensor& codes, const at::Tensor& scales) {
  check_bits(bits, "bits");
  check_block_size(block_size, bits);
  check_hadamard(hadamard, block_size);
  TORCH_CHECK(nodes >= 1 && node_size >= 1 && stages >= 1, "nodes, node_size and stages must be positive, got ",
              nodes, ", ", node_size, ", ", stages);
  check_layout(x, "x", x.device(), 1);
  const DType dtype = float_dtype(x, "x");
  int64_t slices = 0;
  TORCH_CHECK(!c10::mul_overflows(nodes, node_size, &slices) && !c10::mul_overflows(slices, stages, &slices) &&
                  x.numel() % slices == 0,
              "x has ", x.numel(), " elements, not divisible by nodes * node_size * stages = ", nodes, " * ",
              node_size, " * ", stages);
  const int64_t length = x.numel() / slices;
  check_codes_and_scales(codes, scales, x.device(), slices, length, bits, block_size);

  const c10::cuda::CUDAGuard guard(x.device());
  check_launch(hf_zeropp::launch_swizzle_quantize(x.const_data_ptr(), dtype, nodes, node_size, stages, length,
                                                  static_cast<int>(bits), block_size, stochastic, seed, hadamard,
                                                  codes.mutable_data_ptr<int8_t>(), scales.mutable_data_ptr<float>(),
                                                  current_stream(x.device())),
               "swizzle_quantize_");
}

void dequant_reduce_quant_(const at::Tensor& codes, const at::Tensor& scales, int64_t in_bits, int64_t block_size,
                           int64_t length, int64_t out_bits, bool stochastic, int64_t seed,
                           const at::Tensor& out_codes, const at::Tensor& out_scales) {
  check_bits(in_bits, "in_bits");
  check_bits(out_bits, "out_bits");
  check_block_size(block_size, in_bits);
  check_block_size(block_size, out_bits);
  TORCH_CHECK(length >= 0, "length=", length, " must be non-negative");
  check_stacked(codes, scales, in_bits, block_size, length);
  const int64_t k = codes.size(0), rows = codes.size(1);
  check_codes_and_scales(out_codes, out_scales, codes.device(), rows, length, out_bits, block_size, "out_codes",
                         "out_scales");

  const c10::cuda::CUDAGuard guard(codes.device());
  check_launch(hf_zeropp::launch_dequant_reduce_quant(
                   codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), k, rows, length,
                   static_cast<int>(in_bits), block_size, static_cast<int>(out_bits), stochastic, seed,
                   out_codes.mutable_data_ptr<int8_t>(), out_scales.mutable_data_ptr<float>(),
                   current_stream(codes.device())),
               "dequant_reduce_quant_");
}

void dequant_reduce_(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block_size,
                     double scale, int64_t hadamard, const at::Tensor& out) {
  check_bits(bits, "bits");
  check_block_size(block_size, bits);
  check_hadamard(hadamard, block_size);
  check_layout(out, "out", out.device(), 2);
  const DType dtype = float_dtype(out, "out");
  const int64_t length = out.size(1);
  check_stacked(codes, scales, bits, block_size, length);
  TORCH_CHECK(codes.device() == out.device(), "codes are on ", codes.device(), " but out is on ", out.device());
  const int64_t k = codes.size(0), rows = codes.size(1);
  check_shape(out, "out", {rows, length});

  const c10::cuda::CUDAGuard guard(out.device());
  // The reference multiplies by torch.tensor(scale, dtype=float32): the factor is rounded to fp32 first.
  check_launch(hf_zeropp::launch_dequant_reduce(codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), k,
                                                rows, length, static_cast<int>(bits), block_size,
                                                static_cast<float>(scale), hadamard, out.mutable_data_ptr(), dtype,
                                                current_stream(out.device())),
               "dequant_reduce_");
}

// The per-block-width format's arguments (cpu_kernels.cpp's check_allocated), the fp32 `values` (rows, length) and
// the codes and scales that encode them, all on one CUDA device.
void check_allocated(int64_t bits, int64_t block_size, int64_t floor, const at::Tensor& codes,
                     const at::Tensor& scales, const at::Tensor& values, const char* values_name) {
  check_bits(bits, "bits");
  TORCH_CHECK(block_size >= 8 && block_size % 8 == 0, "block_size=", block_size,
              " must be a positive multiple of 8 for per-block widths");
  TORCH_CHECK(floor == 0 || (floor >= 2 && floor <= 8), "floor=", floor, " must be 0 or a width from 2 to 8");
  check_layout(values, values_name, values.device(), 2);
  check_dtype(values, values_name, at::kFloat);
  check_codes_and_scales(codes, scales, values.device(), values.size(0), values.size(1), bits, block_size);
}

// Workspace of the width format's launchers: each block's width (int32) and first code byte (int64).
std::tuple<at::Tensor, at::Tensor> allocated_workspace(const at::Tensor& scales) {
  return {at::empty(scales.sizes(), scales.options().dtype(at::kInt)),
          at::empty(scales.sizes(), scales.options().dtype(at::kLong))};
}

void quantize_allocated_(const at::Tensor& x, int64_t bits, int64_t block_size, bool stochastic, int64_t seed,
                         int64_t floor, const at::Tensor& codes, const at::Tensor& scales) {
  check_allocated(bits, block_size, floor, codes, scales, x, "x");
  const c10::cuda::CUDAGuard guard(x.device());
  auto [widths, starts] = allocated_workspace(scales);
  check_launch(hf_zeropp::launch_quantize_allocated(
                   x.const_data_ptr<float>(), x.size(0), x.size(1), static_cast<int>(bits), block_size, stochastic,
                   seed, floor, widths.mutable_data_ptr<int32_t>(), starts.mutable_data_ptr<int64_t>(),
                   codes.mutable_data_ptr<int8_t>(), scales.mutable_data_ptr<float>(), current_stream(x.device())),
               "quantize_allocated_");
}

void dequantize_allocated_(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block_size,
                           int64_t floor, const at::Tensor& out) {
  check_allocated(bits, block_size, floor, codes, scales, out, "out");
  const c10::cuda::CUDAGuard guard(out.device());
  auto [widths, starts] = allocated_workspace(scales);
  check_launch(hf_zeropp::launch_dequantize_allocated(
                   codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), out.size(0), out.size(1),
                   static_cast<int>(bits), block_size, floor, widths.mutable_data_ptr<int32_t>(),
                   starts.mutable_data_ptr<int64_t>(), out.mutable_data_ptr<float>(), current_stream(out.device())),
               "dequantize_allocated_");
}

}  // namespace

HF_ZEROPP_REGISTER_KERNELS(CUDA)
