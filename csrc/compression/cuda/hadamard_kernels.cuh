// The hadamard scheme's kernels for whole buckets (quantizer_cuda.cu launches them; a
// shorter last bucket goes through the maxmin kernels there). Device code; it also
// compiles as host C++ against the CUDA emulation of the core tests (docs/cuda.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "compression/cuda/value_groups.cuh"
#include "compression/gaussian_levels.h"
#include "compression/rotation.h"
#include "compression/stream_hash.h"

namespace cgx::compression::cuda {

// ---- the hadamard scheme: the CPU codec's operations in its order (rotation.h,
// quantizer.cpp), so the same bytes and the same decoded bits. Each stage's butterflies
// are independent, so lanes share them; stages follow one another as on the CPU. Buckets
// of 256, 512 and 1024 values rotate in a warp's registers; the other sizes (8 .. 65536)
// in a float32 scratch in device memory.

// The level of rotated value z (its index `index` in the call's stochastic stream).
__device__ __forceinline__ int hadamard_level(float z, const GaussianLevels& t, int top,
                                              bool stochastic, uint32_t key, uint32_t index) {
  int level = 0;
  if (!stochastic) {
    for (int m = 0; m < top; ++m) level += z >= t.midpoint[m];
    return level;
  }
  int below = 0;  // the level under z (0 below the lowest, top - 1 above the highest)
  for (int m = 1; m < top; ++m) below += z >= t.level[m];
  const float p = __fmul_rn(__fsub_rn(z, t.level[below]), t.inv_gap[below]);
  const uint32_t h = lowbias32(index ^ key);
  const float u = __fmul_rn(static_cast<float>(static_cast<int32_t>(h >> 8)), 0x1p-24f);
  return below + (u < p);
}

// A bucket's rms from its sum of squares, as the CPU codec rounds it.
__device__ __forceinline__ float rms_of(double sum_of_squares, int64_t n) {
  return __double2float_rn(sqrt(__ddiv_rn(sum_of_squares, static_cast<double>(n))));
}
// 1 / rms, or 0 where that is not finite (rms 0, or so small that it overflows).
__device__ __forceinline__ float inverse_of(float rms) {
  const float inv = rms > 0.0f ? __fdiv_rn(1.0f, rms) : 0.0f;
  return isfinite(inv) ? inv : 0.0f;
}

// -- in registers: a bucket of n = 32 V values, lane l holding values lV .. lV + V - 1. The
// stages h < V are then a lane's own, and each of the 5 above pairs lane l with lane
// l ^ (h / V) at the same register: no scratch, no __syncwarp, no memory between stages.

template <int V>
__device__ __forceinline__ void lanes_walsh_hadamard(float (&y)[V], int lane) {
#pragma unroll
  for (int h = 1; h < V; h *= 2)
#pragma unroll
    for (int k = 0; k < V; ++k)
      if (!(k & h)) {
        const float a = y[k], b = y[k + h];
        y[k] = __fadd_rn(a, b);
        y[k + h] = __fsub_rn(a, b);
      }
#pragma unroll
  for (int s = 1; s < 32; s *= 2) {
    const bool upper = lane & s;  // holds x[k + h] of each pair: a - b, with a the lower's
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float other = __shfl_xor_sync(kFullWarp, y[k], s);
      y[k] = upper ? __fsub_rn(other, y[k]) : __fadd_rn(y[k], other);
    }
  }
}

// The bucket's sum of squares in the CPU codec's order (rotated_loops.cpp): four double
// sums, sum j over the values j, j + 4, j + 8, ... in turn, then (s0 + s1) + (s2 + s3).
// Each sum runs through the lanes in order (V is a multiple of 4, so lane l's value k
// belongs to sum k % 4): lane r adds its values and hands the sums to lane r + 1. Every lane
// gets the total.
template <int V>
__device__ __forceinline__ double lanes_sum_of_squares(const float (&y)[V], int lane) {
  double s[4] = {0.0, 0.0, 0.0, 0.0};
  for (int r = 0; r < 32; ++r) {
    if (r > 0) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const double from = __shfl_sync(kFullWarp, s[j], r - 1);
        if (lane == r) s[j] = from;
      }
    }
    if (lane == r) {
#pragma unroll
      for (int k = 0; k < V; ++k) {
        const double v = static_cast<double>(y[k]);
        s[k % 4] = __dadd_rn(s[k % 4], __dmul_rn(v, v));
      }
    }
  }
  const double total = __dadd_rn(__dadd_rn(s[0], s[1]), __dadd_rn(s[2], s[3]));
  return __shfl_sync(kFullWarp, total, 31);
}

