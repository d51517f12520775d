// CUDA kernels of the per-block-width format of qgZ's inter-node hop; the format and every rounding follow
// hf_zeropp/kernels/allocation.py bit for bit, as the CPU kernel (cpu_kernels.cpp, "per-block widths") does.
//
// Design. Correctness is easy to read off here, speed is secondary: the format is one hop of qgZ, and its widths
// need a whole row's scales before any code can be placed. Quantization is three kernels on one stream:
//   1. absmax_kernel: one warp per block, the block's absolute maximum -> the scales.
//   2. layout_kernel: one CTA per row, the widths from the row's scales (a bisection over the offset, each step a
//      CTA-wide sum of the row's cost) and each block's first code byte (a CTA-wide exclusive scan), into the
//      caller's workspace.
//   3. pack_kernel: one thread per group of 8 codes, which fill `width` whole bytes, so no two threads share a byte.
// Dequantization runs layout_kernel on the received scales, then unpack_kernel, again one thread per group.
// Every loop is grid-stride with int64 indices.
//
// Exactness. Quotients, sums and products are the round-to-nearest intrinsics (__fdiv_rn, __fadd_rn, __fmul_rn;
// the file is also built with --fmad=false), rintf rounds half to even as torch.round, and nothing flushes
// subnormals (no --use_fast_math), so every operation is the single IEEE rounding the spec's fp32 torch ops make.
// A block's absmax is the maximum of its values' bit patterns with the sign bit cleared: that orders non-negative
// floats as their values, and every NaN pattern lies above +Inf's, so one NaN makes the block's absmax NaN as
// torch.amax does (fmaxf would drop it). The widths are integer arithmetic on the scales' bit patterns.

#include <cuda_runtime.h>

#include <cfloat>
#include <cstdint>

#include "counter_hash.h"
#include "quant_kernels.h"

