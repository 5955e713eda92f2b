// Bucket quantizer: the codec every collective uses, in two schemes.
//   maxmin   (QSGD style) levels spread evenly between each bucket's min and max;
//   hadamard each bucket rotated (rotation.h), then levels placed for a normal distribution
//            and scaled by the bucket's root mean square: about a quarter of maxmin's
//            squared error at 2 bits on real gradients, for 4 more bytes of metadata less.
//
// Pure: sizes in, bytes out, no communication, no torch. Wire format (docs/wire-format.md):
// for n values and bucket size B, the first q values are quantized in buckets of B
// (q = n, or q = n rounded down to a multiple of B when skip_incomplete_buckets is set and
// n % B != 0); the remaining n - q values travel raw. The buffer holds three sections, each
// starting at a 16-byte aligned offset:
//   meta   : maxmin: ceil(q / B) pairs of float32 (min, scale); hadamard: one float32
//            rms per whole bucket, then a (min, scale) pair for a shorter last bucket,
//            which travels as in maxmin (the rotation needs B values)
//   levels : bits-bit levels, value i at bits [i*bits, (i+1)*bits) of a little-endian bit
//            stream, padded to a multiple of 8 values (8 values = `bits` bytes)
//   raw    : n - q float32 values
// A maxmin value decodes as min + level * scale (two float roundings, no fused multiply-add);
// a hadamard bucket as the inverse rotation of table[level] * rms.
// A bucket holding NaN or +-Inf (or whose range overflows float) is stored as
// min = scale = NaN, levels 0: every value of that bucket decodes to NaN, on every rank.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "compression/schemes.h"

namespace cgx::compression {

// A layer or group at kRawBits is not quantized (its values travel exactly).
constexpr int kRawBits = 32;

struct QuantizerParams {
  int bits = 8;                       // 1..kMaxBits
  int64_t bucket_size = 512;          // >= 1
  bool skip_incomplete_buckets = false;
  bool stochastic = false;            // stochastic rounding instead of round-to-nearest
  Scheme scheme = Scheme::kMaxMin;
};

// Throws std::invalid_argument for bits outside 1..kMaxBits or bucket_size < 1, and where
// the scheme does not take them (schemes.h, scheme_problem).
void validate(const QuantizerParams& params);

// Where the sections of a compressed buffer of n values lie (docs/wire-format.md); shared
// by the CPU and CUDA codecs.
struct WireLayout {
  int64_t quantized = 0;  // q: values carried as levels; the rest travel raw
  int64_t buckets = 0;
  int64_t rotated_buckets = 0;  // hadamard: the whole buckets; the rest is one maxmin bucket
  size_t meta_bytes = 0;
  size_t levels_offset = 0;
  size_t levels_bytes = 0;
  size_t raw_offset = 0;
  size_t total_bytes = 0;
};
WireLayout wire_layout(const QuantizerParams& params, int64_t n);

// Exact size in bytes of the compressed form of n values.
size_t compressed_bytes(const QuantizerParams& params, int64_t n);

// Each call below may split its buckets over up to `threads` threads (codec_threads.h):
// the same bytes and values whatever the count.

// Compresses n float32 values into dst (compressed_bytes(params, n) bytes).
// With stochastic rounding, `seed` selects the random stream and `stream_offset` is the
// position of src[0] in it (docs/wire-format.md): the same seed, offset and input give the
// same bytes, and compressing [0, n) in pieces, each at its own offset, draws as compressing
// it whole. Round-to-nearest ignores both.
void compress(const QuantizerParams& params, const float* src, int64_t n, uint8_t* dst,
              uint64_t seed, uint64_t stream_offset, int threads = 1);

// compress, and in the same pass what its receivers will decode: residual[i] +=
// values[i] - decoded value i where `residual` is set and the difference is finite (error
// feedback), and values[i] = decoded value i where `decode_in_place`. The same bytes and
// values as compress and then decompress. The maxmin scheme only (std::invalid_argument
// for another).
void compress_and_decode(const QuantizerParams& params, float* values, int64_t n, uint8_t* dst,
                         uint64_t seed, uint64_t stream_offset, float* residual,
                         bool decode_in_place, int threads = 1);

// dst[i] = decoded value i.
void decompress(const QuantizerParams& params, const uint8_t* src, int64_t n, float* dst,
                int threads = 1);

// dst[i] += decoded value i (fused: one pass over dst).
void decompress_add(const QuantizerParams& params, const uint8_t* src, int64_t n, float* dst,
                    int threads = 1);

}  // namespace cgx::compression
