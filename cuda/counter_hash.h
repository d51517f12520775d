// The counter-based random bits behind stochastic rounding, shared by the CPU and CUDA kernels so that both draw
// exactly what hf_zeropp/kernels/reference.py (uniform_from_counter) draws. Plain C++: no torch, no CUDA headers.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define HF_ZEROPP_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define HF_ZEROPP_HOST_DEVICE inline
#endif

namespace hf_zeropp_hash {

// An invertible 32-bit mixer; odd multipliers below 2^31 so the reference can compute it exactly in int64.
HF_ZEROPP_HOST_DEVICE uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x7FEB352Du;
  h ^= h >> 15;
  h *= 0x6A09E667u;
  h ^= h >> 16;
  return h;
}

// 24 random bits for element `index` under `key` = mix32(lo32(seed)); u = bits * 2^-24 lies in [0, 1).
HF_ZEROPP_HOST_DEVICE uint32_t counter_bits(uint32_t key, int64_t index) {
  const uint64_t i = static_cast<uint64_t>(index);
  const uint32_t h = mix32(static_cast<uint32_t>(i) ^ key);
  return mix32(h ^ static_cast<uint32_t>(i >> 32)) >> 8;
}

}  // namespace hf_zeropp_hash
