// CUDA kernels for symmetric block quantization; the format and every rounding follow
// hf_zeropp/kernels/reference.py bit for bit.
//
// Work decomposition. A row of `length` elements holds nb = ceil(length / block_size) quantization blocks, each cut
// into tiles of at most G * C * 8 elements. A group of G threads (a slice of a warp, a warp, or a whole CTA) owns a
// tile; each thread holds C chunks of 8 consecutive elements in registers, chunk c of lane l starting (c * G + l) * 8
// elements into the tile so that a warp's accesses are contiguous. Chunks start at multiples of 8 from the block start:
// a chunk never straddles two blocks, and a 4-bit chunk is whole bytes (block sizes are even for 4 bits).
// G and C are picked from the block size so that a block up to kMaxFusedBlock elements is a single tile: its absmax,
// scale and codes come from one read of the input, and the values stay in registers in between. Larger blocks (the
// "one block per row" mode) would leave most SMs idle as one tile, so they are cut into tiles of kSplitTile elements
// and quantized in three passes: absmax by atomicMax into the scales buffer, quantization, absmax -> scale; the input is
// read twice.
//
// Loads ahead. A thread loads the raw bits of its chunks of a tile, then converts and computes; the kernels' loops
// stage the loads of the next tile before they compute the current one, so a thread has a tile's loads in flight
// while it works. When every chunk of a tile is whole and the tile's first element aligned, the loads are
// straight-line 16-byte (values), 8-byte (int8 codes) or 4-byte (int4 codes) accesses; any other tile (odd row
// lengths, block sizes that are not a multiple of 8, row tails) is read element by element, so nothing is assumed
// about the caller's alignment. Stores are checked per chunk.
//
// Hadamard rotation. A rotation group of H <= 128 elements is H / 8 consecutive chunks of one tile (tiles start at
// multiples of H: block sizes are multiples of H, and tile sizes are powers of two >= H unless the row is shorter
// than H). Chunk number c * G + lane splits into lane bits (low) and register bits (high): the butterfly stages
// h = 1, 2, 4 pair elements of one chunk, h = 8 * 2^b pairs chunk bit b, which is a lane (a shuffle within the
// warp, H / 8 <= 16 lanes) or a register index (a swap inside the thread). Elements of a group cut short by the
// row's end take no part, as in the reference.
//
// Exactness. Conversions are the round-to-nearest intrinsics or exact integer tricks (round_to_int, code_to_float),
// every product, sum and quotient a single rounding (__fmul_rn, __fadd_rn, __fdiv_rn; the file is also built with
// --fmad=false). A block's absmax is the unsigned maximum
// of its values' bit patterns with the sign bit cleared: that orders non-negative floats as fmaxf would, but every NaN
// pattern exceeds +inf's, so a NaN wins as it does in torch.amax (fmaxf would drop it).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <type_traits>

#include "counter_hash.h"
#include "quant_kernels.h"

namespace hf_zeropp {
namespace {

constexpr int kChunk = 8;                          // elements per chunk
constexpr int kMaxFusedGroup = 512;                // threads per group of the largest single-tile shape
constexpr int kChunksPerThread = 4;                // C of the multi-warp shapes
constexpr int64_t kMaxFusedBlock = int64_t(kMaxFusedGroup) * kChunksPerThread * kChunk;
constexpr int kSplitGroup = 256;                   // G of the split (multi-tile block) path
constexpr int64_t kSplitTile = int64_t(kSplitGroup) * kChunksPerThread * kChunk;
constexpr int64_t kDequantTile = 32 * 2 * kChunk;  // largest tile of dequantization (shape 32 x 2)
constexpr int kMaxRotation = 128;                  // largest Hadamard group (cuda_binding.cpp checks it)

constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
constexpr int64_t packed_length(int64_t length, int bits) { return bits == 8 ? length : (length + 1) / 2; }

using hf_zeropp_hash::mix32;

// U[0, 1) for an element index, as reference.uniform_from_counter; key = mix32(lo32(seed)).
__device__ __forceinline__ float uniform(uint32_t key, int64_t index) {
  const uint32_t h = hf_zeropp_hash::counter_bits(key, index);
  return __fmul_rn(__uint2float_rn(h), 5.9604644775390625e-08f);  // exact: h < 2**24, times 2**-24
}

// 64-bit division is a long software sequence; tile and row numbers nearly always fit 32 bits.
__device__ __forceinline__ int64_t div_nonneg(int64_t a, int64_t b) {
  const uint64_t ua = static_cast<uint64_t>(a), ub = static_cast<uint64_t>(b);
  if (((ua | ub) >> 32) == 0) return static_cast<uint32_t>(ua) / static_cast<uint32_t>(ub);
  return static_cast<int64_t>(ua / ub);
}

__device__ __forceinline__ int chunk_count(int n, int offset) {
  const int left = n - offset;
  return left <= 0 ? 0 : (left < kChunk ? left : kChunk);
}

template <unsigned kBytes, typename T>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & (kBytes - 1)) == 0;
}

// ---------------------------------------------------------------------------------------------------------------
// Element conversion and chunk access
//
// A thread first loads the raw bits of its chunks of a tile and converts them later, so that the loads of the next
// tile are in flight while the current one is computed (see the kernels' loops). Chunks of 8 elements are stored
// as 32-bit words: 2 * sizeof(T) words of values, 2 words of int8 codes or 1 word of int4 codes.