template <typename T, int V>
__global__ void hadamard_encode_in_registers(const T* __restrict__ src, int64_t buckets, int bits,
                                             bool stochastic, uint32_t key, uint32_t stream_offset,
                                             float* __restrict__ rms_out, uint8_t* __restrict__ stream) {
  constexpr int64_t n = 32 * V;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const GaussianLevels t = gaussian_levels_of(bits);
  const int top = (1 << bits) - 1;
  const float inv_n = __fdiv_rn(1.0f, static_cast<float>(n));  // exact: n a power of two
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       b < buckets; b += warps) {
    const int64_t first = b * n + lane * V;  // this lane's first value in the call
    uint8_t* out = stream + first / 8 * bits;
    float y[V];
    bool in_range = true;
#pragma unroll
    for (int q = 0; q < V / 8; ++q) {
      float v[8];
      load_group(src + first, q, V, v);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        in_range = in_range && fabsf(v[j]) < kMaxRotatedMagnitude;
        y[8 * q + j] = __fmul_rn(v[j], __fmul_rn(rotation_sign(lane * V + 8 * q + j), inv_n));
      }
    }
    if (!__all_sync(kFullWarp, in_range)) {  // NaN, Inf or huge: rms NaN, levels 0
      for (int q = 0; q < V / 8; ++q) write_group(out, q, bits, 0);
      if (lane == 0) rms_out[b] = __int_as_float(0x7fc00000);
      continue;
    }
    lanes_walsh_hadamard<V>(y, lane);
    const float rms = rms_of(lanes_sum_of_squares<V>(y, lane), n);
    const float inv = inverse_of(rms);
    if (lane == 0) rms_out[b] = rms;
#pragma unroll
    for (int q = 0; q < V / 8; ++q) {
      uint64_t word = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t index = stream_offset + static_cast<uint32_t>(first + 8 * q + j);
        const int level = hadamard_level(__fmul_rn(y[8 * q + j], inv), t, top, stochastic, key, index);
        word |= static_cast<uint64_t>(level) << (j * bits);
      }
      write_group(out, q, bits, word);
    }
  }
}

template <typename T, int V>
__global__ void hadamard_decode_in_registers(const uint8_t* __restrict__ stream,
                                             const float* __restrict__ rms_in, int64_t buckets,
                                             int bits, bool add, T* __restrict__ dst) {
  constexpr int64_t n = 32 * V;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const GaussianLevels t = gaussian_levels_of(bits);
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       b < buckets; b += warps) {
    const int64_t first = b * n + lane * V;
    const uint8_t* in = stream + first / 8 * bits;
    const float rms = rms_in[b];
    float y[V];
#pragma unroll
    for (int q = 0; q < V / 8; ++q) {
      const uint64_t word = read_group(in, q, bits);
#pragma unroll
      for (int j = 0; j < 8; ++j) y[8 * q + j] = __fmul_rn(t.level[(word >> (j * bits)) & mask], rms);
    }
    lanes_walsh_hadamard<V>(y, lane);
#pragma unroll
    for (int k = 0; k < V; ++k) y[k] = __fmul_rn(y[k], rotation_sign(lane * V + k));
#pragma unroll
    for (int q = 0; q < V / 8; ++q) store_group(dst + first, q, V, y + 8 * q, add);
  }
}

// -- in scratch: any bucket size, one warp a bucket, each stage through device memory.

