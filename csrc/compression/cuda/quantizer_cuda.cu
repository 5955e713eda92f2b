// The CUDA bucket quantizer: its entry points and the maxmin kernels (the hadamard
// scheme's whole buckets: hadamard_kernels.cuh). Every floating-point operation is written
// with an explicit rounding intrinsic (__fadd_rn, __fmul_rn, ...) so that nvcc cannot
// contract it into a fused multiply-add: the bits must match the CPU codec's
// (docs/wire-format.md).
//
// Kernels, all memory-bound:
//   bucket_meta: one warp per bucket: min, max, finiteness -> (min, scale) in the meta
//     section. Lanes read consecutive values (coalesced), reduce with shuffles.
//   quantize_pack: one thread per group of 8 values -> `bits` bytes of the level stream;
//     the group's 8 inputs are one or two 16-byte loads when aligned.
//   unpack_dequantize: one thread per group of 8 levels -> 8 values, optionally added to
//     the destination in the same pass, stored (and read, to add) as 16-byte vectors.
//   raw_to_wire / raw_from_wire: the n - q values that travel as float32 (and copy_floats).
//   add_finite_difference: error feedback's residual update.
//   hadamard_{encode,decode}_in_registers: the hadamard scheme's whole buckets of 256,
//     512 or 1024 values, one warp per bucket held in its registers (stages by shuffles).
//   hadamard_{encode,decode}_in_scratch: whole buckets of the other sizes (8 .. 65536,
//     past what registers hold), one warp per bucket rotated in a float32 scratch in
//     device memory. A shorter last bucket travels as a one-bucket maxmin buffer, through
//     the maxmin kernels.
// They run on the CPU too, under the CUDA emulation of the core tests (docs/cuda.md).
#include <cfloat>

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "compression/cuda/hadamard_kernels.cuh"
#include "compression/cuda/quantizer_cuda.h"
#include "compression/cuda/value_groups.cuh"
#include "compression/stream_hash.h"

namespace cgx::compression::cuda {

namespace {


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


// The (min, scale) of each value of a group in turn: one division per group, not one per
// value (a 64-bit division costs more than the rest of a value's work), and the pair read
// once per bucket the group meets (one, unless the bucket size is not a multiple of 8).
class BucketCode {
 public:
  __device__ BucketCode(const float* meta, int64_t first, int64_t bucket_size)
      : meta_(meta), bucket_size_(bucket_size), bucket_(first / bucket_size),
        left_(bucket_size - (first - bucket_ * bucket_size)) {}
  // Moves to the next value (the group's first at the first call).
  __device__ void next() {
    if (!read_) {
      read_ = true;
      load();
    } else if (left_ == 0) {
      ++bucket_;
      left_ = bucket_size_;
      load();
    }
    --left_;
  }
  float min = 0.0f, scale = 0.0f;  // of the current value's bucket

 private:
  __device__ void load() {
    min = meta_[2 * bucket_];
    scale = meta_[2 * bucket_ + 1];
  }
  const float* meta_;
  int64_t bucket_size_;
  int64_t bucket_;
  int64_t left_;  // values of bucket_ not yet visited
  bool read_ = false;
};

// A bucket's (min, scale) from its lanes' min, max and finiteness (every lane gets it):
// the CPU codec's, or its quiet NaN pair for a bucket that is not finite.
struct MaxMinCode {
  float min, scale;
};
__device__ __forceinline__ MaxMinCode warp_bucket_code(float mn, float mx, bool finite,
                                                       float max_level) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other_mn = __shfl_xor_sync(kFullWarp, mn, offset);
    const float other_mx = __shfl_xor_sync(kFullWarp, mx, offset);
    mn = other_mn < mn ? other_mn : mn;
    mx = other_mx > mx ? other_mx : mx;
  }
  finite = __all_sync(kFullWarp, finite);
  // + 0.0f: -0 becomes +0, so the bytes do not depend on the order of the scan.
  mn = __fadd_rn(mn, 0.0f);
  mx = __fadd_rn(mx, 0.0f);
  const float scale = __fdiv_rn(__fsub_rn(mx, mn), max_level);
  if (finite && isfinite(mn) && isfinite(mx) && isfinite(scale)) return {mn, scale};
  // std::numeric_limits<float>::quiet_NaN(), as the CPU codec writes it: same bytes.
  const float nan = __int_as_float(0x7fc00000);
  return {nan, nan};
}

