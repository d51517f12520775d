// CPU backend of hf_zeropp's block quantization (the "cpp" backend).
//
// hf_zeropp/kernels/reference.py is the specification and this file matches it bit for bit: fp32 arithmetic with
// single roundings (built with -ffp-contract=off, no -ffast-math), IEEE division x / scale, round half to even,
// and the same counter-based uniform draw for stochastic rounding. The Python dispatcher in
// hf_zeropp/kernels/__init__.py validates arguments; the functions here check what they are given again and fill
// the outputs in place. They are the CPU kernels of torch.ops.hf_zeropp.* (torch_ops.h registers them).
//
// Work is split over (row, block) items with at::parallel_for. Inner loops are plain, branch-free loops over one
// block (or one kChunk-sized piece of it) so that gcc vectorizes them at the baseline ISA (SSE2 / NEON): the
// build has no -march=native because the cached extension must run on any x86-64 or aarch64 machine.

#include <ATen/ATen.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "counter_hash.h"
#include "torch_ops.h"

namespace {

// Elements per parallel task: enough to pay for handing work to another thread, so small tensors stay on the
// calling thread.
constexpr int64_t kGrainElements = int64_t{1} << 15;

// Elements staged at a time in a stack buffer (L1-resident). Even, so a 4-bit piece never splits a byte.
constexpr int64_t kChunk = 1024;

// (v + 1.5 * 2^23) - 1.5 * 2^23 rounds |v| < 2^22 to an integer, half to even, under the default rounding mode.
// It is exact only because the build keeps both operations (no fast-math reassociation, no contraction), and
// unlike nearbyintf it needs no libm call, so the loop vectorizes.
constexpr float kRoundMagic = 12582912.0f;

constexpr float kTwoPowMinus24 = 0x1p-24f;

template <int kBits>
constexpr float qmax() {
  return kBits == 8 ? 127.0f : 7.0f;
}

using hf_zeropp::packed_length;

constexpr int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Items (blocks) per task for blocks of up to `block_size` elements in rows of `length`.
int64_t grain_blocks(int64_t length, int64_t block_size) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, std::min(block_size, length)));
}

inline uint32_t float_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return b;
}

