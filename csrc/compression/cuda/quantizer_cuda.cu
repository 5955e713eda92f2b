// CUDA max-min quantizer. Every floating-point operation is written with an explicit
// rounding intrinsic (__fadd_rn, __fmul_rn, ...) so that nvcc cannot contract it into a
// fused multiply-add: the bits must match the CPU codec's (docs/wire-format.md).
//
// Kernels, all memory-bound:
//   bucket_meta: one warp per bucket: min, max, finiteness -> (min, scale) in the meta
//     section. Lanes read consecutive values (coalesced), reduce with shuffles.
//   quantize_pack: one thread per group of 8 values -> `bits` bytes of the level stream;
//     the group's 8 inputs are one or two 16-byte loads when aligned.
//   unpack_dequantize: one thread per group of 8 levels -> 8 values, optionally added to
//     the destination in the same pass.
//   raw_to_wire / raw_from_wire: the n - q values that travel as float32 (and copy_floats).
//   add_finite_difference: error feedback's residual update.
//   hadamard_encode / hadamard_decode: the hadamard scheme's whole buckets, one warp per
//     bucket, rotated in a float32 scratch in device memory (bucket sizes go to 65536,
//     past what registers or shared memory hold); its shorter last bucket travels as a
//     one-bucket maxmin buffer, through the kernels above.
// They run on the CPU too, under the CUDA emulation of the core tests (docs/cuda.md).
#include <cfloat>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "compression/cuda/quantizer_cuda.h"
#include "compression/gaussian_levels.h"
#include "compression/rotation.h"
#include "compression/stream_hash.h"

namespace cgx::compression::cuda {

namespace {

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;

void check(cudaError_t code, const char* what) {
  if (code != cudaSuccess)
    throw std::runtime_error(std::string("cgx CUDA codec: ") + what + ": " +
                             cudaGetErrorString(code));
}

// The CPU codec's decode (quantizer.cpp): min + level * scale, the product and the sum
// each capped at FLT_MAX so that a finite bucket decodes finite; NaN stays NaN.
__device__ __forceinline__ float decode(float mn, float level, float scale) {
  float product = __fmul_rn(level, scale);
  product = product > FLT_MAX ? FLT_MAX : product;
  const float value = __fadd_rn(mn, product);
  return value > FLT_MAX ? FLT_MAX : value;
}

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

// Walks the buckets of a group's values with one division per group, not one per value
// (a 64-bit division costs more than the rest of a value's work).
class BucketCursor {
 public:
  __device__ BucketCursor(int64_t first, int64_t bucket_size)
      : bucket_size_(bucket_size),
        bucket_(first / bucket_size),
        left_(bucket_size - (first - bucket_ * bucket_size)) {}
  // The bucket of the next value.
  __device__ int64_t next() {
    if (left_ == 0) {
      ++bucket_;
      left_ = bucket_size_;
    }
    --left_;
    return bucket_;
  }