// The level of value v (index `index` in the call's stochastic stream) in its bucket.
__device__ __forceinline__ uint32_t maxmin_level(float v, MaxMinCode code, float max_level,
                                                 bool stochastic, uint32_t key, uint32_t index) {
  if (isnan(code.scale)) return 0;  // a non-finite bucket: every level 0
  float inv = code.scale > 0.0f ? __fdiv_rn(1.0f, code.scale) : 0.0f;
  if (!isfinite(inv)) inv = 0.0f;
  float offset = 0.5f;
  if (stochastic) {
    const uint32_t h = lowbias32(index ^ key);
    offset = __fmul_rn(static_cast<float>(static_cast<int32_t>(h >> 8)), 0x1p-24f);
  }
  float y = __fadd_rn(__fmul_rn(__fsub_rn(v, code.min), inv), offset);
  y = y < max_level ? y : max_level;
  return static_cast<uint32_t>(__float2int_rz(y));
}

template <typename T>
__global__ void bucket_meta(const T* __restrict__ src, int64_t quantized, int64_t bucket_size,
                            int64_t buckets, float max_level, float* __restrict__ meta) {
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
    const MaxMinCode code = warp_bucket_code(mn, mx, finite, max_level);
    if (lane == 0) {
      meta[2 * b] = code.min;
      meta[2 * b + 1] = code.scale;
    }
  }
}

template <typename T>
__global__ void quantize_pack(const T* __restrict__ src, int64_t quantized, int64_t bucket_size,
                              int bits, float max_level, bool stochastic, uint32_t key,
                              uint32_t stream_offset, const float* __restrict__ meta, uint8_t* __restrict__ stream) {
  const int64_t groups = (quantized + 7) / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    float v[8];
    load_group(src, g, quantized, v);
    uint64_t word = 0;
    BucketCode code(meta, 8 * g, bucket_size);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int64_t i = 8 * g + j;
      if (i >= quantized) break;  // padding levels stay 0
      code.next();
      const uint32_t level = maxmin_level(v[j], {code.min, code.scale}, max_level, stochastic, key,
                                          stream_offset + static_cast<uint32_t>(i));
      word |= static_cast<uint64_t>(level) << (j * bits);
    }
    write_group(stream, g, bits, word);
  }
}

// Whole buckets of n = 32 V values in one pass: a warp loads its bucket once into its
// registers (lane l holds values lV .. lV + V - 1), reduces it, and quantizes what it
// holds; bucket_meta and quantize_pack each read the input. The same bytes.
template <typename T, int V>
__global__ void maxmin_encode_in_registers(const T* __restrict__ src, int64_t buckets, int bits,
                                           float max_level, bool stochastic, uint32_t key,
                                           uint32_t stream_offset, float* __restrict__ meta,
                                           uint8_t* __restrict__ stream) {
  constexpr int64_t n = 32 * V;
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarpsPerBlock;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
       b < buckets; b += warps) {
    const int64_t first = b * n + lane * V;  // this lane's first value in the call
    float v[V];
    float mn = INFINITY, mx = -INFINITY;
    bool finite = true;
#pragma unroll
    for (int q = 0; q < V / 8; ++q) {
      float group[8];
      load_group(src + first, q, V, group);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float x = v[8 * q + j] = group[j];
        finite = finite && isfinite(x);
        mn = x < mn ? x : mn;
        mx = x > mx ? x : mx;
      }
    }
    const MaxMinCode code = warp_bucket_code(mn, mx, finite, max_level);
    if (lane == 0) {
      meta[2 * b] = code.min;
      meta[2 * b + 1] = code.scale;
    }
    uint8_t* out = stream + first / 8 * bits;
#pragma unroll
    for (int q = 0; q < V / 8; ++q) {
      uint64_t word = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t index = stream_offset + static_cast<uint32_t>(first + 8 * q + j);
        word |= static_cast<uint64_t>(maxmin_level(v[8 * q + j], code, max_level, stochastic, key, index))
                << (j * bits);
      }
      write_group(out, q, bits, word);
    }
  }
}