inline float bits_float(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

// Exact conversions to fp32. fp16 follows c10::detail::fp16_ieee_to_fp32_value (exact for every input, including
// denormals, Inf and NaN).
//
// The selects here and in store_as are written as bit masks on purpose: gcc (with the default -ftrapping-math)
// turns a ternary between floating-point results into a branch, and a branch stops the loop from vectorizing.
inline float to_float(float v) {
  return v;
}
inline float to_float(c10::BFloat16 v) {
  return bits_float(static_cast<uint32_t>(v.x) << 16);
}
inline float to_float(c10::Half v) {
  const uint32_t w = static_cast<uint32_t>(v.x) << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  // Normal, Inf and NaN: rebias the exponent so that the multiply by 2^-112 lands it exactly (Inf/NaN stay so).
  const uint32_t normalized = float_bits(bits_float((two_w >> 4) + (0xE0u << 23)) * 0x1p-112f);
  // Zero and denormal: the mantissa as the low bits of 0.5f, then subtract 0.5 (exact).
  const uint32_t denormalized = float_bits(bits_float((two_w >> 17) | (126u << 23)) - 0.5f);
  const uint32_t is_denormal = 0u - static_cast<uint32_t>(two_w < (1u << 27));
  return bits_float(sign | (denormalized & is_denormal) | (normalized & ~is_denormal));
}

// Stores fp32 v into *out rounded to nearest even, bit-identical to c10's conversions (and so to torch's
// .to(dtype)) except that every NaN becomes one canonical quiet NaN. kMayBeNaN = false drops the NaN select, about
// a third of the cost of a bf16 store, for values that cannot be NaN.
template <bool kMayBeNaN>
inline void store_as(float v, float* out) {
  *out = v;
}

// c10::detail::round_to_nearest_even.
template <bool kMayBeNaN>
inline void store_as(float v, c10::BFloat16* out) {
  const uint32_t u = float_bits(v);
  uint32_t bits = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  if constexpr (kMayBeNaN) {
    const uint32_t nan = 0u - static_cast<uint32_t>((u & 0x7FFFFFFFu) > 0x7F800000u);
    bits = (0x7FC0u & nan) | (bits & ~nan);
  }
  *out = c10::BFloat16(static_cast<uint16_t>(bits), c10::BFloat16::from_bits());
}

// c10::detail::fp16_ieee_from_fp32_value: the rounding is done by an fp32 add at the right exponent, overflow
// goes to Inf through the 2^112 pre-scale.
template <bool kMayBeNaN>
inline void store_as(float v, c10::Half* out) {
  const uint32_t w = float_bits(v);
  const float base = (bits_float(w & 0x7FFFFFFFu) * 0x1p+112f) * 0x1p-110f;
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t bias = std::max(shl1_w & 0xFF000000u, 0x71000000u);
  const uint32_t rounded = float_bits(bits_float((bias >> 1) + 0x07800000u) + base);
  uint32_t nonsign = ((rounded >> 13) & 0x00007C00u) + (rounded & 0x00000FFFu);
  if constexpr (kMayBeNaN) {
    const uint32_t nan = 0u - static_cast<uint32_t>(shl1_w > 0xFF000000u);
    nonsign = (0x7E00u & nan) | (nonsign & ~nan);
  }
  *out = c10::Half(static_cast<uint16_t>((sign >> 16) | nonsign), c10::Half::from_bits());
}

using hf_zeropp_hash::mix32;

inline float uniform_from_counter(uint32_t key, int64_t index) {
  // fewer than 24 bits: the conversion and the power-of-two multiply are both exact
  return static_cast<float>(static_cast<int32_t>(hf_zeropp_hash::counter_bits(key, index))) * kTwoPowMinus24;
}

inline int32_t low_nibble(uint8_t b) {
  return ((b & 0xF) ^ 8) - 8;
}

inline int32_t high_nibble(uint8_t b) {
  return ((b >> 4) ^ 8) - 8;
}

template <typename T>
float block_absmax(const T* x, int64_t n) {
  // Integer max over the bit patterns of |x|: for non-negative floats it orders like the values, and every NaN
  // pattern lies above +Inf, so one NaN makes the block's absmax NaN as torch.amax does (fmaxf would drop it).
  int32_t m = 0;
  for (int64_t j = 0; j < n; ++j) {
    const int32_t a = static_cast<int32_t>(float_bits(to_float(x[j])) & 0x7FFFFFFFu);
    m = a > m ? a : m;
  }
  return bits_float(static_cast<uint32_t>(m));
}

// Codes of n elements of a block with a usable (finite, non-zero) scale; element j draws counter index0 + j.
template <int kBits, bool kStochastic, typename T>
void quantize_span(const T* x, int64_t n, float scale, uint32_t key, int64_t index0, int8_t* q) {
  constexpr float kQ = qmax<kBits>();
  constexpr int32_t kQInt = static_cast<int32_t>(kQ);
  for (int64_t j = 0; j < n; ++j) {
    // The scale is usable, so v is finite (|v| <= ~2 * qmax when the scale is a rounded denormal).
    const float v = to_float(x[j]) / scale;
    int32_t code;
    if constexpr (kStochastic) {
      const float w = std::min(std::max(v, -kQ), kQ) + uniform_from_counter(key, index0 + j);
      // floor(w): truncation rounds negative non-integers up, so step those down by one.
      code = static_cast<int32_t>(w);
      code -= static_cast<float>(code) > w;
      // w >= -qmax, but v == qmax plus u close to 1 rounds to qmax + 1.
      code = std::min(code, kQInt);
    } else {
      // Rounding commutes with clamping to the integers +-qmax, so the clamp is done on the integer: a float
      // clamp before the rounding is turned into branches by gcc, which then cannot vectorize the loop.
      code = static_cast<int32_t>((v + kRoundMagic) - kRoundMagic);
      code = std::min(std::max(code, -kQInt), kQInt);
    }
    q[j] = static_cast<int8_t>(code);
  }
}

// Two codes per byte: element 2i in the low nibble, 2i + 1 in the high one; an odd n leaves a zero high nibble.
inline void pack_int4(const int8_t* q, int64_t n, uint8_t* out) {
  for (int64_t i = 0; i < n / 2; ++i) {
    out[i] = static_cast<uint8_t>((static_cast<uint8_t>(q[2 * i]) & 0xF) | (static_cast<uint8_t>(q[2 * i + 1]) << 4));
  }
  if (n & 1) {
    out[n / 2] = static_cast<uint8_t>(static_cast<uint8_t>(q[n - 1]) & 0xF);
  }
}

// Quantizes one block of n elements into `codes` (its first byte) and returns its scale. Stochastic rounding
// numbers the block's elements from index0.
template <int kBits, bool kStochastic, typename T>
float quantize_block(const T* x, int64_t n, uint32_t key, int64_t index0, int8_t* codes) {
  const float scale = block_absmax(x, n) / qmax<kBits>();
  if (!std::isfinite(scale) || scale == 0.0f) {
    // Zero codes: dequantization gives 0 for an all-zero block and 0 * Inf/NaN = NaN for a non-finite one.
    std::memset(codes, 0, packed_length(n, kBits));
    return scale;
  }
  if constexpr (kBits == 8) {
    quantize_span<8, kStochastic>(x, n, scale, key, index0, codes);
  } else {
    int8_t staged[kChunk];
    uint8_t* packed = reinterpret_cast<uint8_t*>(codes);
    for (int64_t off = 0; off < n; off += kChunk) {
      const int64_t m = std::min(kChunk, n - off);
      quantize_span<4, kStochastic>(x + off, m, scale, key, index0 + off, staged);
      pack_int4(staged, m, packed + off / 2);
    }
  }
  return scale;
}

// Calls put(j, code * scale) for the n elements starting at a block's (or an even offset's) first code.
template <int kBits, typename Put>
void decode_span(const int8_t* codes, int64_t n, float scale, Put put) {
  if constexpr (kBits == 8) {
    for (int64_t j = 0; j < n; ++j) {
      put(j, static_cast<float>(codes[j]) * scale);
    }
  } else {
    const uint8_t* packed = reinterpret_cast<const uint8_t*>(codes);
    for (int64_t i = 0; i < n / 2; ++i) {
      put(2 * i, static_cast<float>(low_nibble(packed[i])) * scale);
      put(2 * i + 1, static_cast<float>(high_nibble(packed[i])) * scale);
    }
    if (n & 1) {
      put(n - 1, static_cast<float>(low_nibble(packed[n / 2])) * scale);
    }
  }
}

// Orthonormal Walsh-Hadamard transform of every whole run of `size` elements of v[0, n) (reference.hadamard_rows):
// butterfly stages h = 1, 2, ..., size / 2, then one multiply by `norm` = fp32(1 / sqrt(size)). A trailing run
// shorter than `size` is left as it is. The same additions in the same order as the reference, arranged for speed:
// stages 1 and 2 together on four elements in registers, the later ones as contiguous loops the compiler vectorizes,
// and the multiply folded into the last stage (still one rounding per operation).
void hadamard_groups(float* v, int64_t n, int64_t size, float norm) {
  const int64_t full = n / size * size;
  for (int64_t g = 0; g < full; g += size) {
    float* x = v + g;
    if (size == 2) {
      const float a = x[0], b = x[1];
      x[0] = (a + b) * norm;
      x[1] = (a - b) * norm;
      continue;
    }
    for (int64_t i = 0; i < size; i += 4) {
      const float s0 = x[i] + x[i + 1], s1 = x[i] - x[i + 1];
      const float s2 = x[i + 2] + x[i + 3], s3 = x[i + 2] - x[i + 3];
      x[i] = s0 + s2;
      x[i + 1] = s1 + s3;
      x[i + 2] = s0 - s2;
      x[i + 3] = s1 - s3;
    }
    for (int64_t h = 4; h < size; h *= 2) {
      const float scale = 2 * h == size ? norm : 1.0f;  // x * 1.0f is exact
      for (int64_t i = 0; i < size; i += 2 * h) {
        for (int64_t j = i; j < i + h; ++j) {
          const float a = x[j], b = x[j + h];
          x[j] = (a + b) * scale;
          x[j + h] = (a - b) * scale;
        }
      }
    }
    if (size == 4) {
      for (int64_t j = 0; j < 4; ++j) x[j] = x[j] * norm;
    }
  }
}

float hadamard_norm(int64_t size) {
  return static_cast<float>(1.0 / std::sqrt(static_cast<double>(size)));
}

// Quantizes `rows` rows of `length` elements of x. Output row r reads row source_row(r) of x, whose elements
// also give the stochastic counter (source_row(r) * length + column): the identity for quantize, the ZeRO++
// reorder for swizzle_quantize, fused so that no reordered copy is ever made.
// A non-zero `hadamard` quantizes each block's rotation (hadamard_groups) instead, staged in fp32.
template <int kBits, bool kStochastic, typename T, typename SourceRow>
void quantize_rows(const T* x, int64_t rows, int64_t length, int64_t block_size, uint32_t key, SourceRow source_row,
                   int64_t hadamard, int8_t* codes, float* scales) {
  const int64_t nb = ceil_div(length, block_size);
  const int64_t lc = packed_length(length, kBits);
  at::parallel_for(0, rows * nb, grain_blocks(length, block_size), [&](int64_t begin, int64_t end) {
    std::vector<float> rotated(hadamard ? static_cast<size_t>(std::min(block_size, length)) : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / nb;
      const int64_t col = (item % nb) * block_size;
      const int64_t src = source_row(r) * length + col;
      const int64_t n = std::min(block_size, length - col);
      int8_t* out = codes + r * lc + packed_length(col, kBits);
      if (hadamard) {
        for (int64_t j = 0; j < n; ++j) rotated[j] = to_float(x[src + j]);
        hadamard_groups(rotated.data(), n, hadamard, hadamard_norm(hadamard));
        scales[item] = quantize_block<kBits, kStochastic>(rotated.data(), n, key, src, out);
      } else {
        scales[item] = quantize_block<kBits, kStochastic>(x + src, n, key, src, out);
      }
    }
  });
}

template <int kBits, typename Out>
void dequantize_rows(const int8_t* codes, const float* scales, int64_t rows, int64_t length, int64_t block_size,
                     Out* out) {
  const int64_t nb = ceil_div(length, block_size);
  const int64_t lc = packed_length(length, kBits);
  at::parallel_for(0, rows * nb, grain_blocks(length, block_size), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / nb;
      const int64_t col = (item % nb) * block_size;
      const int8_t* c = codes + r * lc + packed_length(col, kBits);
      const int64_t n = std::min(block_size, length - col);
      const float scale = scales[item];
      Out* o = out + r * length + col;
      // code * scale is NaN only for a non-finite scale (a block that held NaN or Inf).
      if (std::isfinite(scale)) {
        decode_span<kBits>(c, n, scale, [o](int64_t j, float v) { store_as<false>(v, o + j); });
      } else {
        decode_span<kBits>(c, n, scale, [o](int64_t j, float v) { store_as<true>(v, o + j); });
      }
    }
  });
}