 private:
  int64_t bucket_size_;
  int64_t bucket_;
  int64_t left_;  // values of bucket_ not yet visited
};

template <typename T>
__global__ void bucket_meta(const T* __restrict__ src, int64_t quantized, int64_t bucket_size,
                            int64_t buckets, float max_level, float2* __restrict__ meta) {
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       b < buckets; b += warps) {
    const int64_t start = b * bucket_size;
    const int64_t len = min(bucket_size, quantized - start);
    float mn = INFINITY, mx = -INFINITY;
    bool finite = true;
    for (int64_t k = lane; k < len; k += 32) {
      const float v = to_float(src[start + k]);
      finite = finite && isfinite(v);
      mn = v < mn ? v : mn;
      mx = v > mx ? v : mx;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other_mn = __shfl_xor_sync(0xffffffffu, mn, offset);
      const float other_mx = __shfl_xor_sync(0xffffffffu, mx, offset);
      mn = other_mn < mn ? other_mn : mn;
      mx = other_mx > mx ? other_mx : mx;
    }
    finite = __all_sync(0xffffffffu, finite);
    if (lane == 0) {
      // + 0.0f: -0 becomes +0, so the bytes do not depend on the order of the scan.
      mn = __fadd_rn(mn, 0.0f);
      mx = __fadd_rn(mx, 0.0f);
      const float scale = __fdiv_rn(__fsub_rn(mx, mn), max_level);
      if (finite && isfinite(mn) && isfinite(mx) && isfinite(scale)) {
        meta[b] = make_float2(mn, scale);
      } else {
        // The CPU codec's quiet NaN, std::numeric_limits<float>::quiet_NaN(): same bytes.
        const float nan = __int_as_float(0x7fc00000);
        meta[b] = make_float2(nan, nan);
      }
    }
  }
}

template <typename T>
__global__ void quantize_pack(const T* __restrict__ src, int64_t quantized, int64_t bucket_size,
                              int bits, float max_level, bool stochastic, uint32_t key,
                              uint32_t stream_offset, const float2* __restrict__ meta, uint8_t* __restrict__ stream) {
  const int64_t groups = (quantized + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    float v[8];
    load_group(src, g, quantized, v);
    uint64_t word = 0;
    BucketCursor buckets(8 * g, bucket_size);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t i = 8 * g + j;
      if (i >= quantized) break;  // padding levels stay 0
      const float2 code = meta[buckets.next()];
      if (isnan(code.y)) continue;  // a non-finite bucket: every level 0
      float inv = code.y > 0.0f ? __fdiv_rn(1.0f, code.y) : 0.0f;
      if (!isfinite(inv)) inv = 0.0f;
      float offset = 0.5f;
      if (stochastic) {
        const uint32_t h = lowbias32((stream_offset + static_cast<uint32_t>(i)) ^ key);
        offset = __fmul_rn(static_cast<float>(static_cast<int32_t>(h >> 8)), 0x1p-24f);
      }
      float y = __fadd_rn(__fmul_rn(__fsub_rn(v[j], code.x), inv), offset);
      y = y < max_level ? y : max_level;
      word |= static_cast<uint64_t>(static_cast<uint32_t>(__float2int_rz(y))) << (j * bits);
    }
    uint8_t* out = stream + g * bits;
    for (int k = 0; k < bits; ++k) out[k] = static_cast<uint8_t>(word >> (8 * k));
  }
}

template <typename T>
__global__ void unpack_dequantize(const uint8_t* __restrict__ stream, int64_t quantized,
                                  int64_t bucket_size, int bits,
                                  const float2* __restrict__ meta, bool add, T* __restrict__ dst) {
  const int64_t groups = (quantized + 7) / 8;
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const uint8_t* in = stream + g * bits;
    uint64_t word = 0;
    for (int k = 0; k < bits; ++k) word |= static_cast<uint64_t>(in[k]) << (8 * k);
    BucketCursor buckets(8 * g, bucket_size);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t i = 8 * g + j;
      if (i >= quantized) break;
      const float2 code = meta[buckets.next()];
      const float level = static_cast<float>(static_cast<int>((word >> (j * bits)) & mask));
      const float value = decode(code.x, level, code.y);
      dst[i] = from_float<T>(add ? __fadd_rn(to_float(dst[i]), value) : value);
    }
  }
}

// Compress: values [0, count) of src to float32 at raw. Decompress: the reverse, or added.
template <typename T>
__global__ void raw_to_wire(const T* __restrict__ src, int64_t count, float* __restrict__ raw) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)
    raw[k] = to_float(src[k]);
}
template <typename T>
__global__ void raw_from_wire(const float* __restrict__ raw, int64_t count, bool add,
                              T* __restrict__ dst) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[k] = from_float<T>(add ? __fadd_rn(to_float(dst[k]), raw[k]) : raw[k]);
}

__global__ void add_finite_difference(const float* __restrict__ values,
                                      const float* __restrict__ decoded, int64_t count,
                                      float* __restrict__ residual) {
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float dropped = __fsub_rn(values[k], decoded[k]);
    if (isfinite(dropped)) residual[k] = __fadd_rn(residual[k], dropped);
  }
}

// ---- the hadamard scheme: the CPU codec's operations in its order (rotation.h,
// quantizer.cpp), so the same bytes and the same decoded bits. Each stage's butterflies
// are independent, so lanes share them; stages follow one another as on the CPU.