// Round half to even, exact for |r| < 2^22: adding 1.5 * 2^23 leaves the rounded integer in the low mantissa bits.
// Full-rate arithmetic in place of the conversion unit's rint and float-to-int, which quantization would saturate.
constexpr float kRoundingBias = 12582912.0f;
constexpr int32_t kRoundingBiasBits = 0x4B400000;

__device__ __forceinline__ int round_to_int(float r) {
  return __float_as_int(__fadd_rn(r, kRoundingBias)) - kRoundingBiasBits;
}

// The same trick backwards: an integer code (|q| < 2^22) as a float, exactly.
__device__ __forceinline__ float code_to_float(int q) {
  return __fsub_rn(__int_as_float(kRoundingBiasBits + q), kRoundingBias);
}

template <typename T>
struct Convert;

template <>
struct Convert<float> {
  static __device__ __forceinline__ float low(uint32_t w) { return __uint_as_float(w); }
  static __device__ __forceinline__ uint32_t bits(float v) { return __float_as_uint(v); }
};

template <>
struct Convert<__half> {
  static __device__ __forceinline__ float low(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w & 0xFFFFu)));
  }
  static __device__ __forceinline__ float high(uint32_t w) {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(w >> 16)));
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {  // one conversion for both halves
    const __half2 h = __floats2half2_rn(lo, hi);
    return static_cast<uint32_t>(__half_as_ushort(__low2half(h))) |
           (static_cast<uint32_t>(__half_as_ushort(__high2half(h))) << 16);
  }
  static __device__ __forceinline__ uint32_t bits(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

template <>
struct Convert<__nv_bfloat16> {
  static __device__ __forceinline__ float low(uint32_t w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float high(uint32_t w) { return __uint_as_float(w & 0xFFFF0000u); }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return static_cast<uint32_t>(__bfloat16_as_ushort(__low2bfloat16(h))) |
           (static_cast<uint32_t>(__bfloat16_as_ushort(__high2bfloat16(h))) << 16);
  }
  static __device__ __forceinline__ uint32_t bits(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};

template <typename T>
struct ValueWords {
  static constexpr int kPerChunk = 2 * sizeof(T);  // 32-bit words per chunk
};

template <typename T>
__device__ __forceinline__ uint32_t element_bits(const T* p) {
  if constexpr (sizeof(T) == 4) {
    return __float_as_uint(*reinterpret_cast<const float*>(p));
  } else {
    return *reinterpret_cast<const unsigned short*>(p);
  }
}

// w <- the raw bits of a thread's C chunks of a tile of n elements starting at p (zeros past n). When every chunk
// of the tile is whole and p is 16-byte aligned (chunks are 8 elements, so at least 16 bytes, apart), the loads are
// straight-line 16-byte loads with nothing in between; otherwise element by element.
template <typename T, int G, int C>
__device__ __forceinline__ void load_value_bits(const T* p, int n, int lane,
                                                uint32_t w[C][ValueWords<T>::kPerChunk]) {
  constexpr int kWords = ValueWords<T>::kPerChunk;
  if (n % kChunk == 0 && is_aligned<16>(p)) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int offset = (c * G + lane) * kChunk;
#pragma unroll
      for (int i = 0; i < kWords / 4; ++i) {
        const uint4 a = offset < n ? reinterpret_cast<const uint4*>(p + offset)[i] : make_uint4(0, 0, 0, 0);
        w[c][4 * i] = a.x; w[c][4 * i + 1] = a.y; w[c][4 * i + 2] = a.z; w[c][4 * i + 3] = a.w;
      }
    }
    return;
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int offset = (c * G + lane) * kChunk;
    const int cnt = chunk_count(n, offset);
#pragma unroll
    for (int i = 0; i < kWords; ++i) w[c][i] = 0;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (j < cnt) {
        if constexpr (sizeof(T) == 4) {
          w[c][j] = element_bits(p + offset + j);
        } else {  // little endian: the lower half of a word is the lower address
          w[c][j / 2] |= element_bits(p + offset + j) << (16 * (j % 2));
        }
      }
    }
  }
}