namespace hf_zeropp {
namespace {

constexpr int kThreads = 256;  // per CTA, for every kernel here
constexpr int kWarps = kThreads / 32;
constexpr int64_t kGroup = 8;  // 8 codes of b bits fill b whole bytes
constexpr int64_t kMaxWidth = 8;
constexpr int kKeyShift = 23;  // the fp32 exponent's position: one width step per doubling of the scale
// Grid-stride loops cover any size, so the grid is capped; this many CTAs of kThreads fill every current GPU.
constexpr int64_t kMaxCtas = 4096;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The shape shared by every kernel: `rows` rows of `length` elements in `blocks` blocks of `block_size` (the last
// one shorter when block_size does not divide length).
struct Rows {
  int64_t rows;
  int64_t length;
  int64_t block_size;
  int64_t blocks;     // per row
  int64_t groups;     // groups of kGroup elements in the row's largest block
  int64_t row_bytes;  // the fixed bits-wide format's row: the width budget is 8 * row_bytes bits
  int64_t floor;      // gradient_bit_allocation_floor: 0 or 2..8
};

Rows make_rows(int64_t rows, int64_t length, int bits, int64_t block_size, int64_t floor) {
  const int64_t largest = block_size < length ? block_size : length;
  return Rows{rows, length, block_size, ceil_div(length, block_size), ceil_div(largest, kGroup),
              bits == 8 ? length : (length + 1) / 2, floor};
}

// Elements of block b rounded up to whole groups (a short last block is padded with zeros).
__device__ __forceinline__ int64_t padded_count(const Rows& f, int64_t b) {
  const int64_t left = f.length - b * f.block_size;
  return ceil_div(left < f.block_size ? left : f.block_size, kGroup) * kGroup;
}

// The width rule's key: the scale's int32 bit pattern where the scale is usable, -1 (width 0) otherwise. Usable is
// finite and > 0, read off the bit pattern (sign clear, not zero, exponent not all ones): subnormal scales count,
// as in the spec.
__device__ __forceinline__ int64_t scale_key(float scale) {
  const uint32_t bits = __float_as_uint(scale);
  return bits != 0 && bits < 0x7F800000u ? static_cast<int64_t>(bits) : -1;
}

// allocation.block_widths' widths_at for one block: a width of 1 holds only zero, so it becomes 0.
__device__ __forceinline__ int64_t width_at(int64_t key, int64_t offset, int64_t row_floor) {
  if (key < 0) return 0;
  const int64_t shifted = key + offset;
  const int64_t rule = shifted < 0 ? 0 : ((shifted >> kKeyShift) < kMaxWidth ? shifted >> kKeyShift : kMaxWidth);
  const int64_t width = rule > row_floor ? rule : row_floor;
  return width == 1 ? 0 : width;
}

__device__ __forceinline__ int32_t width_qmax(int32_t width) { return (1 << width) / 2 - 1; }

// U[0, 1) for an element index, as reference.uniform_from_counter (and quant_kernels.cu); key = mix32(lo32(seed)).
__device__ __forceinline__ float uniform(uint32_t key, int64_t index) {
  const uint32_t h = hf_zeropp_hash::counter_bits(key, index);
  return __fmul_rn(__uint2float_rn(h), 5.9604644775390625e-08f);  // exact: h < 2**24, times 2**-24
}

// The sum of v over the CTA, returned to every thread (integer: exact in any order). `partial` holds one value per
// warp; the leading barrier keeps this call from overwriting what threads of the previous call still read.
__device__ __forceinline__ int64_t cta_sum(int64_t v, int64_t* partial) {
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xFFFFFFFFu, v, offset);
  __syncthreads();
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
  __syncthreads();
  int64_t total = 0;
  for (int w = 0; w < kWarps; ++w) total += partial[w];
  return total;
}

__global__ void __launch_bounds__(kThreads) absmax_kernel(const float* __restrict__ x, const Rows f,
                                                         float* __restrict__ scales) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  const int64_t items = f.rows * f.blocks;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kWarps;
  // item is the same for the whole warp, so the loop and the shuffles below are warp-uniform
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32; item < items; item += stride) {
    const int64_t row = item / f.blocks;
    const int64_t col = (item - row * f.blocks) * f.block_size;
    const int64_t n = f.length - col < f.block_size ? f.length - col : f.block_size;
    const float* p = x + row * f.length + col;
    uint32_t m = 0;
    for (int64_t j = lane; j < n; j += 32) m = max(m, __float_as_uint(p[j]) & 0x7FFFFFFFu);
    for (int offset = 16; offset > 0; offset /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, offset));
    if (lane == 0) scales[item] = __uint_as_float(m);
  }
}

// Widths and first code byte (within the row) of every block, as cpu_kernels.cpp's row_widths and
// allocated_layout. Thread t owns a contiguous run of the row's blocks; every thread sees the same CTA sums, so
// low, high and the loop are CTA-uniform and the barriers in cta_sum are reached by all.
__global__ void __launch_bounds__(kThreads) layout_kernel(const float* __restrict__ scales, const Rows f,
                                                         int32_t* __restrict__ widths, int64_t* __restrict__ starts) {
  __shared__ int64_t partial[kWarps];
  __shared__ int64_t run_bytes[kThreads];
  const int64_t per_thread = ceil_div(f.blocks, kThreads);
  const int64_t first = threadIdx.x * per_thread;
  const int64_t end = first + per_thread < f.blocks ? first + per_thread : f.blocks;
  const int64_t budget = 8 * f.row_bytes;
  for (int64_t row = blockIdx.x; row < f.rows; row += gridDim.x) {
    const float* s = scales + row * f.blocks;
    int64_t usable = 0;
    for (int64_t b = first; b < end; ++b) usable += scale_key(s[b]) >= 0 ? padded_count(f, b) : 0;
    usable = cta_sum(usable, partial);
    int64_t row_floor = 0;  // allocation._row_floors: the floor, lowered until every usable block can have it
    for (int64_t width = 2; width <= f.floor; ++width) {
      if (width * usable <= budget) row_floor = width;
    }
    auto fits = [&](int64_t offset) {
      int64_t cost = 0;
      for (int64_t b = first; b < end; ++b) cost += width_at(scale_key(s[b]), offset, row_floor) * padded_count(f, b);
      return cta_sum(cost, partial) <= budget;
    };
    // the cost only grows with the offset, so the largest fitting offset is unique and any bisection finds it
    int64_t low = -(int64_t{1} << 32);  // every usable block at the row's floor: fits
    int64_t high = int64_t{1} << 32;    // every usable block at kMaxWidth: may not fit
    if (fits(high)) low = high;
    while (high - low > 1) {
      const int64_t middle = low + (high - low) / 2;
      if (fits(middle)) {
        low = middle;
      } else {
        high = middle;
      }
    }
    int64_t bytes = 0;
    for (int64_t b = first; b < end; ++b) {
      const int64_t width = width_at(scale_key(s[b]), low, row_floor);
      widths[row * f.blocks + b] = static_cast<int32_t>(width);
      bytes += width * padded_count(f, b) / 8;
    }
    __syncthreads();  // the previous row's readers are done with run_bytes
    run_bytes[threadIdx.x] = bytes;
    __syncthreads();
    int64_t start = 0;  // the exclusive prefix over the runs of the threads before this one
    for (unsigned t = 0; t < threadIdx.x; ++t) start += run_bytes[t];
    for (int64_t b = first; b < end; ++b) {
      starts[row * f.blocks + b] = start;
      start += widths[row * f.blocks + b] * padded_count(f, b) / 8;
    }
  }
}

