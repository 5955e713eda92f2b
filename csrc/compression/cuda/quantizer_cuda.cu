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
// They run on the CPU too, under the CUDA emulation of the core tests (docs/cuda.md).
#include <cfloat>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "compression/cuda/quantizer_cuda.h"
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

template <typename T>
void compress_as(const QuantizerParams& params, const T* src, int64_t n, uint8_t* dst,
                 uint64_t seed, uint64_t stream_offset, cudaStream_t stream) {
  const WireLayout layout = wire_layout(params, n);
  if (layout.total_bytes == 0) return;
  const float max_level = static_cast<float>((1 << params.bits) - 1);
  auto* meta = reinterpret_cast<float2*>(dst);
  // Padding is zero so that equal inputs give equal buffers.
  const size_t meta_bytes = static_cast<size_t>(layout.buckets) * sizeof(float2);
  check(cudaMemsetAsync(dst + meta_bytes, 0, layout.levels_offset - meta_bytes, stream),
        "memset");
  const size_t levels_end = layout.levels_offset + layout.levels_bytes;
  check(cudaMemsetAsync(dst + levels_end, 0, layout.raw_offset - levels_end, stream), "memset");
  if (layout.quantized > 0) {
    launch_kernel(bucket_meta<T>, blocks_for(layout.buckets, kWarpsPerBlock), stream,
                  "bucket_meta", src, layout.quantized, params.bucket_size, layout.buckets,
                  max_level, meta);
    launch_kernel(quantize_pack<T>, blocks_for((layout.quantized + 7) / 8, kThreads), stream,
                  "quantize_pack", src, layout.quantized, params.bucket_size, params.bits,
                  max_level, params.stochastic, stream_key(seed),
                  static_cast<uint32_t>(stream_offset), meta, dst + layout.levels_offset);
  }
  const int64_t raw_count = n - layout.quantized;
  if (raw_count > 0)
    launch_kernel(raw_to_wire<T>, blocks_for(raw_count, kThreads), stream, "raw_to_wire",
                  src + layout.quantized, raw_count,
                  reinterpret_cast<float*>(dst + layout.raw_offset));
}

template <typename T>
void decompress_as(const QuantizerParams& params, const uint8_t* src, int64_t n, T* dst,
                   bool add, cudaStream_t stream) {
  const WireLayout layout = wire_layout(params, n);
  if (layout.total_bytes == 0) return;
  if (layout.quantized > 0)
    launch_kernel(unpack_dequantize<T>, blocks_for((layout.quantized + 7) / 8, kThreads),
                  stream, "unpack_dequantize", src + layout.levels_offset, layout.quantized,
                  params.bucket_size, params.bits, reinterpret_cast<const float2*>(src), add,
                  dst);
  const int64_t raw_count = n - layout.quantized;
  if (raw_count > 0)
    launch_kernel(raw_from_wire<T>, blocks_for(raw_count, kThreads), stream, "raw_from_wire",
                  reinterpret_cast<const float*>(src + layout.raw_offset), raw_count, add,
                  dst + layout.quantized);
}

// The CUDA kernels implement the maxmin scheme only (the CPU codec has hadamard). The
// backend refuses such a call before it begins; this guards the codec's other callers.
// The compressed buffer's metadata is read as float2: a misaligned buffer would fault.
void check_call(const QuantizerParams& params, const void* compressed) {
  validate(params);
  if (params.scheme != Scheme::kMaxMin)
    throw std::invalid_argument(
        "the hadamard scheme is not implemented for CUDA tensors yet; use scheme 'maxmin' "
        "for layers on a GPU");
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