template <typename T>
__device__ __forceinline__ void bits_to_values(const uint32_t w[ValueWords<T>::kPerChunk], float v[kChunk]) {
#pragma unroll
  for (int j = 0; j < kChunk; ++j) {
    if constexpr (sizeof(T) == 4) {
      v[j] = Convert<T>::low(w[j]);
    } else {
      v[j] = j % 2 ? Convert<T>::high(w[j / 2]) : Convert<T>::low(w[j / 2]);
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_values(T* p, int cnt, const float v[kChunk]) {
  if (cnt == kChunk && is_aligned<16>(p)) {
    if constexpr (sizeof(T) == 4) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      uint32_t words[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) words[i] = Convert<T>::pack(v[2 * i], v[2 * i + 1]);
      *reinterpret_cast<uint4*>(p) = make_uint4(words[0], words[1], words[2], words[3]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (j < cnt) {
        const uint32_t b = Convert<T>::bits(v[j]);
        if constexpr (sizeof(T) == 4) {
          reinterpret_cast<uint32_t*>(p)[j] = b;
        } else {
          reinterpret_cast<unsigned short*>(p)[j] = static_cast<unsigned short>(b);
        }
      }
    }
  }
}

// w <- the codes of a thread's C chunks of a tile of n elements whose first code byte is p: 2 words per chunk of
// int8 codes, 1 of int4 (element 2i is the low and 2i + 1 the high nibble of byte i); zeros past n. Whole tiles at
// an aligned address load as straight-line 8- or 4-byte loads.
template <int G, int C>
__device__ __forceinline__ void load_code_bits(const int8_t* p, int bits, int n, int lane, uint32_t w[C][2]) {
  const bool vector = n % kChunk == 0 && (bits == 8 ? is_aligned<8>(p) : is_aligned<4>(p));
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int offset = (c * G + lane) * kChunk;
    const int8_t* chunk = p + (bits == 8 ? offset : offset / 2);
    w[c][0] = 0;
    w[c][1] = 0;
    if (vector) {
      if (offset < n) {
        if (bits == 8) {
          const uint2 a = *reinterpret_cast<const uint2*>(chunk);
          w[c][0] = a.x;
          w[c][1] = a.y;
        } else {
          w[c][0] = *reinterpret_cast<const uint32_t*>(chunk);
        }
      }
    } else {
      const int cnt = chunk_count(n, offset);
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (j < cnt) {
          const uint32_t byte = static_cast<uint8_t>(chunk[bits == 8 ? j : j / 2]);
          if (bits == 8) {
            w[c][j / 4] |= byte << (8 * (j % 4));
          } else {  // only this element's nibble: an odd tile's last byte holds no element past n
            w[c][0] |= ((byte >> (4 * (j % 2))) & 0xFu) << (4 * j);
          }
        }
      }
    }
  }
}

// Code j of a chunk's words, sign-extended: shift its field to the top, then back down.
__device__ __forceinline__ int code_at(const uint32_t w[2], int bits, int j) {
  return bits == 8 ? static_cast<int32_t>(w[j / 4] << (24 - 8 * (j % 4))) >> 24
                   : static_cast<int32_t>(w[0] << (28 - 4 * j)) >> 28;
}

// Stores the chunk's first cnt codes (q is zero past cnt, so an odd row's last byte gets a zero high nibble).
__device__ __forceinline__ void store_codes(int8_t* p, int bits, int cnt, const int q[kChunk]) {
  if (bits == 8) {
    if (cnt == kChunk && is_aligned<8>(p)) {
      uint32_t lo = 0, hi = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        lo |= (static_cast<uint32_t>(q[j]) & 0xFFu) << (8 * j);
        hi |= (static_cast<uint32_t>(q[j + 4]) & 0xFFu) << (8 * j);
      }
      *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
    } else {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if (j < cnt) p[j] = static_cast<int8_t>(q[j]);
      }
    }
  } else {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < kChunk; ++j) w |= (static_cast<uint32_t>(q[j]) & 0xFu) << (4 * j);
    if (cnt == kChunk && is_aligned<4>(p)) {
      *reinterpret_cast<uint32_t*>(p) = w;
    } else {
#pragma unroll
      for (int i = 0; i < kChunk / 2; ++i) {
        if (2 * i < cnt) p[i] = static_cast<int8_t>(static_cast<uint8_t>(w >> (8 * i)));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Rounding

struct Quantizer {
  float qmax;
  bool stochastic;
  uint32_t key;  // mix32(lo32(seed))

  // Codes of a chunk whose first element has stochastic-rounding index `index`. An unusable block (scale zero, NaN
  // or infinite) and the elements past cnt get code 0.
  __device__ __forceinline__ void operator()(const float v[kChunk], int cnt, float scale, bool usable, int64_t index,
                                             int q[kChunk]) const {
    const int code_max = static_cast<int>(qmax);
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      int code = 0;
      if (usable && j < cnt) {
        const float r = fminf(fmaxf(__fdiv_rn(v[j], scale), -qmax), qmax);
        if (stochastic) {
          const float sum = __fadd_rn(r, uniform(key, index + j));
          code = round_to_int(sum);
          if (code_to_float(code) > sum) code -= 1;  // floor
          code = min(max(code, -code_max), code_max);
        } else {
          code = round_to_int(r);  // half to even, as torch.round
        }
      }
      q[j] = code;
    }
  }
};

// The orthonormal Walsh-Hadamard transform applied to every whole run of `size` elements (reference.hadamard_rows);
// size == 0 is no rotation.
struct Rotation {
  int size;
  float norm;  // fp32(1 / sqrt(size))
};

Rotation make_rotation(int64_t size) {
  return Rotation{static_cast<int>(size), size ? static_cast<float>(1.0 / sqrt(static_cast<double>(size))) : 1.0f};
}

// ---------------------------------------------------------------------------------------------------------------
// Tiles and groups

struct TileGrid {
  int64_t length;           // elements per row
  int64_t block_size;       // never more than length (a longer block is the whole row)
  int64_t blocks_per_row;
  int64_t tiles_per_block;  // 1 unless the block is split
  int64_t tiles_per_row;
  int64_t tiles;
};

TileGrid make_grid(int64_t rows, int64_t length, int64_t block_size, int64_t tile) {
  TileGrid g;
  g.length = length;
  g.block_size = block_size;
  g.blocks_per_row = ceil_div(length, block_size);
  g.tiles_per_block = ceil_div(block_size, tile);
  g.tiles_per_row = g.blocks_per_row * g.tiles_per_block;
  g.tiles = rows * g.tiles_per_row;
  return g;
}

struct Tile {
  int64_t row;
  int64_t block;
  int64_t col;  // first element, within the row
  int n;        // elements; 0 for the empty trailing tiles of a split tail block
};

template <int kTile>
__device__ __forceinline__ Tile locate(const TileGrid& g, int64_t t) {
  Tile tile;
  tile.row = div_nonneg(t, g.tiles_per_row);
  const int64_t in_row = t - tile.row * g.tiles_per_row;
  int64_t segment = 0;
  tile.block = in_row;
  if (g.tiles_per_block > 1) {
    tile.block = div_nonneg(in_row, g.tiles_per_block);
    segment = in_row - tile.block * g.tiles_per_block;
  }
  const int64_t block_start = tile.block * g.block_size;
  const int64_t block_end = block_start + g.block_size < g.length ? block_start + g.block_size : g.length;
  tile.col = block_start + segment * kTile;
  const int64_t left = block_end - tile.col;
  tile.n = left <= 0 ? 0 : static_cast<int>(left < kTile ? left : kTile);
  return tile;
}

// A group of G threads owns a tile. Groups of up to a warp share 256-thread CTAs; a larger group is its own CTA.
template <int G>
struct Group {
  static_assert(G >= 1 && G <= 1024 && (G & (G - 1)) == 0, "group sizes are powers of two");
  static constexpr int kCta = G > 32 ? G : 256;
  static constexpr int kPerCta = kCta / G;
};

// Maximum over the group. Sub-warp groups shuffle under their own lane mask, so neighbouring groups of the same warp
// may be on other tiles (or done) without breaking the shuffle.
template <int G>
__device__ __forceinline__ uint32_t group_max(uint32_t v) {
  constexpr int kWidth = G < 32 ? G : 32;
  const unsigned lane = threadIdx.x & 31u;
  const unsigned mask = kWidth == 32 ? 0xFFFFFFFFu : ((1u << kWidth) - 1u) << (lane & ~(kWidth - 1u));
#pragma unroll
  for (int offset = kWidth / 2; offset > 0; offset /= 2) v = max(v, __shfl_xor_sync(mask, v, offset, kWidth));
  if constexpr (G > 32) {
    __shared__ uint32_t warp_max[G / 32];
    __syncthreads();  // the previous tile's readers are done with warp_max
    if (lane == 0) warp_max[threadIdx.x / 32] = v;
    __syncthreads();
    v = warp_max[0];
#pragma unroll
    for (int w = 1; w < G / 32; ++w) v = max(v, warp_max[w]);
  }
  return v;
}

// Rotates the tile's values in place (n valid elements; see "Hadamard rotation" above). Every lane of the group runs
// every shuffle; an element outside a whole group keeps its value.
template <int G, int C>
__device__ __forceinline__ void rotate_tile(float v[C][kChunk], int n, int lane, const Rotation& rot) {
  if (rot.size == 0) return;
  const int span = rot.size - 1;
  // whole[c][j]: the element's rotation group ends inside the tile
  bool whole[C][kChunk];
#pragma unroll
  for (int c = 0; c < C; ++c) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) whole[c][j] = (((c * G + lane) * kChunk + j) | span) < n;
  }