// Sum over the k inputs (codes (k, rows, lc), scales (k, rows, nb)) of n elements of one block into acc, adding in
// input order ((x0 + x1) + x2) + ...
template <int kBits>
void decode_sum(const int8_t* codes, const float* scales, int64_t k, int64_t input_codes, int64_t input_scales,
                int64_t code_offset, int64_t item, int64_t n, float* acc) {
  decode_span<kBits>(codes + code_offset, n, scales[item], [acc](int64_t j, float v) { acc[j] = v; });
  for (int64_t i = 1; i < k; ++i) {
    decode_span<kBits>(codes + i * input_codes + code_offset, n, scales[i * input_scales + item],
                       [acc](int64_t j, float v) { acc[j] = acc[j] + v; });
  }
}

template <int kInBits, int kOutBits, bool kStochastic>
void dequant_reduce_quant_rows(const int8_t* codes, const float* scales, int64_t k, int64_t rows, int64_t length,
                               int64_t block_size, uint32_t key, int8_t* out_codes, float* out_scales) {
  const int64_t nb = ceil_div(length, block_size);
  const int64_t lc_in = packed_length(length, kInBits);
  const int64_t lc_out = packed_length(length, kOutBits);
  at::parallel_for(0, rows * nb, grain_blocks(length, block_size), [&](int64_t begin, int64_t end) {
    // The whole block's sum is needed before its absmax is known.
    std::vector<float> acc(static_cast<size_t>(std::min(block_size, length)));
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / nb;
      const int64_t col = (item % nb) * block_size;
      const int64_t n = std::min(block_size, length - col);
      decode_sum<kInBits>(codes, scales, k, rows * lc_in, rows * nb, r * lc_in + packed_length(col, kInBits), item,
                          n, acc.data());
      out_scales[item] = quantize_block<kOutBits, kStochastic>(acc.data(), n, key, r * length + col,
                                                               out_codes + r * lc_out + packed_length(col, kOutBits));
    }
  });
}