// One group of 8 codes per item: the group's elements (zeros past the row's end, as the spec pads a short last
// block) as unsigned codes code + qmax, `width` bits each, little-endian in `width` bytes. Width-0 blocks write
// nothing: the caller zeroed the codes.
__global__ void __launch_bounds__(kThreads) pack_kernel(const float* __restrict__ x, const float* __restrict__ scales,
                                                       const int32_t* __restrict__ widths,
                                                       const int64_t* __restrict__ starts, const Rows f,
                                                       bool stochastic, uint32_t key, uint8_t* __restrict__ codes) {
  const int64_t items = f.rows * f.blocks * f.groups;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; item < items; item += stride) {
    const int64_t block = item / f.groups;  // row * blocks + b
    const int64_t group = item - block * f.groups;
    const int64_t row = block / f.blocks;
    const int64_t col = (block - row * f.blocks) * f.block_size + group * kGroup;  // the group's first element
    const int32_t width = widths[block];
    if (width == 0 || col >= f.length) continue;  // nothing sent, or a group past a short last block
    const int32_t qmax = width_qmax(width);
    // the spec clamps the divisor to the smallest normal float (a subnormal absmax gives a subnormal step)
    const float step = fmaxf(__fdiv_rn(scales[block], __int2float_rn(qmax)), FLT_MIN);
    const int64_t index = row * f.length + col;  // stochastic rounding's counter: the element's place in the rows
    uint64_t packed = 0;
    for (int k = 0; k < kGroup; ++k) {
      // |x| <= absmax and step >= absmax / qmax (rounded), so |v| is about qmax at most: no int32 overflow
      const float v = __fdiv_rn(col + k < f.length ? x[index + k] : 0.0f, step);
      const float rounded = stochastic ? floorf(__fadd_rn(v, uniform(key, index + k))) : rintf(v);
      int32_t code = __float2int_rn(rounded);
      code = code < -qmax ? -qmax : (code > qmax ? qmax : code);
      packed |= static_cast<uint64_t>(code + qmax) << (k * width);
    }
    uint8_t* out = codes + row * f.row_bytes + starts[block] + group * width;
    for (int byte = 0; byte < width; ++byte) out[byte] = static_cast<uint8_t>(packed >> (8 * byte));
  }
}

