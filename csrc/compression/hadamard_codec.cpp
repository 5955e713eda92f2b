// The hadamard scheme's CPU codec (schemes.h): each whole bucket rotated (rotation.h, the
// loops of rotated_loops.h), quantized to the levels of a normal distribution scaled by the
// bucket's rms (gaussian_levels.h), packed; a shorter last bucket as maxmin. Wire format:
// quantizer.h and docs/wire-format.md. As quantizer.cpp: built with -ffp-contract=off, each
// formula in the order written (the CUDA codec reproduces them bit for bit).
#include "compression/hadamard_codec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "compression/gaussian_levels.h"
#include "compression/level_stream.h"
#include "compression/rotated_loops.h"
#include "compression/rotation.h"
#include "compression/stream_hash.h"

namespace cgx::compression {
namespace {

using namespace codec;

const GaussianLevels& gaussian_levels(int bits) {
  static const GaussianLevels tables[kMaxHadamardBits] = {
      gaussian_levels_of(1), gaussian_levels_of(2), gaussian_levels_of(3), gaussian_levels_of(4)};
  return tables[bits - 1];
}

// Buckets encoded together: their sums of squares interleave (rotated_loops.h).
constexpr int kBucketsTogether = 4;

// Buckets between the one encoded or decoded and the one whose input is asked for ahead
// (prefetch): 8 of 512 values, 16 KiB.
constexpr int64_t kPrefetchBuckets = 2 * kBucketsTogether;

// Asks for values [from, from + count) of x, as far as `end`, a cache line at a time, into
// L2: the hardware's own prefetcher, stalled by each bucket's work, keeps too few lines in
// flight (64 MiB on one thread: 4-bit compress 3.0 -> 3.7 GB/s, decompress-add 4.1 -> 6.2).
// Not maxmin's: its passes are short enough for the hardware's (16 MiB: compress 11.5 ->
// 9.7 GB/s with it).
CGX_INLINE void prefetch(const float* x, int64_t from, int64_t count, int64_t end) {
  for (int64_t k = from; k < std::min(from + count, end); k += 64 / sizeof(float)) __builtin_prefetch(x + k, 0, 2);
}

// The working space on this thread: kBucketsTogether buckets' rotated values, one
// bucket's levels (stochastic rounding's), the rotation's signs, and the
// loops (rotated_loops.h) this CPU runs, looked up once per buffer.
struct Scratch {
  float* values;
  uint8_t* levels;
  const float* signs;
  const RotatedLoops* loops;
};

Scratch bucket_scratch(int64_t bucket) {
  thread_local std::vector<float> values;
  thread_local std::vector<uint8_t> levels;
  values.resize(static_cast<size_t>(bucket * kBucketsTogether));
  levels.resize(static_cast<size_t>(bucket));
  return {values.data(), levels.data(), rotation_signs(bucket), &rotated_loops()};
}

// One rotated bucket `y` of rms `rms` (not NaN), its levels packed into `stream`
// (`levels`: scratch for stochastic rounding).
CGX_INLINE void quantize_rotated(const float* __restrict y, int64_t len, float rms, int bits,
                                 bool stochastic, uint32_t first_index, uint32_t key,
                                 const RotatedLoops& loops, uint8_t* __restrict levels,
                                 uint8_t* __restrict stream) {
  float inv = rms > 0.0f ? 1.0f / rms : 0.0f;
  if (!std::isfinite(inv)) inv = 0.0f;
  const GaussianLevels& t = gaussian_levels(bits);
  const int top = (1 << bits) - 1;
  if (!stochastic) {
    loops.nearest(y, len, inv, t, bits, stream);
    return;
  }
  for (int64_t k = 0; k < len; ++k) {
    const float z = y[k] * inv;
    int below = 0;  // the level under z (0 below the lowest, top - 1 above the highest)
    for (int j = 1; j < top; ++j) below += z >= t.level[j];
    const float p = (z - t.level[below]) * t.inv_gap[below];  // where z lies in the gap
    const uint32_t h = lowbias32((first_index + static_cast<uint32_t>(k)) ^ key);
    const float u = static_cast<float>(static_cast<int32_t>(h >> 8)) * 0x1p-24f;
    levels[k] = static_cast<uint8_t>(below + (u < p));
  }
  pack(bits, levels, len / 8, stream);
}

// A hadamard buffer's shorter last bucket: its (min, scale) after the whole buckets' rms.
MaxminRun hadamard_tail(const QuantizerParams& params, const Layout& layout) {
  const int64_t first = layout.rotated_buckets * params.bucket_size;
  return maxmin_run(params, layout, first, layout.quantized,
                    static_cast<size_t>(layout.rotated_buckets) * sizeof(float));
}

// Whole buckets [first, last) of a hadamard buffer, kBucketsTogether at a time: each
// rotated, their rms (NaN, levels all 0, for a bucket holding NaN, Inf or a magnitude of
// kMaxRotatedMagnitude or more), levels, packed.
CGX_AVX2_CLONE void encode_hadamard(const QuantizerParams& params, const Layout& layout,
                                    const float* src, uint64_t seed, uint32_t stream_offset,
                                    uint8_t* dst, int64_t first, int64_t last) {
  const int64_t bucket = params.bucket_size;
  const uint32_t key = stream_key(seed);
  uint8_t* stream = dst + layout.levels_offset;
  const Scratch scratch = bucket_scratch(bucket);
  const RotatedLoops& loops = *scratch.loops;
  for (int64_t b = first; b < last; b += kBucketsTogether) {
    const int count = static_cast<int>(std::min<int64_t>(kBucketsTogether, last - b));
    prefetch(src, (b + kPrefetchBuckets) * bucket, kBucketsTogether * bucket, last * bucket);
    bool in_range[kBucketsTogether];
    for (int c = 0; c < count; ++c)
      in_range[c] = loops.rotate(src + (b + c) * bucket, scratch.signs, bucket, scratch.values + c * bucket);
    double sums[kBucketsTogether];
    loops.sums_of_squares(scratch.values, bucket, count, sums);
    for (int c = 0; c < count; ++c) {
      const int64_t start = (b + c) * bucket;
      float rms = std::numeric_limits<float>::quiet_NaN();
      uint8_t* packed = stream + start / 8 * params.bits;
      if (in_range[c]) {
        rms = static_cast<float>(std::sqrt(sums[c] / static_cast<double>(bucket)));
        quantize_rotated(scratch.values + c * bucket, bucket, rms, params.bits, params.stochastic,
                         stream_offset + static_cast<uint32_t>(start), key, loops, scratch.levels, packed);
      } else {
        std::memset(packed, 0, static_cast<size_t>(bucket / 8 * params.bits));  // every level 0
      }
      std::memcpy(dst + (b + c) * sizeof(float), &rms, sizeof(rms));
    }
  }
}

CGX_AVX2_CLONE void decode_hadamard(const QuantizerParams& params, const Layout& layout,
                                    const uint8_t* src, bool add, float* dst, int64_t first,
                                    int64_t last) {
  const int64_t bucket = params.bucket_size;
  const uint8_t* stream = src + layout.levels_offset;
  const Scratch scratch = bucket_scratch(bucket);
  const GaussianLevels& t = gaussian_levels(params.bits);
  for (int64_t b = first; b < last; ++b) {
    const int64_t start = b * bucket;
    if (add) prefetch(dst, start + kPrefetchBuckets * bucket, bucket, last * bucket);
    float rms;
    std::memcpy(&rms, src + b * sizeof(float), sizeof(rms));
    float scaled[16] = {};  // each level times rms: the product every value of it decodes to
    for (int j = 0; j < (1 << params.bits); ++j) scaled[j] = t.level[j] * rms;
    scratch.loops->unrotate(stream + start / 8 * params.bits, params.bits, scaled, scratch.signs, bucket,
                            scratch.values, add, dst + start);
  }
}

}  // namespace

// A hadamard buffer: its whole buckets in parts, then its shorter last bucket (if any) as
// maxmin.
void encode_hadamard_buffer(const QuantizerParams& params, const Layout& layout, const float* src,
                            uint64_t seed, uint32_t stream_offset, uint8_t* dst, int threads) {
  const int64_t bucket = params.bucket_size;
  in_parts(layout.rotated_buckets * bucket, bucket, threads, [&](int64_t first, int64_t last) {
    encode_hadamard(params, layout, src, seed, stream_offset, dst, first / bucket, last / bucket);
  });
  const MaxminRun tail = hadamard_tail(params, layout);
  if (tail.layout.quantized > 0)
    encode_maxmin_run(params, tail, src, seed, stream_offset, dst);
}

void decode_hadamard_buffer(const QuantizerParams& params, const Layout& layout, const uint8_t* src,
                            bool add, float* dst, int threads) {
  const int64_t bucket = params.bucket_size;
  in_parts(layout.rotated_buckets * bucket, bucket, threads, [&](int64_t first, int64_t last) {
    decode_hadamard(params, layout, src, add, dst, first / bucket, last / bucket);
  });
  const MaxminRun tail = hadamard_tail(params, layout);
  if (tail.layout.quantized > 0)
    decode_maxmin_run(params, tail, src, add, dst);
}

}  // namespace cgx::compression