// Pieces of kChunk elements start at multiples of kChunk within a block, so they hold whole rotation groups
// (hadamard divides both kChunk and the block size); only a row's end can cut a group short.
template <int kBits, typename Out>
void dequant_reduce_rows(const int8_t* codes, const float* scales, int64_t k, int64_t rows, int64_t length,
                         int64_t block_size, float scale, int64_t hadamard, Out* out) {
  const int64_t nb = ceil_div(length, block_size);
  const int64_t lc = packed_length(length, kBits);
  at::parallel_for(0, rows * nb, grain_blocks(length, block_size), [&](int64_t begin, int64_t end) {
    float acc[kChunk];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / nb;
      const int64_t col = (item % nb) * block_size;
      const int64_t n = std::min(block_size, length - col);
      Out* o = out + r * length + col;
      for (int64_t off = 0; off < n; off += kChunk) {
        const int64_t m = std::min(kChunk, n - off);
        decode_sum<kBits>(codes, scales, k, rows * lc, rows * nb, r * lc + packed_length(col + off, kBits), item, m,
                          acc);
        if (hadamard) hadamard_groups(acc, m, hadamard, hadamard_norm(hadamard));
        // Unlike in dequantize_rows, NaN can come from any input's block, so it is always handled.
        for (int64_t j = 0; j < m; ++j) {
          store_as<true>(acc[j] * scale, o + off + j);
        }
      }
    }
  });
}

// ---- dispatch from runtime values to the template instantiations ----

template <typename F>
void dispatch_float_type(const at::Tensor& t, const char* name, F&& f) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return f(float{});
    case at::kHalf:
      return f(c10::Half{});
    case at::kBFloat16:
      return f(c10::BFloat16{});
    default:
      TORCH_INTERNAL_ASSERT(false, name, " has dtype ", t.scalar_type(), "; check_float_dtype should have refused it");
  }
}

template <typename F>
void dispatch_bits(int64_t bits, F&& f) {
  if (bits == 8) {
    f(std::integral_constant<int, 8>{});
  } else {
    f(std::integral_constant<int, 4>{});
  }
}

template <typename F>
void dispatch_bool(bool value, F&& f) {
  if (value) {
    f(std::true_type{});
  } else {
    f(std::false_type{});
  }
}

// ---- argument checks ----

void check_tensor(const at::Tensor& t, const char* name, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got one on ", t.device());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimension(s), got shape ", t.sizes());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_dtype(const at::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

void check_float_dtype(const at::Tensor& t, const char* name) {
  const auto dtype = t.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, name,
              " must be float32, float16 or bfloat16, got ", dtype);
}

void check_shape(const at::Tensor& t, const char* name, at::IntArrayRef expected) {
  TORCH_CHECK(t.sizes() == expected, name, " has shape ", t.sizes(), ", expected ", expected);
}

void check_format(int64_t bits, int64_t block_size, const char* bits_name = "bits") {
  TORCH_CHECK(bits == 8 || bits == 4, bits_name, " must be 8 or 4, got ", bits);
  TORCH_CHECK(block_size >= 1, "block_size must be positive, got ", block_size);
  TORCH_CHECK(bits == 8 || block_size % 2 == 0, "block_size must be even for 4-bit codes (a byte may not straddle ",
              "two blocks), got ", block_size);
}