template <typename T>
__global__ void unpack_dequantize(const uint8_t* __restrict__ stream, int64_t quantized,
                                  int64_t bucket_size, int bits,
                                  const float* __restrict__ meta, bool add, T* __restrict__ dst) {
  const int64_t groups = (quantized + 7) / 8;
  const uint64_t mask = (uint64_t{1} << bits) - 1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; g < groups;
       g += stride) {
    const uint64_t word = read_group(stream, g, bits);
    BucketCode code(meta, 8 * g, bucket_size);
    float values[8] = {};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (8 * g + j >= quantized) break;
      code.next();
      const float level = static_cast<float>(static_cast<int>((word >> (j * bits)) & mask));
      values[j] = decode(code.min, level, code.scale);
    }
    store_group(dst, g, quantized, values, add);
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

// Zero padding after the metadata and after the levels, so that equal inputs give equal
// buffers.
void zero_padding(const WireLayout& layout, uint8_t* dst, cudaStream_t stream) {
  check(cudaMemsetAsync(dst + layout.meta_bytes, 0, layout.levels_offset - layout.meta_bytes,
                        stream),
        "memset");
  const size_t levels_end = layout.levels_offset + layout.levels_bytes;
  check(cudaMemsetAsync(dst + levels_end, 0, layout.raw_offset - levels_end, stream), "memset");
}

// The bucket sizes whose whole buckets a warp holds in its registers: 32 V values, V = 8,
// 16, 32 (a lane's values are whole groups of 8, and 32 floats a lane leave room in its
// registers). Calls `launch` with std::integral_constant<int, V> for those, and says
// whether it did; other sizes take the kernels that go through memory.
template <typename Launch>
bool in_registers(int64_t bucket, Launch launch) {
  switch (bucket) {
    case 256: launch(std::integral_constant<int, 8>{}); return true;
    case 512: launch(std::integral_constant<int, 16>{}); return true;
    case 1024: launch(std::integral_constant<int, 32>{}); return true;
    default: return false;
  }
}

// Values [first, first + count) in maxmin buckets (all of a maxmin buffer; a hadamard
// buffer's shorter last bucket), their (min, scale) pairs at `meta`, their levels in the
// level stream `levels` from value `first` on.
template <typename T>
void encode_maxmin(const QuantizerParams& params, const T* src, int64_t first, int64_t count,
                   float* meta, uint8_t* levels, uint64_t seed, uint64_t stream_offset,
                   cudaStream_t stream) {
  const int64_t bucket = params.bucket_size;
  const float max_level = static_cast<float>((1 << params.bits) - 1);
  const uint32_t key = stream_key(seed);
  // Whole buckets of the sizes that fit a warp's registers in one pass, the rest in two.
  const int64_t whole = count / bucket;
  const auto launch = [&](auto lane_values) {
    launch_kernel(maxmin_encode_in_registers<T, decltype(lane_values)::value>,
                  blocks_for(whole, kWarpsPerBlock), stream, "maxmin_encode", src + first, whole,
                  params.bits, max_level, params.stochastic, key,
                  static_cast<uint32_t>(stream_offset + first), meta, levels + first / 8 * params.bits);
  };
  const int64_t done = whole > 0 && in_registers(bucket, launch) ? whole * bucket : 0;
  if (done == count) return;
  const int64_t rest = first + done, rest_count = count - done;
  float* rest_meta = meta + 2 * (done / bucket);
  const int64_t buckets = (rest_count + bucket - 1) / bucket;
  launch_kernel(bucket_meta<T>, blocks_for(buckets, kWarpsPerBlock), stream, "bucket_meta",
                src + rest, rest_count, bucket, buckets, max_level, rest_meta);
  launch_kernel(quantize_pack<T>, blocks_for((rest_count + 7) / 8, kThreads), stream, "quantize_pack",
                src + rest, rest_count, bucket, params.bits, max_level, params.stochastic, key,
                static_cast<uint32_t>(stream_offset + rest), rest_meta,
                levels + rest / 8 * params.bits);
}