// One group of 8 values per item: (code - qmax) * step, step = absmax / qmax (no clamp here, as in the spec), and
// 0 * absmax for a width-0 block: zero, or NaN where the scale is NaN or infinite.
__global__ void __launch_bounds__(kThreads) unpack_kernel(const uint8_t* __restrict__ codes,
                                                         const float* __restrict__ scales,
                                                         const int32_t* __restrict__ widths,
                                                         const int64_t* __restrict__ starts, const Rows f,
                                                         float* __restrict__ out) {
  const int64_t items = f.rows * f.blocks * f.groups;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; item < items; item += stride) {
    const int64_t block = item / f.groups;
    const int64_t group = item - block * f.groups;
    const int64_t row = block / f.blocks;
    const int64_t col = (block - row * f.blocks) * f.block_size + group * kGroup;
    if (col >= f.length) continue;
    const int count = f.length - col < kGroup ? static_cast<int>(f.length - col) : static_cast<int>(kGroup);
    float* o = out + row * f.length + col;
    const float absmax = scales[block];
    const int32_t width = widths[block];
    if (width == 0) {
      const float zero = __fmul_rn(0.0f, absmax);
      for (int k = 0; k < count; ++k) o[k] = zero;
      continue;
    }
    const int32_t qmax = width_qmax(width);
    const float step = __fdiv_rn(absmax, __int2float_rn(qmax));
    const uint8_t* in = codes + row * f.row_bytes + starts[block] + group * width;
    uint64_t packed = 0;
    for (int byte = 0; byte < width; ++byte) packed |= static_cast<uint64_t>(in[byte]) << (8 * byte);
    const uint64_t mask = (uint64_t{1} << width) - 1;
    for (int k = 0; k < count; ++k) {
      const int32_t code = static_cast<int32_t>((packed >> (k * width)) & mask) - qmax;
      o[k] = __fmul_rn(__int2float_rn(code), step);
    }
  }
}

unsigned grid_for(int64_t items, int64_t per_cta) {
  const int64_t needed = ceil_div(items, per_cta);
  return static_cast<unsigned>(needed < kMaxCtas ? needed : kMaxCtas);
}

cudaError_t run_layout(const float* scales, const Rows& f, int32_t* widths, int64_t* starts, cudaStream_t stream) {
  layout_kernel<<<grid_for(f.rows, 1), kThreads, 0, stream>>>(scales, f, widths, starts);
  return cudaGetLastError();
}

}  // namespace

int launch_quantize_allocated(const float* x, int64_t rows, int64_t length, int bits, int64_t block_size,
                              bool stochastic, int64_t seed, int64_t floor, int32_t* widths, int64_t* starts,
                              int8_t* codes, float* scales, void* stream) {
  if (rows <= 0 || length <= 0) return static_cast<int>(cudaSuccess);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const Rows f = make_rows(rows, length, bits, block_size, floor);
  uint8_t* out = reinterpret_cast<uint8_t*>(codes);
  cudaError_t err = cudaMemsetAsync(out, 0, static_cast<size_t>(rows * f.row_bytes), s);  // width-0 blocks, tails
  if (err != cudaSuccess) return static_cast<int>(err);
  absmax_kernel<<<grid_for(rows * f.blocks, kWarps), kThreads, 0, s>>>(x, f, scales);
  if ((err = cudaGetLastError()) != cudaSuccess) return static_cast<int>(err);
  if ((err = run_layout(scales, f, widths, starts, s)) != cudaSuccess) return static_cast<int>(err);
  pack_kernel<<<grid_for(rows * f.blocks * f.groups, kThreads), kThreads, 0, s>>>(
      x, scales, widths, starts, f, stochastic, hf_zeropp_hash::mix32(static_cast<uint32_t>(seed)), out);
  return static_cast<int>(cudaGetLastError());
}

int launch_dequantize_allocated(const int8_t* codes, const float* scales, int64_t rows, int64_t length, int bits,
                                int64_t block_size, int64_t floor, int32_t* widths, int64_t* starts, float* out,
                                void* stream) {
  if (rows <= 0 || length <= 0) return static_cast<int>(cudaSuccess);
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const Rows f = make_rows(rows, length, bits, block_size, floor);
  const cudaError_t err = run_layout(scales, f, widths, starts, s);
  if (err != cudaSuccess) return static_cast<int>(err);
  unpack_kernel<<<grid_for(rows * f.blocks * f.groups, kThreads), kThreads, 0, s>>>(
      reinterpret_cast<const uint8_t*>(codes), scales, widths, starts, f, out);
  return static_cast<int>(cudaGetLastError());
}

}  // namespace hf_zeropp