void check_hadamard(int64_t hadamard, int64_t block_size) {
  TORCH_CHECK(hadamard >= 0 && hadamard <= 128 && (hadamard & (hadamard - 1)) == 0 && hadamard != 1,
              "hadamard must be 0 or a power of two from 2 to 128, got ", hadamard);
  TORCH_CHECK(hadamard == 0 || block_size % hadamard == 0, "block_size ", block_size,
              " is not a multiple of hadamard ", hadamard);
}

// Checks a (k, rows, ·) stack of quantized inputs with rows of `length` elements.
void check_stacked_codes(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block_size,
                         int64_t length) {
  check_tensor(codes, "codes", 3);
  check_tensor(scales, "scales", 3);
  check_dtype(codes, "codes", at::kChar);
  check_dtype(scales, "scales", at::kFloat);
  TORCH_CHECK(codes.size(0) >= 1, "codes must stack at least one input (k >= 1)");
  check_shape(codes, "codes", {codes.size(0), codes.size(1), packed_length(length, bits)});
  check_shape(scales, "scales", {codes.size(0), codes.size(1), ceil_div(length, block_size)});
}

uint32_t stochastic_key(int64_t seed) {
  return mix32(static_cast<uint32_t>(seed));
}

// ---- exported functions ----

void quantize_(const at::Tensor& x, int64_t bits, int64_t block_size, bool stochastic, int64_t seed,
               int64_t hadamard, const at::Tensor& codes, const at::Tensor& scales) {
  check_format(bits, block_size);
  check_hadamard(hadamard, block_size);
  check_tensor(x, "x", 2);
  check_tensor(codes, "codes", 2);
  check_tensor(scales, "scales", 2);
  check_float_dtype(x, "x");
  check_dtype(codes, "codes", at::kChar);
  check_dtype(scales, "scales", at::kFloat);
  const int64_t rows = x.size(0);
  const int64_t length = x.size(1);
  check_shape(codes, "codes", {rows, packed_length(length, bits)});
  check_shape(scales, "scales", {rows, ceil_div(length, block_size)});
  if (x.numel() == 0) {
    return;
  }
  dispatch_float_type(x, "x", [&](auto tag) {
    using T = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      dispatch_bool(stochastic, [&](auto s) {
        quantize_rows<decltype(b)::value, decltype(s)::value>(
            x.const_data_ptr<T>(), rows, length, block_size, stochastic_key(seed), [](int64_t r) { return r; },
            hadamard, codes.mutable_data_ptr<int8_t>(), scales.mutable_data_ptr<float>());
      });
    });
  });
}

void dequantize_(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block_size,
                 int64_t hadamard, const at::Tensor& out) {
  check_format(bits, block_size);
  check_hadamard(hadamard, block_size);
  check_tensor(codes, "codes", 2);
  check_tensor(scales, "scales", 2);
  check_tensor(out, "out", 2);
  check_dtype(codes, "codes", at::kChar);
  check_dtype(scales, "scales", at::kFloat);
  check_float_dtype(out, "out");
  const int64_t rows = out.size(0);
  const int64_t length = out.size(1);
  check_shape(codes, "codes", {rows, packed_length(length, bits)});
  check_shape(scales, "scales", {rows, ceil_div(length, block_size)});
  if (out.numel() == 0) {
    return;
  }
  dispatch_float_type(out, "out", [&](auto tag) {
    using Out = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      if (hadamard) {  // the rotation needs the block staged in fp32: the reduction's path with k = 1, scale 1
        dequant_reduce_rows<decltype(b)::value>(codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), 1,
                                                rows, length, block_size, 1.0f, hadamard, out.mutable_data_ptr<Out>());
      } else {
        dequantize_rows<decltype(b)::value>(codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), rows,
                                            length, block_size, out.mutable_data_ptr<Out>());
      }
    });
  });
}

void swizzle_quantize_(const at::Tensor& x, int64_t nodes, int64_t node_size, int64_t stages, int64_t bits,
                       int64_t block_size, bool stochastic, int64_t seed, int64_t hadamard, const at::Tensor& codes,
                       const at::Tensor& scales) {
  check_format(bits, block_size);
  check_hadamard(hadamard, block_size);
  TORCH_CHECK(nodes >= 1 && node_size >= 1 && stages >= 1, "nodes, node_size and stages must be positive, got ",
              nodes, ", ", node_size, ", ", stages);
  check_tensor(x, "x", 1);
  check_tensor(codes, "codes", 2);
  check_tensor(scales, "scales", 2);
  check_float_dtype(x, "x");
  check_dtype(codes, "codes", at::kChar);
  check_dtype(scales, "scales", at::kFloat);
  const int64_t slices = nodes * node_size * stages;
  TORCH_CHECK(x.numel() % slices == 0, "x has ", x.numel(), " elements, not divisible by nodes*node_size*stages = ",
              slices);
  const int64_t length = x.numel() / slices;
  check_shape(codes, "codes", {slices, packed_length(length, bits)});
  check_shape(scales, "scales", {slices, ceil_div(length, block_size)});
  if (length == 0) {
    return;
  }
  // Destination row (s * node_size + d) * nodes + m holds source slice (m * node_size + d) * stages + s
  // (reference.swizzle_source_slices).
  auto source_row = [=](int64_t r) {
    const int64_t m = r % nodes;
    const int64_t d = (r / nodes) % node_size;
    const int64_t s = r / (nodes * node_size);
    return (m * node_size + d) * stages + s;
  };
  dispatch_float_type(x, "x", [&](auto tag) {
    using T = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      dispatch_bool(stochastic, [&](auto s) {
        quantize_rows<decltype(b)::value, decltype(s)::value>(
            x.const_data_ptr<T>(), slices, length, block_size, stochastic_key(seed), source_row, hadamard,
            codes.mutable_data_ptr<int8_t>(), scales.mutable_data_ptr<float>());
      });
    });
  });
}