// y <- the Walsh-Hadamard transform of one bucket (n values), by the warp. Ends synced.
__device__ void warp_walsh_hadamard(float* __restrict__ y, int64_t n, int lane) {
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
__global__ void hadamard_encode(const T* __restrict__ src, int64_t buckets, int64_t n, int bits,
                                bool stochastic, uint32_t key, uint32_t stream_offset,
                                float* __restrict__ scratch, float* __restrict__ rms_out,
                                uint8_t* __restrict__ stream) {
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
    if (!__all_sync(0xffffffffu, in_range)) {  // NaN, Inf or huge: rms NaN, levels 0
      for (int64_t g = lane; g < n / 8; g += 32)
        for (int j = 0; j < bits; ++j) out[g * bits + j] = 0;
      if (lane == 0) rms_out[b] = __int_as_float(0x7fc00000);
      continue;
    }
    warp_walsh_hadamard(y, n, lane);
    // The mean square in the CPU codec's order: four sums in double, sum l over the
    // values l, l + 4, l + 8, ... in turn, then (s0 + s1) + (s2 + s3). Lane i makes sum i % 4.
    double sum = 0.0;
    for (int64_t k = lane % 4; k < n; k += 4) {
      const double v = static_cast<double>(y[k]);
      sum = __dadd_rn(sum, __dmul_rn(v, v));
    }
    const double pair = __dadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, 1));
    const double total = __dadd_rn(pair, __shfl_xor_sync(0xffffffffu, pair, 2));
    const float rms = __double2float_rn(sqrt(__ddiv_rn(total, static_cast<double>(n))));
    float inv = rms > 0.0f ? __fdiv_rn(1.0f, rms) : 0.0f;
    if (!isfinite(inv)) inv = 0.0f;
    if (lane == 0) rms_out[b] = rms;
    for (int64_t g = lane; g < n / 8; g += 32) {
      uint64_t word = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int64_t k = 8 * g + j;
        const float z = __fmul_rn(y[k], inv);
        int level = 0;
        if (!stochastic) {
          for (int m = 0; m < top; ++m) level += z >= t.midpoint[m];
        } else {
          int below = 0;  // the level under z (0 below the lowest, top - 1 above the highest)
          for (int m = 1; m < top; ++m) below += z >= t.level[m];
          const float p = __fmul_rn(__fsub_rn(z, t.level[below]), t.inv_gap[below]);
          const uint32_t h = lowbias32((stream_offset + static_cast<uint32_t>(b * n + k)) ^ key);
          const float u = __fmul_rn(static_cast<float>(static_cast<int32_t>(h >> 8)), 0x1p-24f);
          level = below + (u < p);
        }
        word |= static_cast<uint64_t>(level) << (j * bits);
      }
      for (int j = 0; j < bits; ++j) out[g * bits + j] = static_cast<uint8_t>(word >> (8 * j));
    }
  }
}