#pragma unroll
  for (int h = 1; h < kChunk; h *= 2) {
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if ((j & h) == 0 && h < rot.size && whole[c][j]) {
          const float a = v[c][j], b = v[c][j + h];
          v[c][j] = __fadd_rn(a, b);
          v[c][j + h] = __fsub_rn(a, b);
        }
      }
    }
  }
  constexpr int kWidth = G < 32 ? G : 32;
  const unsigned warp_lane = threadIdx.x & 31u;
  const unsigned mask = kWidth == 32 ? 0xFFFFFFFFu : ((1u << kWidth) - 1u) << (warp_lane & ~(kWidth - 1u));
  // Unrolled over every bit a rotation of up to 128 elements has, so that the partner register c ^ step below is a
  // compile-time index: a run-time one puts the whole tile in local memory.
#pragma unroll
  for (int bit = 1; bit * kChunk < kMaxRotation; bit *= 2) {  // chunk-number bit: h = 8 * bit
    if (bit * kChunk >= rot.size) break;
    if (bit < G) {
#pragma unroll
      for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int j = 0; j < kChunk; ++j) {
          const float other = __shfl_xor_sync(mask, v[c][j], bit, kWidth);
          if (whole[c][j]) v[c][j] = (lane & bit) ? __fsub_rn(other, v[c][j]) : __fadd_rn(v[c][j], other);
        }
      }
    } else {
      const int step = bit / G;  // the partner chunk is register c ^ step
#pragma unroll
      for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int d = 0; d < C; ++d) {
          if (d == (c ^ step) && c < d) {
#pragma unroll
            for (int j = 0; j < kChunk; ++j) {
              if (whole[c][j]) {
                const float a = v[c][j], b = v[d][j];
                v[c][j] = __fadd_rn(a, b);
                v[d][j] = __fsub_rn(a, b);
              }
            }
          }
        }
      }
    }
  }