void dequant_reduce_quant_(const at::Tensor& codes, const at::Tensor& scales, int64_t in_bits, int64_t block_size,
                           int64_t length, int64_t out_bits, bool stochastic, int64_t seed, const at::Tensor& out_codes,
                           const at::Tensor& out_scales) {
  check_format(in_bits, block_size, "in_bits");
  check_format(out_bits, block_size, "out_bits");
  TORCH_CHECK(length >= 0, "length must be non-negative, got ", length);
  check_stacked_codes(codes, scales, in_bits, block_size, length);
  check_tensor(out_codes, "out_codes", 2);
  check_tensor(out_scales, "out_scales", 2);
  check_dtype(out_codes, "out_codes", at::kChar);
  check_dtype(out_scales, "out_scales", at::kFloat);
  const int64_t k = codes.size(0);
  const int64_t rows = codes.size(1);
  check_shape(out_codes, "out_codes", {rows, packed_length(length, out_bits)});
  check_shape(out_scales, "out_scales", {rows, ceil_div(length, block_size)});
  if (rows == 0 || length == 0) {
    return;
  }
  dispatch_bits(in_bits, [&](auto in) {
    dispatch_bits(out_bits, [&](auto out) {
      dispatch_bool(stochastic, [&](auto s) {
        dequant_reduce_quant_rows<decltype(in)::value, decltype(out)::value, decltype(s)::value>(
            codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(), k, rows, length, block_size,
            stochastic_key(seed), out_codes.mutable_data_ptr<int8_t>(), out_scales.mutable_data_ptr<float>());
      });
    });
  });
}

void dequant_reduce_(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block_size,
                     double scale, int64_t hadamard, const at::Tensor& out) {
  check_format(bits, block_size);
  check_hadamard(hadamard, block_size);
  check_tensor(out, "out", 2);
  check_float_dtype(out, "out");
  const int64_t rows = out.size(0);
  const int64_t length = out.size(1);
  check_stacked_codes(codes, scales, bits, block_size, length);
  TORCH_CHECK(codes.size(1) == rows, "codes have ", codes.size(1), " rows but out has ", rows);
  if (out.numel() == 0) {
    return;
  }
  dispatch_float_type(out, "out", [&](auto tag) {
    using Out = decltype(tag);
    dispatch_bits(bits, [&](auto b) {
      // The reference multiplies by torch.tensor(scale, dtype=float32): the factor is rounded to fp32 first.
      dequant_reduce_rows<decltype(b)::value>(codes.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                                              codes.size(0), rows, length, block_size, static_cast<float>(scale),
                                              hadamard, out.mutable_data_ptr<Out>());
    });
  });
}

// ---- per-block widths on qgZ's inter-node hop (spec: hf_zeropp/kernels/allocation.py) ----

constexpr int64_t kMaxWidth = 8;
constexpr int kKeyShift = 23;   // the fp32 exponent's position: one width step per doubling of the scale
constexpr int64_t kGroup = 8;   // 8 codes of b bits fill b whole bytes

// Elements of block b of a row, rounded up to whole groups of 8 codes (a short last block is padded with zeros).
inline int64_t padded_count(int64_t length, int64_t block_size, int64_t b) {
  return ceil_div(std::min(block_size, length - b * block_size), kGroup) * kGroup;
}

inline bool usable_scale(float scale) {
  return std::isfinite(scale) && scale > 0.0f;
}

