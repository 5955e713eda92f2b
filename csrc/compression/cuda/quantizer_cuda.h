// The bucket quantizer on the GPU, both schemes (maxmin, hadamard): the same wire format and the same floating-point
// operations as the CPU codec (compression/quantizer.h, docs/wire-format.md), so a buffer
// compressed here decodes on the CPU to the same values, and both codecs write the same
// bytes (stochastic rounding draws from the same stream, stream_hash.h).
//
// Device work on a caller's stream: pointers are device memory, nothing synchronises. The
// hadamard scheme with buckets other than 256, 512 and 1024 values takes a stream-ordered
// scratch of 4 bytes per value (cudaMallocAsync); no other call allocates.
// Inputs may be float32, float16 or bfloat16 (converted exactly to float32 on load, as the
// CPU path converts before compressing); decoded values are written in the same dtypes.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "compression/quantizer.h"

namespace cgx::compression::cuda {

enum class DType { Float32, Float16, BFloat16 };

// dst: compressed_bytes(params, n) bytes. The compressed buffer (dst here, src below) must
// be 4-byte aligned (std::invalid_argument otherwise).
// `seed` and `stream_offset` as compression::compress takes them (the same bytes).
void compress(const QuantizerParams& params, const void* src, DType dtype, int64_t n,
              uint8_t* dst, uint64_t seed, uint64_t stream_offset, cudaStream_t stream);

// dst[i] = decoded value i, or dst[i] + decoded value i with `add` (one fused pass).
void decompress(const QuantizerParams& params, const uint8_t* src, int64_t n, void* dst,
                DType dtype, bool add, cudaStream_t stream);

// dst[i] = src[i], or dst[i] + src[i] with `add`: float32 values that travel raw.
void copy_floats(const float* src, int64_t n, float* dst, bool add, cudaStream_t stream);

// residual[i] += values[i] - decoded[i] where that is finite (LayoutCodec::add_error).
void add_error_floats(const float* values, const float* decoded, int64_t n, float* residual,
                      cudaStream_t stream);

}  // namespace cgx::compression::cuda