#pragma unroll
  for (int c = 0; c < C; ++c) {
#pragma unroll
    for (int j = 0; j < kChunk; ++j) {
      if (whole[c][j]) v[c][j] = __fmul_rn(v[c][j], rot.norm);
    }
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Sources: what a tile's fp32 values are read from
//
// stage() issues the loads of a tile into a Staged value and returns at once; finish() turns it into fp32 values.
// The kernels stage the next tile before they finish the current one.

// A plain float tensor (rows, length). Output row (s * node_size + d) * nodes + m reads source row
// (m * node_size + d) * stages + s; node_size = stages = 1 makes that the identity (plain quantization).
template <typename T>
struct DenseSource {
  const T* x;
  int64_t length;
  int64_t nodes;
  int64_t node_size;
  int64_t stages;

  template <int C>
  struct Staged {
    uint32_t bits[C][ValueWords<T>::kPerChunk];
  };

  __device__ __forceinline__ int64_t source_row(int64_t row) const {
    if (node_size == 1 && stages == 1) return row;
    const int64_t slot = div_nonneg(row, nodes);  // s * node_size + d
    const int64_t m = row - slot * nodes;
    const int64_t s = div_nonneg(slot, node_size);
    const int64_t d = slot - s * node_size;
    return (m * node_size + d) * stages + s;
  }

  template <int G, int C>
  __device__ __forceinline__ void stage(const Tile& tile, int64_t src_row, int lane, Staged<C>& staged) const {
    load_value_bits<T, G, C>(x + src_row * length + tile.col, tile.n, lane, staged.bits);
  }

  template <int G, int C>
  __device__ __forceinline__ void finish(const Staged<C>& staged, const Tile& /*tile*/, int /*lane*/,
                                         float v[C][kChunk]) const {
#pragma unroll
    for (int c = 0; c < C; ++c) bits_to_values<T>(staged.bits[c], v[c]);
  }
};

// The fp32 sum, in input order ((x0 + x1) + x2) + ..., of k dequantized inputs stacked as codes (k, rows, packed)
// and scales (k, rows, blocks_per_row).
struct ReduceSource {
  const int8_t* codes;
  const float* scales;
  int64_t k;
  int64_t packed;
  int64_t blocks_per_row;
  int64_t code_stride;   // rows * packed: from one input to the next
  int64_t scale_stride;  // rows * blocks_per_row
  int bits;

  template <int C>
  struct Staged {  // the first input's codes and scale
    uint32_t bits[C][2];
    float scale;
  };

  __device__ __forceinline__ int64_t source_row(int64_t row) const { return row; }

  __device__ __forceinline__ const int8_t* tile_codes(const Tile& tile) const {
    return codes + tile.row * packed + (bits == 8 ? tile.col : tile.col / 2);  // col is even with 4 bits
  }
  __device__ __forceinline__ const float* tile_scale(const Tile& tile) const {
    return scales + tile.row * blocks_per_row + tile.block;
  }

  template <int G, int C>
  __device__ __forceinline__ void stage(const Tile& tile, int64_t /*src_row*/, int lane, Staged<C>& staged) const {
    load_code_bits<G, C>(tile_codes(tile), bits, tile.n, lane, staged.bits);
    staged.scale = tile.n > 0 ? *tile_scale(tile) : 0.0f;
  }

  template <int C>
  __device__ __forceinline__ void accumulate(const uint32_t w[C][2], float scale, bool first,
                                             float v[C][kChunk]) const {
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        const float value = __fmul_rn(code_to_float(code_at(w[c], bits, j)), scale);
        v[c][j] = first ? value : __fadd_rn(v[c][j], value);  // starting from x0, not 0 + x0, keeps -0.0
      }
    }
  }

  // Each input's loads are issued before the previous input is added, so two inputs are in flight at once.
  template <int G, int C>
  __device__ __forceinline__ void finish(const Staged<C>& staged, const Tile& tile, int lane,
                                         float v[C][kChunk]) const {
    uint32_t current[C][2];
#pragma unroll
    for (int c = 0; c < C; ++c) current[c][0] = staged.bits[c][0], current[c][1] = staged.bits[c][1];
    float scale = staged.scale;
    const int8_t* p = tile_codes(tile);
    const float* s = tile_scale(tile);
    for (int64_t i = 1; i < k; ++i) {
      uint32_t next[C][2];
      load_code_bits<G, C>(p + i * code_stride, bits, tile.n, lane, next);
      const float next_scale = s[i * scale_stride];
      accumulate<C>(current, scale, i == 1, v);
#pragma unroll
      for (int c = 0; c < C; ++c) current[c][0] = next[c][0], current[c][1] = next[c][1];
      scale = next_scale;
    }
    accumulate<C>(current, scale, k == 1, v);
    // 0 * scale is NaN for a NaN or infinite scale: reset the padding past the tile to zero.
#pragma unroll
    for (int c = 0; c < C; ++c) {
#pragma unroll
      for (int j = 0; j < kChunk; ++j) {
        if ((c * G + lane) * kChunk + j >= tile.n) v[c][j] = 0.0f;
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------------------------
// Kernels

// The tiles a group of G threads owns in a grid-stride loop, each staged one iteration ahead: the loads of tile
// t + stride are issued before tile t is converted, computed and stored, so a thread keeps a tile's loads in flight
// while it works. Calls body(tile, src_row, staged) for each non-empty tile; a whole-CTA group (G > 32) skips empty
// tiles together.
template <class Source, int G, int C, class Body>
__device__ __forceinline__ void for_each_tile(const Source& src, const TileGrid& grid, int lane, Body&& body) {
  constexpr int kTile = G * C * kChunk;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * Group<G>::kPerCta;
  int64_t t = static_cast<int64_t>(blockIdx.x) * Group<G>::kPerCta + threadIdx.x / G;
  if (t >= grid.tiles) return;
  Tile tile = locate<kTile>(grid, t);
  int64_t src_row = src.source_row(tile.row);
  typename Source::template Staged<C> staged;
  src.template stage<G, C>(tile, src_row, lane, staged);
  for (;;) {
    const Tile current = tile;
    const int64_t current_row = src_row;
    const typename Source::template Staged<C> current_staged = staged;
    t += stride;
    const bool more = t < grid.tiles;
    if (more) {
      tile = locate<kTile>(grid, t);
      src_row = src.source_row(tile.row);
      src.template stage<G, C>(tile, src_row, lane, staged);
    }
    if (current.n > 0) body(current, current_row, current_staged);
    if (!more) return;
  }
}

struct QuantTarget {
  int8_t* codes;   // (rows, packed)
  float* scales;   // (rows, blocks_per_row)
  int64_t packed;
  int bits;
  Quantizer quantizer;
  Rotation rotation;  // applied to the source values before the absmax
};

// kFused: a tile is a whole block; absmax, scale and codes in one pass.
// kAbsmax / kApply: the split path. kAbsmax leaves each block's absmax (as bits) in its scale slot, which must start
// at zero; kApply reads it back and writes the codes; absmax_to_scale_kernel then turns the slots into scales.
enum class Pass { kFused, kAbsmax, kApply };

// kRotate: out.rotation is applied. A template parameter, so that the kernels without a rotation (nearly every call)
// carry none of its code and registers.
template <class Source, int G, int C, Pass kPass, bool kRotate>
__global__ void __launch_bounds__(Group<G>::kCta)
    quantize_kernel(const Source src, const QuantTarget out, const TileGrid grid) {
  const int lane = static_cast<int>(threadIdx.x) % G;
  for_each_tile<Source, G, C>(src, grid, lane, [&](const Tile& tile, int64_t src_row, const auto& staged) {
    float v[C][kChunk];
    src.template finish<G, C>(staged, tile, lane, v);
    if constexpr (kRotate) rotate_tile<G, C>(v, tile.n, lane, out.rotation);
    float* slot = out.scales + tile.row * grid.blocks_per_row + tile.block;

    float absmax;
    if constexpr (kPass == Pass::kApply) {
      absmax = *slot;
    } else {
      uint32_t bits = 0;
#pragma unroll
      for (int c = 0; c < C; ++c) {
#pragma unroll
        for (int j = 0; j < kChunk; ++j) bits = max(bits, __float_as_uint(v[c][j]) & 0x7FFFFFFFu);
      }
      bits = group_max<G>(bits);
      if constexpr (kPass == Pass::kAbsmax) {
        if (lane == 0) atomicMax(reinterpret_cast<unsigned int*>(slot), bits);
        return;
      }
      absmax = __uint_as_float(bits);
    }
    const float scale = __fdiv_rn(absmax, out.quantizer.qmax);
    if (kPass == Pass::kFused && lane == 0) *slot = scale;
    const bool usable = scale != 0.0f && isfinite(scale);

    const int64_t index = src_row * grid.length + tile.col;  // the element's flat position in the source
    int8_t* codes = out.codes + tile.row * out.packed;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int offset = (c * G + lane) * kChunk;
      const int cnt = chunk_count(tile.n, offset);
      if (cnt == 0) continue;
      int q[kChunk];
      out.quantizer(v[c], cnt, scale, usable, index + offset, q);
      const int64_t col = tile.col + offset;
      store_codes(codes + (out.bits == 8 ? col : col / 2), out.bits, cnt, q);
    }
  });
}

__global__ void absmax_to_scale_kernel(float* scales, int64_t count, float qmax) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count; i += stride) {
    scales[i] = __fdiv_rn(scales[i], qmax);
  }
}