// The widths of one row's nb blocks from their absmax scales (allocation.block_widths): the largest offset T for
// which sum(width(T) * padded count) fits the fixed format's row bytes. The cost only grows with T, so the largest
// fitting T is unique and any bisection finds it.
void row_widths(const float* scales, int64_t nb, int64_t length, int64_t block_size, int64_t bits, int64_t floor,
                int32_t* widths) {
  const int64_t budget = 8 * packed_length(length, bits);
  std::vector<int64_t> keys(static_cast<size_t>(nb));
  int64_t usable_elements = 0;
  for (int64_t b = 0; b < nb; ++b) {
    keys[b] = usable_scale(scales[b]) ? static_cast<int64_t>(float_bits(scales[b])) : -1;  // -1: width 0
    usable_elements += keys[b] >= 0 ? padded_count(length, block_size, b) : 0;
  }
  int64_t row_floor = 0;  // allocation._row_floors: the floor, lowered until every usable block can have it
  for (int64_t width = 2; width <= floor; ++width) {
    if (width * usable_elements <= budget) row_floor = width;
  }
  auto width_at = [&](int64_t b, int64_t offset) -> int64_t {
    if (keys[b] < 0) return 0;
    const int64_t shifted = keys[b] + offset;
    const int64_t width = std::max(shifted < 0 ? 0 : std::min(shifted >> kKeyShift, kMaxWidth), row_floor);
    return width == 1 ? 0 : width;  // one level holds only zero
  };
  auto fits = [&](int64_t offset) {
    int64_t cost = 0;
    for (int64_t b = 0; b < nb; ++b) cost += width_at(b, offset) * padded_count(length, block_size, b);
    return cost <= budget;
  };
  int64_t low = -(int64_t{1} << 32);  // every usable block at the row's floor: fits
  int64_t high = int64_t{1} << 32;    // every usable block at kMaxWidth: may not fit
  if (fits(high)) low = high;
  while (high - low > 1) {
    const int64_t middle = low + (high - low) / 2;
    (fits(middle) ? low : high) = middle;
  }
  for (int64_t b = 0; b < nb; ++b) widths[b] = static_cast<int32_t>(width_at(b, low));
}

// Widths and first code byte (within the row) of every block of `rows` rows, the rows in parallel.
void allocated_layout(const float* scales, int64_t rows, int64_t length, int64_t block_size, int64_t bits,
                      int64_t floor, int32_t* widths, int64_t* starts) {
  const int64_t nb = ceil_div(length, block_size);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      row_widths(scales + r * nb, nb, length, block_size, bits, floor, widths + r * nb);
      int64_t start = 0;
      for (int64_t b = 0; b < nb; ++b) {
        starts[r * nb + b] = start;
        start += widths[r * nb + b] * padded_count(length, block_size, b) / 8;
      }
    }
  });
}

inline int64_t width_qmax(int32_t width) {
  return std::max<int64_t>((int64_t{1} << width) / 2 - 1, 0);
}

// The step of a block at its width, as the spec computes it: absmax / max(qmax, 1) in fp32.
inline float width_step(float absmax, int64_t qmax) {
  return absmax / static_cast<float>(std::max<int64_t>(qmax, 1));
}

// Unsigned codes (code + qmax) of one block with a usable scale and a width >= 2: `count` elements of `x`, the
// block's n elements followed by zeros, which quantize as zeros as in the spec. The loop is branch-free (|v| stays
// below ~2 qmax, so the integer conversions are exact) so that it vectorizes.
template <bool kStochastic>
void allocated_codes(const float* x, int64_t count, float absmax, int32_t width, uint32_t key, int64_t index0,
                     int32_t* codes) {
  const int32_t qmax = static_cast<int32_t>(width_qmax(width));
  const float step = std::max(width_step(absmax, qmax), std::numeric_limits<float>::min());
  for (int64_t j = 0; j < count; ++j) {
    const float v = x[j] / step;
    int32_t code;
    if constexpr (kStochastic) {
      const float w = v + uniform_from_counter(key, index0 + j);
      code = static_cast<int32_t>(w);
      code -= static_cast<float>(code) > w;  // floor: truncation rounds negative non-integers up
    } else {
      code = static_cast<int32_t>((v + kRoundMagic) - kRoundMagic);
    }
    codes[j] = std::min(std::max(code, -qmax), qmax) + qmax;
  }
}

// Packs `count` unsigned codes of `width` bits, 8 codes per `width` bytes, little-endian.
void pack_width(const int32_t* codes, int64_t count, int32_t width, uint8_t* out) {
  for (int64_t g = 0; g < count; g += kGroup) {
    uint64_t packed = 0;
    for (int64_t k = 0; k < kGroup; ++k) packed |= static_cast<uint64_t>(codes[g + k]) << (k * width);
    for (int32_t byte = 0; byte < width; ++byte) {
      out[g / kGroup * width + byte] = static_cast<uint8_t>(packed >> (8 * byte));
    }
  }
}

// Checks the format's arguments, the (rows, length) fp32 `values` and the codes and scales that encode them.
void check_allocated(int64_t bits, int64_t block_size, int64_t floor, const at::Tensor& codes,
                     const at::Tensor& scales, const at::Tensor& values, const char* values_name) {
  check_tensor(values, values_name, 2);
  check_dtype(values, values_name, at::kFloat);
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(block_size >= kGroup && block_size % kGroup == 0, "block_size must be a positive multiple of 8 for "
              "per-block widths, got ", block_size);
  TORCH_CHECK(floor == 0 || (floor >= 2 && floor <= kMaxWidth), "floor must be 0 or 2 to 8, got ", floor);
  check_tensor(codes, "codes", 2);
  check_tensor(scales, "scales", 2);
  check_dtype(codes, "codes", at::kChar);
  check_dtype(scales, "scales", at::kFloat);
  check_shape(codes, "codes", {values.size(0), packed_length(values.size(1), bits)});
  check_shape(scales, "scales", {values.size(0), ceil_div(values.size(1), block_size)});
}