template <typename T>
__global__ void hadamard_decode(const uint8_t* __restrict__ stream, const float* __restrict__ rms_in,
                                int64_t buckets, int64_t n, int bits, float* __restrict__ scratch,
                                bool add, T* __restrict__ dst) {
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
      uint64_t word = 0;
      for (int j = 0; j < bits; ++j) word |= static_cast<uint64_t>(in[g * bits + j]) << (8 * j);
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

int blocks_for(int64_t work_items, int per_block) {
  const int64_t blocks = (work_items + per_block - 1) / per_block;
  return static_cast<int>(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

// Every launch: `blocks` blocks of kThreads on `stream`. Through the runtime's
// cudaLaunchKernelEx rather than <<<>>>, so that this file is also plain C++ for the CPU
// emulation the core tests run the kernels on (tests/cpp/cuda_emulation).
template <typename... Params, typename... Args>
void launch_kernel(void (*kernel)(Params...), int blocks, cudaStream_t stream,
                   const char* what, Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(kThreads);
  config.stream = stream;
  const cudaError_t code = cudaLaunchKernelEx(&config, kernel, args...);
  // A failed launch is also this thread's "last error": clear it, so that the next
  // caller that checks cudaGetLastError (torch does) does not report cgx's failure.
  if (code != cudaSuccess) (void)cudaGetLastError();
  check(code, what);
}

// Zero padding after the metadata and after the levels, so that equal inputs give equal
// buffers.
void zero_padding(const WireLayout& layout, uint8_t* dst, cudaStream_t stream) {
  check(cudaMemsetAsync(dst + layout.meta_bytes, 0, layout.levels_offset - layout.meta_bytes,
                        stream),
        "memset");
  const size_t levels_end = layout.levels_offset + layout.levels_bytes;
  check(cudaMemsetAsync(dst + levels_end, 0, layout.raw_offset - levels_end, stream), "memset");
}

// Values [first, first + count) in maxmin buckets (all of a maxmin buffer; a hadamard
// buffer's shorter last bucket), their (min, scale) pairs at `meta`, their levels in the
// level stream `levels` from value `first` on.
template <typename T>
void encode_maxmin(const QuantizerParams& params, const T* src, int64_t first, int64_t count,
                   float2* meta, uint8_t* levels, uint64_t seed, uint64_t stream_offset,
                   cudaStream_t stream) {
  const float max_level = static_cast<float>((1 << params.bits) - 1);
  const int64_t buckets = (count + params.bucket_size - 1) / params.bucket_size;
  launch_kernel(bucket_meta<T>, blocks_for(buckets, kWarpsPerBlock), stream, "bucket_meta",
                src + first, count, params.bucket_size, buckets, max_level, meta);
  launch_kernel(quantize_pack<T>, blocks_for((count + 7) / 8, kThreads), stream, "quantize_pack",
                src + first, count, params.bucket_size, params.bits, max_level, params.stochastic,
                stream_key(seed), static_cast<uint32_t>(stream_offset + first), meta,
                levels + first / 8 * params.bits);
}

// Device memory for one call on `stream`, released in stream order.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    check(cudaMallocAsync(&data_, bytes, stream), "cudaMallocAsync");
  }
  ~Scratch() { cudaFreeAsync(data_, stream_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  // The whole buckets' rotated values, then an aligned (min, scale) pair.
  float* values() { return static_cast<float*>(data_); }
  float2* pair(int64_t values) { return reinterpret_cast<float2*>(this->values() + values); }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

// A hadamard buffer's shorter last bucket: its (min, scale) pair follows the whole
// buckets' rms, 4-byte aligned only, so the maxmin kernels meet it in scratch.
size_t hadamard_scratch_bytes(const WireLayout& layout, int64_t bucket) {
  return (static_cast<size_t>(layout.rotated_buckets * bucket) + 2) * sizeof(float);
}

// The whole buckets of a hadamard buffer by rotation, its shorter last bucket as maxmin.
template <typename T>
void encode_hadamard(const QuantizerParams& params, const WireLayout& layout, const T* src,
                     uint64_t seed, uint64_t stream_offset, uint8_t* dst, uint8_t* levels,
                     cudaStream_t stream) {
  const int64_t bucket = params.bucket_size, whole = layout.rotated_buckets;
  Scratch scratch(hadamard_scratch_bytes(layout, bucket), stream);
  if (whole > 0)
    launch_kernel(hadamard_encode<T>, blocks_for(whole, kWarpsPerBlock), stream,
                  "hadamard_encode", src, whole, bucket, params.bits, params.stochastic,
                  stream_key(seed), static_cast<uint32_t>(stream_offset), scratch.values(),
                  reinterpret_cast<float*>(dst), levels);
  const int64_t first = whole * bucket;
  if (layout.quantized > first) {
    float2* pair = scratch.pair(whole * bucket);
    encode_maxmin(params, src, first, layout.quantized - first, pair, levels, seed,
                  stream_offset, stream);
    check(cudaMemcpyAsync(dst + whole * sizeof(float), pair, sizeof(float2),
                          cudaMemcpyDeviceToDevice, stream),
          "copy the last bucket's pair");
  }
}

template <typename T>
void compress_as(const QuantizerParams& params, const T* src, int64_t n, uint8_t* dst,
                 uint64_t seed, uint64_t stream_offset, cudaStream_t stream) {
  const WireLayout layout = wire_layout(params, n);
  if (layout.total_bytes == 0) return;
  zero_padding(layout, dst, stream);
  uint8_t* levels = dst + layout.levels_offset;
  if (layout.quantized > 0) {
    switch (params.scheme) {
      case Scheme::kMaxMin:
        encode_maxmin(params, src, 0, layout.quantized, reinterpret_cast<float2*>(dst), levels,
                      seed, stream_offset, stream);
        break;
      case Scheme::kHadamard:
        encode_hadamard(params, layout, src, seed, stream_offset, dst, levels, stream);
        break;
    }
  }
  const int64_t raw_count = n - layout.quantized;
  if (raw_count > 0)
    launch_kernel(raw_to_wire<T>, blocks_for(raw_count, kThreads), stream, "raw_to_wire",
                  src + layout.quantized, raw_count,
                  reinterpret_cast<float*>(dst + layout.raw_offset));
}

template <typename T>
void decode_maxmin(const QuantizerParams& params, const uint8_t* levels, int64_t first,
                   int64_t count, const float2* meta, bool add, T* dst, cudaStream_t stream) {
  launch_kernel(unpack_dequantize<T>, blocks_for((count + 7) / 8, kThreads), stream,
                "unpack_dequantize", levels + first / 8 * params.bits, count, params.bucket_size,
                params.bits, meta, add, dst + first);
}

template <typename T>
void decode_hadamard(const QuantizerParams& params, const WireLayout& layout, const uint8_t* src,
                     const uint8_t* levels, bool add, T* dst, cudaStream_t stream) {
  const int64_t bucket = params.bucket_size, whole = layout.rotated_buckets;
  Scratch scratch(hadamard_scratch_bytes(layout, bucket), stream);
  if (whole > 0)
    launch_kernel(hadamard_decode<T>, blocks_for(whole, kWarpsPerBlock), stream,
                  "hadamard_decode", levels, reinterpret_cast<const float*>(src), whole, bucket,
                  params.bits, scratch.values(), add, dst);
  const int64_t first = whole * bucket;
  if (layout.quantized > first) {
    float2* pair = scratch.pair(whole * bucket);
    check(cudaMemcpyAsync(pair, src + whole * sizeof(float), sizeof(float2),
                          cudaMemcpyDeviceToDevice, stream),
          "copy the last bucket's pair");
    decode_maxmin(params, levels, first, layout.quantized - first, pair, add, dst, stream);
  }
}

template <typename T>
void decompress_as(const QuantizerParams& params, const uint8_t* src, int64_t n, T* dst,
                   bool add, cudaStream_t stream) {
  const WireLayout layout = wire_layout(params, n);
  if (layout.total_bytes == 0) return;
  const uint8_t* levels = src + layout.levels_offset;
  if (layout.quantized > 0) {
    switch (params.scheme) {
      case Scheme::kMaxMin:
        decode_maxmin(params, levels, 0, layout.quantized, reinterpret_cast<const float2*>(src),
                      add, dst, stream);
        break;
      case Scheme::kHadamard:
        decode_hadamard(params, layout, src, levels, add, dst, stream);
        break;
    }
  }
  const int64_t raw_count = n - layout.quantized;
  if (raw_count > 0)
    launch_kernel(raw_from_wire<T>, blocks_for(raw_count, kThreads), stream, "raw_from_wire",
                  reinterpret_cast<const float*>(src + layout.raw_offset), raw_count, add,
                  dst + layout.quantized);
}

// The compressed buffer's metadata is read as float2 (maxmin) or float (hadamard): a
// misaligned buffer would fault.
void check_call(const QuantizerParams& params, const void* compressed) {
  validate(params);
  if (reinterpret_cast<uintptr_t>(compressed) % alignof(float2) != 0)
    throw std::invalid_argument("a compressed buffer on a GPU must be " +
                                std::to_string(alignof(float2)) + "-byte aligned");
}

}  // namespace

void compress(const QuantizerParams& params, const void* src, DType dtype, int64_t n,
              uint8_t* dst, uint64_t seed, uint64_t stream_offset, cudaStream_t stream) {
  check_call(params, dst);
  switch (dtype) {
    case DType::Float32:
      return compress_as(params, static_cast<const float*>(src), n, dst, seed, stream_offset, stream);
    case DType::Float16:
      return compress_as(params, static_cast<const __half*>(src), n, dst, seed, stream_offset, stream);
    case DType::BFloat16:
      return compress_as(params, static_cast<const __nv_bfloat16*>(src), n, dst, seed, stream_offset, stream);
  }
}

void decompress(const QuantizerParams& params, const uint8_t* src, int64_t n, void* dst,
                DType dtype, bool add, cudaStream_t stream) {
  check_call(params, src);
  switch (dtype) {
    case DType::Float32:
      return decompress_as(params, src, n, static_cast<float*>(dst), add, stream);
    case DType::Float16:
      return decompress_as(params, src, n, static_cast<__half*>(dst), add, stream);
    case DType::BFloat16:
      return decompress_as(params, src, n, static_cast<__nv_bfloat16*>(dst), add, stream);
  }
}

void copy_floats(const float* src, int64_t n, float* dst, bool add, cudaStream_t stream) {
  if (n <= 0) return;
  launch_kernel(raw_from_wire<float>, blocks_for(n, kThreads), stream, "copy_floats", src, n,
                add, dst);
}

void add_error_floats(const float* values, const float* decoded, int64_t n, float* residual,
                      cudaStream_t stream) {
  if (n <= 0) return;
  launch_kernel(add_finite_difference, blocks_for(n, kThreads), stream,
                "add_finite_difference", values, decoded, n, residual);
}

}  // namespace cgx::compression::cuda