// out = rotate(sum of the source's inputs) * post_scale, cast with round-to-nearest-even.
template <typename OutT, int G, int C, bool kRotate>
__global__ void __launch_bounds__(Group<G>::kCta)
    dequant_kernel(const ReduceSource src, OutT* __restrict__ out, const float post_scale, const Rotation rotation,
                   const TileGrid grid) {
  const int lane = static_cast<int>(threadIdx.x) % G;
  for_each_tile<ReduceSource, G, C>(src, grid, lane, [&](const Tile& tile, int64_t, const auto& staged) {
    float v[C][kChunk];
    src.finish<G, C>(staged, tile, lane, v);
    if constexpr (kRotate) rotate_tile<G, C>(v, tile.n, lane, rotation);
    OutT* p = out + tile.row * grid.length + tile.col;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int offset = (c * G + lane) * kChunk;
      const int cnt = chunk_count(tile.n, offset);
      if (cnt == 0) continue;
#pragma unroll
      for (int j = 0; j < kChunk; ++j) v[c][j] = __fmul_rn(v[c][j], post_scale);
      store_values(p + offset, cnt, v[c]);
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Host side

template <int G, int C>
struct Shape {
  static constexpr int kG = G;
  static constexpr int kC = C;
};

// The smallest shape whose tile holds a block of block_size <= kLargest elements: two chunks per thread up to a warp's
// worth of 8-element chunks, then four, then multi-warp groups of four. Two or four chunks keep 32-64 bytes of loads
// in flight per thread, which a memory-bound kernel needs at the occupancy its registers allow. kLargest bounds the
// shapes that get instantiated.
template <int64_t kLargest, class Fn>
cudaError_t with_block_shape(int64_t block_size, Fn&& fn) {
  const int64_t chunks = ceil_div(block_size, kChunk);
  if (chunks <= 1) return fn(Shape<1, 1>{});
  if (chunks <= 2) return fn(Shape<1, 2>{});
  if (chunks <= 4) return fn(Shape<2, 2>{});
  if (chunks <= 8) return fn(Shape<4, 2>{});
  if (chunks <= 16) return fn(Shape<8, 2>{});
  if (chunks <= 32) return fn(Shape<16, 2>{});
  if constexpr (kLargest <= 64 * kChunk) {
    return fn(Shape<32, 2>{});
  } else {
    if (chunks <= 64) return fn(Shape<32, 2>{});
    if (chunks <= 128) return fn(Shape<32, 4>{});
    if (chunks <= 256) return fn(Shape<64, 4>{});
    if (chunks <= 512) return fn(Shape<128, 4>{});
    if (chunks <= 1024) return fn(Shape<256, 4>{});
    return fn(Shape<kMaxFusedGroup, kChunksPerThread>{});
  }
}

using SplitShape = Shape<kSplitGroup, kChunksPerThread>;

// The SM count of the current device, asked once per device: a launch costs a few microseconds and the kernels of a
// small qgZ bucket run in about as long, so no attribute query belongs on that path. Racing first calls store the
// same value.
int multiprocessor_count() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int sms = 0;
  if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) return 1;
  if (device >= 0 && device < kMaxDevices) cached[device].store(sms, std::memory_order_relaxed);
  return sms;
}

// Two waves of CTAs at full occupancy keep every SM busy; the grid-stride loops cover the remaining tiles.
unsigned grid_size(int64_t work_items, int items_per_cta, int cta_threads) {
  const int sms = multiprocessor_count();
  const int64_t cap = int64_t(sms) * (2048 / cta_threads) * 2;
  const int64_t needed = ceil_div(work_items, items_per_cta);
  return static_cast<unsigned>(needed < cap ? (needed > 0 ? needed : 1) : cap);
}

template <class Shape_, class Kernel, class... Args>
cudaError_t launch_tiles(Kernel kernel, const TileGrid& grid, cudaStream_t stream, const Args&... args) {
  using G = Group<Shape_::kG>;
  kernel<<<grid_size(grid.tiles, G::kPerCta, G::kCta), G::kCta, 0, stream>>>(args..., grid);
  return cudaGetLastError();
}

template <typename T>
struct TypeTag {
  using type = T;
};

template <class Fn>
cudaError_t with_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::F32: return fn(TypeTag<float>{});
    case DType::F16: return fn(TypeTag<__half>{});
    case DType::BF16: return fn(TypeTag<__nv_bfloat16>{});
  }
  return cudaErrorInvalidValue;
}

