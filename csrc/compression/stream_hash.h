// The counter-based hash behind stochastic rounding, shared by the CPU and CUDA codecs so
// that both draw the same u for the same (index, seed) (docs/wire-format.md):
//   key = lowbias32(uint32(seed) ^ lowbias32(uint32(seed >> 32)))
//   h   = lowbias32(uint32(i) ^ key)           (i wraps modulo 2^32)
//   u   = (h >> 8) * 2^-24 in [0, 1)
// lowbias32 is Chris Wellons' integer hash.
#pragma once

#include <cstdint>

#ifdef __CUDACC__
#define CGX_HOST_DEVICE_INLINE __host__ __device__ __forceinline__
#else
// Always inlined: the CPU codec's SSE2 and AVX2 clones each need their own copy.
#define CGX_HOST_DEVICE_INLINE inline __attribute__((always_inline))
#endif

namespace cgx::compression {

CGX_HOST_DEVICE_INLINE uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

CGX_HOST_DEVICE_INLINE uint32_t stream_key(uint64_t seed) {
  return lowbias32(static_cast<uint32_t>(seed) ^ lowbias32(static_cast<uint32_t>(seed >> 32)));
}

}  // namespace cgx::compression