// y <- the Walsh-Hadamard transform of one bucket (n values), by the warp. Ends synced.
__device__ inline void warp_walsh_hadamard(float* __restrict__ y, int64_t n, int lane) {
  for (int64_t h = 1; h < n; h *= 2) {
    __syncwarp();  // the last stage's (or the caller's) writes, visible to every lane
    for (int64_t p = lane; p < n / 2; p += 32) {
      const int64_t k = (p & ~(h - 1)) * 2 + (p & (h - 1));  // the p-th pair's first value
      const float a = y[k], b = y[k + h];
      y[k] = __fadd_rn(a, b);
      y[k + h] = __fsub_rn(a, b);
    }
  }
  __syncwarp();
}

template <typename T>
__global__ void hadamard_encode_in_scratch(const T* __restrict__ src, int64_t buckets, int64_t n,
                                           int bits, bool stochastic, uint32_t key,
                                           uint32_t stream_offset, float* __restrict__ scratch,
                                           float* __restrict__ rms_out, uint8_t* __restrict__ stream) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const GaussianLevels t = gaussian_levels_of(bits);
  const int top = (1 << bits) - 1;
  const float inv_n = __fdiv_rn(1.0f, static_cast<float>(n));  // exact: n a power of two
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       b < buckets; b += warps) {
    const T* x = src + b * n;
    float* y = scratch + b * n;
    uint8_t* out = stream + b * n / 8 * bits;
    bool in_range = true;
    for (int64_t k = lane; k < n; k += 32) {
      const float v = to_float(x[k]);
      in_range = in_range && fabsf(v) < kMaxRotatedMagnitude;
      y[k] = __fmul_rn(v, __fmul_rn(rotation_sign(k), inv_n));
    }
    if (!__all_sync(kFullWarp, in_range)) {  // NaN, Inf or huge: rms NaN, levels 0
      for (int64_t g = lane; g < n / 8; g += 32) write_group(out, g, bits, 0);
      if (lane == 0) rms_out[b] = __int_as_float(0x7fc00000);
      continue;
    }
    warp_walsh_hadamard(y, n, lane);
    // The sum of squares in the CPU codec's order (lanes_sum_of_squares): lane i makes
    // sum i % 4 (four lanes each), two shuffles combine them.
    double sum = 0.0;
    for (int64_t k = lane % 4; k < n; k += 4) {
      const double v = static_cast<double>(y[k]);
      sum = __dadd_rn(sum, __dmul_rn(v, v));
    }
    const double pair = __dadd_rn(sum, __shfl_xor_sync(kFullWarp, sum, 1));
    const double total = __dadd_rn(pair, __shfl_xor_sync(kFullWarp, pair, 2));
    const float rms = rms_of(total, n);
    const float inv = inverse_of(rms);
    if (lane == 0) rms_out[b] = rms;
    for (int64_t g = lane; g < n / 8; g += 32) {
      uint64_t word = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t k = 8 * g + j;
        const uint32_t index = stream_offset + static_cast<uint32_t>(b * n + k);
        word |= static_cast<uint64_t>(hadamard_level(__fmul_rn(y[k], inv), t, top, stochastic, key, index))
                << (j * bits);
      }
      write_group(out, g, bits, word);
    }
  }
}

template <typename T>
__global__ void hadamard_decode_in_scratch(const uint8_t* __restrict__ stream,
                                           const float* __restrict__ rms_in, int64_t buckets,
                                           int64_t n, int bits, float* __restrict__ scratch, bool add,
                                           T* __restrict__ dst) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  const GaussianLevels t = gaussian_levels_of(bits);
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       b < buckets; b += warps) {
    const uint8_t* in = stream + b * n / 8 * bits;
    float* y = scratch + b * n;
    const float rms = rms_in[b];
    for (int64_t g = lane; g < n / 8; g += 32) {
      const uint64_t word = read_group(in, g, bits);
#pragma unroll
      for (int j = 0; j < 8; ++j)
        y[8 * g + j] = __fmul_rn(t.level[(word >> (j * bits)) & mask], rms);
    }
    warp_walsh_hadamard(y, n, lane);
    T* out = dst + b * n;
    for (int64_t k = lane; k < n; k += 32) {
      const float value = __fmul_rn(y[k], rotation_sign(k));
      out[k] = from_float<T>(add ? __fadd_rn(to_float(out[k]), value) : value);
    }
  }
}

}  // namespace cgx::compression::cuda