template <bool kRotate>
using RotateTag = std::integral_constant<bool, kRotate>;

template <class Fn>
cudaError_t with_rotation(int64_t hadamard, Fn&& fn) {
  return hadamard ? fn(RotateTag<true>{}) : fn(RotateTag<false>{});
}

template <bool kRotate, class Source>
cudaError_t run_quantize(const Source& src, int64_t rows, int64_t length, int bits, int64_t block_size,
                         bool stochastic, int64_t seed, int64_t hadamard, int8_t* codes, float* scales,
                         cudaStream_t stream) {
  if (rows <= 0 || length <= 0) return cudaSuccess;
  const float qmax = bits == 8 ? 127.0f : 7.0f;
  const int64_t block = block_size < length ? block_size : length;  // same blocks, no empty tiles
  const QuantTarget out{codes, scales, packed_length(length, bits), bits,
                        Quantizer{qmax, stochastic, mix32(static_cast<uint32_t>(seed))}, make_rotation(hadamard)};
  if (block <= kMaxFusedBlock) {
    return with_block_shape<kMaxFusedBlock>(block, [&](auto shape) {
      using S = decltype(shape);
      const TileGrid grid = make_grid(rows, length, block, int64_t(S::kG) * S::kC * kChunk);
      return launch_tiles<S>(quantize_kernel<Source, S::kG, S::kC, Pass::kFused, kRotate>, grid, stream, src, out);
    });
  }
  const TileGrid grid = make_grid(rows, length, block, kSplitTile);
  const int64_t slots = rows * grid.blocks_per_row;
  cudaError_t err = cudaMemsetAsync(scales, 0, static_cast<size_t>(slots) * sizeof(float), stream);
  if (err != cudaSuccess) return err;
  err = launch_tiles<SplitShape>(quantize_kernel<Source, SplitShape::kG, SplitShape::kC, Pass::kAbsmax, kRotate>, grid,
                                 stream, src, out);
  if (err != cudaSuccess) return err;
  err = launch_tiles<SplitShape>(quantize_kernel<Source, SplitShape::kG, SplitShape::kC, Pass::kApply, kRotate>, grid, stream,
                                 src, out);
  if (err != cudaSuccess) return err;
  absmax_to_scale_kernel<<<grid_size(slots, 256, 256), 256, 0, stream>>>(scales, slots, qmax);
  return cudaGetLastError();
}