// Device memory for one call on `stream`, released in stream order: the rotated values
// of the buckets that do not fit a warp's registers.
class Scratch {
 public:
  Scratch(size_t bytes, cudaStream_t stream) : stream_(stream) {
    check(cudaMallocAsync(&data_, bytes, stream), "cudaMallocAsync");
  }
  ~Scratch() { cudaFreeAsync(data_, stream_); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  float* values() { return static_cast<float*>(data_); }

 private:
  void* data_ = nullptr;
  cudaStream_t stream_;
};

// The whole buckets of a hadamard buffer by rotation, its shorter last bucket as maxmin
// (its (min, scale) pair right after the whole buckets' rms).
template <typename T>
void encode_hadamard(const QuantizerParams& params, const WireLayout& layout, const T* src,
                     uint64_t seed, uint64_t stream_offset, uint8_t* dst, uint8_t* levels,
                     cudaStream_t stream) {
  const int64_t bucket = params.bucket_size, whole = layout.rotated_buckets;
  float* rms = reinterpret_cast<float*>(dst);
  const uint32_t key = stream_key(seed), offset = static_cast<uint32_t>(stream_offset);
  const int blocks = blocks_for(whole, kWarpsPerBlock);
  const auto launch = [&](auto lane_values) {
    launch_kernel(hadamard_encode_in_registers<T, decltype(lane_values)::value>, blocks, stream,
                  "hadamard_encode", src, whole, params.bits, params.stochastic, key, offset, rms,
                  levels);
  };
  if (whole > 0 && !in_registers(bucket, launch)) {
    Scratch scratch(static_cast<size_t>(whole * bucket) * sizeof(float), stream);
    launch_kernel(hadamard_encode_in_scratch<T>, blocks, stream,
                  "hadamard_encode", src, whole, bucket, params.bits, params.stochastic, key,
                  offset, scratch.values(), rms, levels);
  }
  const int64_t first = whole * bucket;
  if (layout.quantized > first)
    encode_maxmin(params, src, first, layout.quantized - first, rms + whole, levels, seed,
                  stream_offset, stream);
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
        encode_maxmin(params, src, 0, layout.quantized, reinterpret_cast<float*>(dst), levels,
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
                   int64_t count, const float* meta, bool add, T* dst, cudaStream_t stream) {
  launch_kernel(unpack_dequantize<T>, blocks_for((count + 7) / 8, kThreads), stream,
                "unpack_dequantize", levels + first / 8 * params.bits, count, params.bucket_size,
                params.bits, meta, add, dst + first);
}

template <typename T>
void decode_hadamard(const QuantizerParams& params, const WireLayout& layout, const uint8_t* src,
                     const uint8_t* levels, bool add, T* dst, cudaStream_t stream) {
  const int64_t bucket = params.bucket_size, whole = layout.rotated_buckets;
  const float* rms = reinterpret_cast<const float*>(src);
  const int blocks = blocks_for(whole, kWarpsPerBlock);
  const auto launch = [&](auto lane_values) {
    launch_kernel(hadamard_decode_in_registers<T, decltype(lane_values)::value>, blocks, stream,
                  "hadamard_decode", levels, rms, whole, params.bits, add, dst);
  };
  if (whole > 0 && !in_registers(bucket, launch)) {
    Scratch scratch(static_cast<size_t>(whole * bucket) * sizeof(float), stream);
    launch_kernel(hadamard_decode_in_scratch<T>, blocks, stream,
                  "hadamard_decode", levels, rms, whole, bucket, params.bits, scratch.values(),
                  add, dst);
  }
  const int64_t first = whole * bucket;
  if (layout.quantized > first)
    decode_maxmin(params, levels, first, layout.quantized - first, rms + whole, add, dst, stream);
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
        decode_maxmin(params, levels, 0, layout.quantized, reinterpret_cast<const float*>(src),
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

// The compressed buffer's metadata is read as floats: a misaligned buffer would fault.
void check_call(const QuantizerParams& params, const void* compressed) {
  validate(params);
  if (reinterpret_cast<uintptr_t>(compressed) % alignof(float) != 0)
    throw std::invalid_argument("a compressed buffer on a GPU must be " +
                                std::to_string(alignof(float)) + "-byte aligned");
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