void quantize_allocated_(const at::Tensor& x, int64_t bits, int64_t block_size, bool stochastic, int64_t seed,
                         int64_t floor, const at::Tensor& codes, const at::Tensor& scales) {
  check_allocated(bits, block_size, floor, codes, scales, x, "x");
  const int64_t rows = x.size(0);
  const int64_t length = x.size(1);
  const int64_t nb = ceil_div(length, block_size);
  const int64_t row_bytes = packed_length(length, bits);
  if (x.numel() == 0) {
    return;
  }
  const float* xs = x.const_data_ptr<float>();
  float* absmax = scales.mutable_data_ptr<float>();
  at::parallel_for(0, rows * nb, grain_blocks(length, block_size), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t col = (item % nb) * block_size;
      absmax[item] = block_absmax(xs + (item / nb) * length + col, std::min(block_size, length - col));
    }
  });
  std::vector<int32_t> widths(static_cast<size_t>(rows * nb));
  std::vector<int64_t> starts(static_cast<size_t>(rows * nb));
  allocated_layout(absmax, rows, length, block_size, bits, floor, widths.data(), starts.data());
  uint8_t* out = reinterpret_cast<uint8_t*>(codes.mutable_data_ptr<int8_t>());
  std::memset(out, 0, static_cast<size_t>(rows * row_bytes));  // width-0 blocks and the row's unused tail
  const uint32_t key = stochastic_key(seed);
  at::parallel_for(0, rows * nb, grain_blocks(length, block_size), [&](int64_t begin, int64_t end) {
    const int64_t staged_size = ceil_div(std::min(block_size, length), kGroup) * kGroup;
    std::vector<float> staged(static_cast<size_t>(staged_size), 0.0f);
    std::vector<int32_t> codes_of_block(static_cast<size_t>(staged_size));
    for (int64_t item = begin; item < end; ++item) {
      if (widths[item] == 0) continue;
      const int64_t r = item / nb;
      const int64_t b = item % nb;
      const int64_t col = b * block_size;
      const int64_t n = std::min(block_size, length - col);
      const int64_t count = padded_count(length, block_size, b);
      std::copy(xs + r * length + col, xs + r * length + col + n, staged.begin());
      std::fill(staged.begin() + n, staged.begin() + count, 0.0f);
      if (stochastic) {
        allocated_codes<true>(staged.data(), count, absmax[item], widths[item], key, r * length + col,
                              codes_of_block.data());
      } else {
        allocated_codes<false>(staged.data(), count, absmax[item], widths[item], key, r * length + col,
                               codes_of_block.data());
      }
      pack_width(codes_of_block.data(), count, widths[item], out + r * row_bytes + starts[item]);
    }
  });
}

void dequantize_allocated_(const at::Tensor& codes, const at::Tensor& scales, int64_t bits, int64_t block_size,
                           int64_t floor, const at::Tensor& out) {
  check_allocated(bits, block_size, floor, codes, scales, out, "out");
  const int64_t rows = out.size(0);
  const int64_t length = out.size(1);
  const int64_t nb = ceil_div(length, block_size);
  const int64_t row_bytes = packed_length(length, bits);
  if (out.numel() == 0) {
    return;
  }
  const float* absmax = scales.const_data_ptr<float>();
  std::vector<int32_t> widths(static_cast<size_t>(rows * nb));
  std::vector<int64_t> starts(static_cast<size_t>(rows * nb));
  allocated_layout(absmax, rows, length, block_size, bits, floor, widths.data(), starts.data());
  const uint8_t* in = reinterpret_cast<const uint8_t*>(codes.const_data_ptr<int8_t>());
  float* values = out.mutable_data_ptr<float>();
  at::parallel_for(0, rows * nb, grain_blocks(length, block_size), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / nb;
      const int64_t col = (item % nb) * block_size;
      const int64_t n = std::min(block_size, length - col);
      float* o = values + r * length + col;
      const int32_t width = widths[item];
      if (width == 0) {
        const float zero = 0.0f * absmax[item];  // NaN for a block that held NaN or Inf, as in the fixed format
        for (int64_t j = 0; j < n; ++j) o[j] = zero;
        continue;
      }
      const int64_t qmax = width_qmax(width);
      const float step = width_step(absmax[item], qmax);
      const uint8_t* block_in = in + r * row_bytes + starts[item];
      const uint64_t mask = (uint64_t{1} << width) - 1;
      for (int64_t g = 0; g < n; g += kGroup) {
        uint64_t packed = 0;
        for (int32_t byte = 0; byte < width; ++byte) {
          packed |= static_cast<uint64_t>(block_in[g / kGroup * width + byte]) << (8 * byte);
        }
        for (int64_t k = 0; k < kGroup && g + k < n; ++k) {
          const int64_t code = static_cast<int64_t>((packed >> (k * width)) & mask) - qmax;
          o[g + k] = static_cast<float>(code) * step;
        }
      }
    }
  });
}

}  // namespace

HF_ZEROPP_REGISTER_KERNELS(CPU)