ReduceSource reduce_source(const int8_t* codes, const float* scales, int64_t k, int64_t rows, int64_t length, int bits,
                           int64_t block_size) {
  const int64_t packed = packed_length(length, bits), blocks = ceil_div(length, block_size);
  return ReduceSource{codes, scales, k, packed, blocks, rows * packed, rows * blocks, bits};
}

cudaError_t run_dequant(const ReduceSource& src, int64_t rows, int64_t length, int64_t block_size, float post_scale,
                        int64_t hadamard, void* out, DType out_dtype, cudaStream_t stream) {
  if (rows <= 0 || length <= 0 || src.k <= 0) return cudaSuccess;
  const int64_t block = block_size < length ? block_size : length;
  // Nothing is reduced across a block here, so tiles need not cover whole blocks: capping them at a warp's two chunks
  // per thread keeps the register count (and with it the occupancy) of the k-input loop moderate.
  const int64_t shape_block = block < kDequantTile ? block : kDequantTile;
  return with_dtype(out_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return with_rotation(hadamard, [&](auto rotate) {
      return with_block_shape<kDequantTile>(shape_block, [&](auto shape) {
        using S = decltype(shape);
        const TileGrid grid = make_grid(rows, length, block, int64_t(S::kG) * S::kC * kChunk);
        return launch_tiles<S>(dequant_kernel<T, S::kG, S::kC, decltype(rotate)::value>, grid, stream, src,
                               static_cast<T*>(out), post_scale, make_rotation(hadamard));
      });
    });
  });
}

}  // namespace

int launch_quantize(const void* x, DType x_dtype, int64_t rows, int64_t length, int bits, int64_t block_size,
                    bool stochastic, int64_t seed, int64_t hadamard, int8_t* codes, float* scales, void* stream) {
  return launch_swizzle_quantize(x, x_dtype, rows, 1, 1, length, bits, block_size, stochastic, seed, hadamard, codes,
                                 scales, stream);
}

int launch_swizzle_quantize(const void* x, DType x_dtype, int64_t nodes, int64_t node_size, int64_t stages,
                            int64_t length, int bits, int64_t block_size, bool stochastic, int64_t seed,
                            int64_t hadamard, int8_t* codes, float* scales, void* stream) {
  return static_cast<int>(with_dtype(x_dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    const DenseSource<T> src{static_cast<const T*>(x), length, nodes, node_size, stages};
    return with_rotation(hadamard, [&](auto rotate) {
      return run_quantize<decltype(rotate)::value>(src, nodes * node_size * stages, length, bits, block_size,
                                                   stochastic, seed, hadamard, codes, scales,
                                                   static_cast<cudaStream_t>(stream));
    });
  }));
}

int launch_dequantize(const int8_t* codes, const float* scales, int64_t rows, int64_t length, int bits,
                      int64_t block_size, int64_t hadamard, void* out, DType out_dtype, void* stream) {
  const ReduceSource src = reduce_source(codes, scales, 1, rows, length, bits, block_size);
  // Multiplying by 1.0f changes no bit pattern on the GPU (a NaN is already the canonical one), so a single
  // dequantization shares the reduction's kernel.
  return static_cast<int>(
      run_dequant(src, rows, length, block_size, 1.0f, hadamard, out, out_dtype, static_cast<cudaStream_t>(stream)));
}

int launch_dequant_reduce_quant(const int8_t* codes, const float* scales, int64_t k, int64_t rows, int64_t length,
                                int in_bits, int64_t block_size, int out_bits, bool stochastic, int64_t seed,
                                int8_t* out_codes, float* out_scales, void* stream) {
  if (k <= 0) return static_cast<int>(cudaSuccess);
  const ReduceSource src = reduce_source(codes, scales, k, rows, length, in_bits, block_size);
  return static_cast<int>(run_quantize<false>(src, rows, length, out_bits, block_size, stochastic, seed, 0, out_codes,
                                              out_scales, static_cast<cudaStream_t>(stream)));
}

int launch_dequant_reduce(const int8_t* codes, const float* scales, int64_t k, int64_t rows, int64_t length,
                          int bits, int64_t block_size, float scale, int64_t hadamard, void* out, DType out_dtype,
                          void* stream) {
  const ReduceSource src = reduce_source(codes, scales, k, rows, length, bits, block_size);
  return static_cast<int>(run_dequant(src, rows, length, block_size, scale, hadamard, out, out_dtype,
                                      static_cast<cudaStream_t>(stream)));
}

const char* error_string(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }

}  // namespace hf_zeropp
