// Shared by the CUDA codec's kernels (quantizer_cuda.cu, hadamard_kernels.cuh): the launch
// shape, float conversions as the CPU codec makes them, a group of 8 values loaded or
// stored at once, and a group's levels written to or read from a level stream. Device
// code; it also compiles as host C++ against the CUDA emulation of the core tests
// (docs/cuda.md).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace cgx::compression::cuda {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr unsigned kFullWarp = 0xffffffffu;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// The 8 values of group g (indices 8g .. 8g+7; those at or past `count` read as 0).
template <typename T>
__device__ __forceinline__ void load_group(const T* src, int64_t g, int64_t count, float (&v)[8]) {
  const int64_t first = 8 * g;
  const T* p = src + first;
  constexpr int kPerVector = 16 / sizeof(T);
  if (first + 8 <= count && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    // 16-byte loads: two for float32, one for the 2-byte types.
#pragma unroll
    for (int part = 0; part < 8 / kPerVector; ++part) {
      const uint4 raw = *reinterpret_cast<const uint4*>(p + part * kPerVector);
      const T* lanes = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) v[part * kPerVector + j] = to_float(lanes[j]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = first + j < count ? to_float(p[j]) : 0.0f;
}

// Values 8g .. 8g+7 of dst (those at or past `count` untouched) <- v, or dst + v with
// `add` (the sum in float32, rounded once to T): one or two 16-byte stores when aligned.
template <typename T>
__device__ __forceinline__ void store_group(T* dst, int64_t g, int64_t count, const float* v,
                                            bool add) {
  const int64_t first = 8 * g;
  T* p = dst + first;
  constexpr int kPerVector = 16 / sizeof(T);
  if (first + 8 <= count && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
#pragma unroll
    for (int part = 0; part < 8 / kPerVector; ++part) {
      uint4* at = reinterpret_cast<uint4*>(p + part * kPerVector);
      uint4 raw{};
      if (add) raw = *at;
      T* lanes = reinterpret_cast<T*>(&raw);
#pragma unroll
      for (int j = 0; j < kPerVector; ++j) {
        const float value = v[part * kPerVector + j];
        lanes[j] = from_float<T>(add ? __fadd_rn(to_float(lanes[j]), value) : value);
      }
      *at = raw;
    }
    return;
  }
  for (int j = 0; j < 8 && first + j < count; ++j)
    p[j] = from_float<T>(add ? __fadd_rn(to_float(p[j]), v[j]) : v[j]);
}

// The 8 levels of group g (`bits` bits each, packed into a word), as `bits` bytes at
// out + g * bits of a level stream; and read back.
__device__ __forceinline__ void write_group(uint8_t* out, int64_t g, int bits, uint64_t word) {
  for (int j = 0; j < bits; ++j) out[g * bits + j] = static_cast<uint8_t>(word >> (8 * j));
}
__device__ __forceinline__ uint64_t read_group(const uint8_t* in, int64_t g, int bits) {
  uint64_t word = 0;
  for (int j = 0; j < bits; ++j) word |= static_cast<uint64_t>(in[g * bits + j]) << (8 * j);
  return word;
}

}  // namespace cgx::compression::cuda
