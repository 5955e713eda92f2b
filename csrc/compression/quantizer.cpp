// The quantizer's CPU codec: the maxmin scheme, and the dispatch of each call to its
// scheme's codec (schemes.h; the hadamard one is hadamard_codec.cpp). Wire format and
// arithmetic: quantizer.h and docs/wire-format.md. The CUDA codec reproduces every floating-point operation here, so:
//   - build with -ffp-contract=off: a fused multiply-add would change decoded bits;
//   - keep each formula in the order written (no reassociation, no fast-math).
//
// Structure: values are processed in chunks of kChunk (a multiple of 8, so chunks start on
// whole bytes of the level stream). Within a chunk, each bucket is scanned for min/max and
// then quantized while still in L1 into one byte per level; the chunk's levels are then
// packed into the bit stream by a per-width routine. Decoding unpacks a chunk to one byte
// per level, then dequantizes it bucket by bucket.
#include "quantizer.h"
#include "codec_threads.h"
#include "hadamard_codec.h"
#include "level_stream.h"
#include "maxmin_loops.h"
#include "stream_hash.h"
#include "common/mix.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <string>

namespace cgx::compression {
namespace {

using namespace codec;

// Levels held unpacked at a time: 4 KiB of levels plus 16 KiB of floats stay in L1.
constexpr int64_t kChunk = 4096;
static_assert(kChunk % 8 == 0, "chunks must start on a byte boundary of the level stream");

// 2^48 values (1 PiB of float32) is past any tensor, and keeps every size below in range.
constexpr int64_t kMaxValues = int64_t{1} << 48;

void check_count(int64_t n) {
  if (n < 0 || n > kMaxValues)
    throw std::invalid_argument("the number of values must be in 0..2^48, got " +
                                std::to_string(n));
}

struct BucketCode {
  float min;
  float scale;
  float inv_scale;  // 0 when every value maps to level 0
  bool finite;
};

// A bucket's code from its range and probe (maxmin_loops.h's, or encode_bucket's).
CGX_INLINE BucketCode code_of(float mn, float mx, float probe_sum, int bits) {
  // Which zero a min/max of {-0, +0} returns depends on the scan order; +0 for both makes
  // the stored bytes independent of it (the CUDA codec and the AVX2 loops scan in other
  // orders).
  mn += 0.0f;
  mx += 0.0f;

  const float scale = (mx - mn) / static_cast<float>((1 << bits) - 1);
  if (!(probe_sum == 0.0f && std::isfinite(mn) && std::isfinite(mx) && std::isfinite(scale))) {
    const float nan = std::numeric_limits<float>::quiet_NaN();
    return {nan, nan, 0.0f, false};
  }
  float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
  // A subnormal scale below 2^-128 has no finite inverse; the bucket then decodes to its min
  // (an error below 2^-120, instead of the NaN that inf * 0 would produce).
  if (!std::isfinite(inv)) inv = 0.0f;
  return {mn, scale, inv, true};
}

// GCC/Clang vector extension: four floats, compiled to SSE2 / NEON / whatever the target has.
typedef float f32x4 __attribute__((vector_size(16)));

// One pass over the bucket: min, max, and whether every value is finite. Several vector
// accumulators hide the latency of min/max; nothing is reassociated.
CGX_INLINE BucketCode encode_bucket(const float* x, int64_t len, int bits) {
  constexpr int kVecs = 4;
  const f32x4 pos_inf = f32x4{} + std::numeric_limits<float>::infinity();  // broadcast
  f32x4 lo[kVecs], hi[kVecs], probe[kVecs];  // probe: v - v is +0 if v is finite, else NaN
  for (int j = 0; j < kVecs; ++j) {
    lo[j] = pos_inf;
    hi[j] = -pos_inf;
    probe[j] = f32x4{};
  }
  int64_t k = 0;
  for (; k + 4 * kVecs <= len; k += 4 * kVecs) {
    for (int j = 0; j < kVecs; ++j) {
      f32x4 v;
      std::memcpy(&v, x + k + 4 * j, sizeof(v));
      lo[j] = v < lo[j] ? v : lo[j];
      hi[j] = v > hi[j] ? v : hi[j];
      probe[j] += v - v;
    }
  }
  for (int j = 1; j < kVecs; ++j) {
    lo[0] = lo[j] < lo[0] ? lo[j] : lo[0];
    hi[0] = hi[j] > hi[0] ? hi[j] : hi[0];
    probe[0] += probe[j];
  }
  float mn = lo[0][0], mx = hi[0][0], probe_sum = probe[0][0];
  for (int lane = 1; lane < 4; ++lane) {
    mn = lo[0][lane] < mn ? lo[0][lane] : mn;
    mx = hi[0][lane] > mx ? hi[0][lane] : mx;
    probe_sum += probe[0][lane];
  }
  for (; k < len; ++k) {
    const float v = x[k];
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    probe_sum += v - v;
  }
  return code_of(mn, mx, probe_sum, bits);
}

// level = min(L, floor(y)) with y >= 0, computed as trunc(min(y, L)): the same integer,
// without needing a vector floor instruction.
CGX_INLINE void quantize_nearest(const float* __restrict x, int64_t len,
                                 const BucketCode& code, float max_level,
                                 uint8_t* __restrict levels) {
  const float mn = code.min, inv = code.inv_scale;
  for (int64_t k = 0; k < len; ++k) {
    float y = (x[k] - mn) * inv + 0.5f;
    y = y < max_level ? y : max_level;
    levels[k] = static_cast<uint8_t>(static_cast<int32_t>(y));
  }
}

// As quantize_nearest with u (stream_hash.h) in place of 0.5.
CGX_INLINE void quantize_stochastic(const float* __restrict x, int64_t len,
                                    const BucketCode& code, float max_level,
                                    uint32_t first_index, uint32_t key,
                                    uint8_t* __restrict levels) {
  const float mn = code.min, inv = code.inv_scale;
  for (int64_t k = 0; k < len; ++k) {
    const uint32_t h = lowbias32((first_index + static_cast<uint32_t>(k)) ^ key);
    const float u = static_cast<float>(static_cast<int32_t>(h >> 8)) * 0x1p-24f;
    float y = (x[k] - mn) * inv + u;
    y = y < max_level ? y : max_level;
    levels[k] = static_cast<uint8_t>(static_cast<int32_t>(y));
  }
}

// min + level * scale with the product and the sum each capped at FLT_MAX: rounding can
// carry either past FLT_MAX for a bucket whose range is finite, and the value must decode
// finite (within the bound). A NaN bucket stays NaN (comparisons with NaN are false).
CGX_INLINE float decode_capped(float mn, float level, float scale) {
  constexpr float kMax = std::numeric_limits<float>::max();
  float product = level * scale;
  product = product > kMax ? kMax : product;
  const float value = mn + product;
  return value > kMax ? kMax : value;
}

CGX_INLINE void dequantize(const uint8_t* __restrict levels, int64_t len, float mn, float scale,
                           float max_level, bool add, float* __restrict dst) {
  // Float rounding is monotonic, so the top level bounds every value of the bucket: only
  // a bucket whose top overflows (its range reaches FLT_MAX) needs the capped decode.
  if (std::isinf(mn + max_level * scale)) {
    for (int64_t k = 0; k < len; ++k) {
      const float value = decode_capped(mn, static_cast<float>(levels[k]), scale);
      dst[k] = add ? dst[k] + value : value;
    }
    return;
  }
  if (add) {
    for (int64_t k = 0; k < len; ++k) {
      dst[k] = dst[k] + (mn + static_cast<float>(levels[k]) * scale);
    }
  } else {
    for (int64_t k = 0; k < len; ++k) dst[k] = mn + static_cast<float>(levels[k]) * scale;
  }
}

// Meta and level sections of a buffer: bucket by bucket, chunk by chunk.
// Where `fed_back` is set, also what a receiver decodes, in the same pass (see
// compress_and_decode): decoded values into fed_back.decoded (src itself allowed: a
// bucket is scanned before any of it is written), dropped values onto fed_back.residual.
struct FedBack {
  float* decoded = nullptr;
  float* residual = nullptr;
};

// Whole buckets [0, count) of a run, `count` > 0 and the bucket a multiple of 32 values,
// rounded to nearest, by the AVX2 loops (maxmin_loops.h): each bucket's range, code and
// packed levels in two passes over its values, in L1.
void encode_whole_buckets(const QuantizerParams& params, const Layout& layout, const MaxminLoops& loops,
                          const float* src, int64_t count, uint8_t* dst) {
  const int64_t bucket = params.bucket_size;
  uint8_t* stream = dst + layout.levels_offset;
  for (int64_t b = 0; b < count; ++b) {
    const float* x = src + b * bucket;
    float mn, mx, probe;
    loops.range(x, bucket, &mn, &mx, &probe);
    const BucketCode code = code_of(mn, mx, probe, params.bits);
    const float pair[2] = {code.min, code.scale};
    std::memcpy(dst + b * sizeof(pair), pair, sizeof(pair));
    uint8_t* levels = stream + b * bucket / 8 * params.bits;
    if (code.finite) loops.nearest(x, bucket, code.min, code.inv_scale, params.bits, levels);
    else std::memset(levels, 0, static_cast<size_t>(bucket / 8 * params.bits));
  }
}

CGX_AVX2_CLONE void encode_levels(const QuantizerParams& params, const Layout& layout,
                                  const float* src, uint64_t seed, uint32_t stream_offset,
                                  uint8_t* dst, FedBack fed_back = {}) {
  const int64_t bucket = params.bucket_size;
  const MaxminLoops* loops = avx2_maxmin_loops();
  if (loops && !params.stochastic && !fed_back.decoded && !fed_back.residual && bucket % 32 == 0 &&
      layout.quantized >= bucket) {
    // Whole buckets the fast way; a shorter last one (if any) as a run of its own.
    const int64_t whole = layout.quantized / bucket;
    encode_whole_buckets(params, layout, *loops, src, whole, dst);
    if (whole * bucket == layout.quantized) return;
    const MaxminRun tail = maxmin_run(params, layout, whole * bucket, layout.quantized, whole * 2 * sizeof(float));
    return encode_levels(params, tail.layout, src + tail.first, seed, stream_offset + static_cast<uint32_t>(tail.first),
                         dst + tail.meta_offset);
  }
  const float max_level = static_cast<float>((1 << params.bits) - 1);
  const uint32_t key = stream_key(seed);
  uint8_t* meta = dst;
  uint8_t* stream = dst + layout.levels_offset;
  uint8_t levels[kChunk];

  // Bucket b spans [bucket_start, bucket_end); pieces of it are cut at chunk boundaries.
  int64_t b = 0, bucket_start = 0, bucket_end = std::min(bucket, layout.quantized);
  BucketCode code{};
  for (int64_t chunk = 0; chunk < layout.quantized; chunk += kChunk) {
    const int64_t chunk_end = std::min(chunk + kChunk, layout.quantized);
    for (int64_t i = chunk; i < chunk_end;) {
      if (i == bucket_start) {  // first piece of the bucket: scan all of it
        code = encode_bucket(src + bucket_start, bucket_end - bucket_start, params.bits);
        const float pair[2] = {code.min, code.scale};
        std::memcpy(meta + b * sizeof(pair), pair, sizeof(pair));
      }
      const int64_t end = std::min(bucket_end, chunk_end);
      uint8_t* out = levels + (i - chunk);
      if (!code.finite) {
        std::memset(out, 0, static_cast<size_t>(end - i));
      } else if (params.stochastic) {
        quantize_stochastic(src + i, end - i, code, max_level,
                            stream_offset + static_cast<uint32_t>(i), key, out);
      } else {
        quantize_nearest(src + i, end - i, code, max_level, out);
      }
      if (fed_back.decoded || fed_back.residual) {
        // What decode_levels makes of these levels, bit for bit.
        float decoded[kChunk];
        dequantize(out, end - i, code.min, code.scale, max_level, /*add=*/false, decoded);
        for (int64_t k = 0; k < end - i; ++k) {
          const float dropped = src[i + k] - decoded[k];
          if (fed_back.residual && std::isfinite(dropped)) fed_back.residual[i + k] += dropped;
          if (fed_back.decoded) fed_back.decoded[i + k] = decoded[k];
        }
      }
      i = end;
      if (i == bucket_end) {
        ++b;
        bucket_start = bucket_end;
        bucket_end += std::min(bucket, layout.quantized - bucket_end);
      }
    }
    const int64_t count = chunk_end - chunk;
    const int64_t groups = (count + 7) / 8;
    std::memset(levels + count, 0, static_cast<size_t>(groups * 8 - count));
    pack(params.bits, levels, groups, stream + chunk / 8 * params.bits);
  }
}

CGX_AVX2_CLONE void decode_levels(const QuantizerParams& params, const Layout& layout,
                                  const uint8_t* src, bool add, float* dst) {
  const int64_t bucket = params.bucket_size;
  const float max_level = static_cast<float>((1 << params.bits) - 1);
  const uint8_t* meta = src;
  const uint8_t* stream = src + layout.levels_offset;
  uint8_t levels[kChunk];

  int64_t b = 0, bucket_end = std::min(bucket, layout.quantized);
  for (int64_t chunk = 0; chunk < layout.quantized; chunk += kChunk) {
    const int64_t chunk_end = std::min(chunk + kChunk, layout.quantized);
    unpack(params.bits, stream + chunk / 8 * params.bits, (chunk_end - chunk + 7) / 8, levels);
    for (int64_t i = chunk; i < chunk_end;) {
      const int64_t end = std::min(bucket_end, chunk_end);
      float pair[2];  // (min, scale)
      std::memcpy(pair, meta + b * sizeof(pair), sizeof(pair));
      dequantize(levels + (i - chunk), end - i, pair[0], pair[1], max_level, add, dst + i);
      i = end;
      if (i == bucket_end) {
        ++b;
        bucket_end += std::min(bucket, layout.quantized - bucket_end);
      }
    }
  }
}

// ---- the work of one buffer, in parts for several threads

// A part of a maxmin buffer, `first` on a bucket: its pairs after those of the buckets before.
MaxminRun maxmin_part(const QuantizerParams& params, const Layout& layout, int64_t first, int64_t last) {
  return maxmin_run(params, layout, first, last, static_cast<size_t>(first / params.bucket_size) * 2 * sizeof(float));
}

// Parts start on a bucket and on a byte of the level stream.
int64_t part_unit(const QuantizerParams& params) { return std::lcm(params.bucket_size, int64_t{8}); }

// The levels and meta of a maxmin buffer (and fed_back), in parts.
void encode_maxmin(const QuantizerParams& params, const Layout& layout, const float* src,
                   uint64_t seed, uint32_t stream_offset, uint8_t* dst, FedBack fed_back, int threads) {
  in_parts(layout.quantized, part_unit(params), threads, [&](int64_t first, int64_t last) {
    const MaxminRun part = maxmin_part(params, layout, first, last);
    FedBack shifted{fed_back.decoded ? fed_back.decoded + first : nullptr,
                    fed_back.residual ? fed_back.residual + first : nullptr};
    encode_levels(params, part.layout, src + first, seed, stream_offset + static_cast<uint32_t>(first),
                  dst + part.meta_offset, shifted);
  });
}

void decode_maxmin(const QuantizerParams& params, const Layout& layout, const uint8_t* src, bool add,
                   float* dst, int threads) {
  in_parts(layout.quantized, part_unit(params), threads, [&](int64_t first, int64_t last) {
    const MaxminRun part = maxmin_part(params, layout, first, last);
    decode_levels(params, part.layout, src + part.meta_offset, add, dst + first);
  });
}

void decode(const QuantizerParams& params, const uint8_t* src, int64_t n, bool add, float* dst,
            int threads) {
  validate(params);
  check_count(n);
  const Layout layout = wire_layout(params, n);
  if (layout.total_bytes == 0) return;
  switch (params.scheme) {
    case Scheme::kMaxMin: decode_maxmin(params, layout, src, add, dst, threads); break;
    case Scheme::kHadamard: decode_hadamard_buffer(params, layout, src, add, dst, threads); break;
  }

  const uint8_t* raw = src + layout.raw_offset;
  float* raw_dst = dst + layout.quantized;
  const int64_t raw_count = n - layout.quantized;
  if (!add) {
    std::memcpy(raw_dst, raw, static_cast<size_t>(raw_count) * sizeof(float));
    return;
  }
  for (int64_t k = 0; k < raw_count; ++k) {
    float v;
    std::memcpy(&v, raw + k * sizeof(float), sizeof(v));
    raw_dst[k] += v;
  }
}

// The padding and the raw tail of a compressed buffer whose meta and levels are written.
void finish_compressed(const Layout& layout, const float* src, int64_t n, uint8_t* dst) {
  // Padding bytes are zero so that equal inputs give equal buffers.
  std::memset(dst + layout.meta_bytes, 0, layout.levels_offset - layout.meta_bytes);
  const size_t levels_end = layout.levels_offset + layout.levels_bytes;
  std::memset(dst + levels_end, 0, layout.raw_offset - levels_end);
  std::memcpy(dst + layout.raw_offset, src + layout.quantized,
              static_cast<size_t>(n - layout.quantized) * sizeof(float));
}

}  // namespace

namespace codec {

void encode_maxmin_run(const QuantizerParams& params, const MaxminRun& run, const float* src,
                       uint64_t seed, uint32_t stream_offset, uint8_t* dst) {
  encode_levels(params, run.layout, src + run.first, seed,
                stream_offset + static_cast<uint32_t>(run.first), dst + run.meta_offset);
}

void decode_maxmin_run(const QuantizerParams& params, const MaxminRun& run, const uint8_t* src,
                       bool add, float* dst) {
  decode_levels(params, run.layout, src + run.meta_offset, add, dst + run.first);
}

}  // namespace codec

WireLayout wire_layout(const QuantizerParams& params, int64_t n) {
  WireLayout layout;
  if (n == 0) return layout;
  const int64_t bucket = params.bucket_size;
  layout.quantized = params.skip_incomplete_buckets ? n / bucket * bucket : n;
  layout.buckets = layout.quantized / bucket + (layout.quantized % bucket != 0);
  switch (params.scheme) {
    case Scheme::kMaxMin:
      layout.meta_bytes = static_cast<size_t>(layout.buckets) * 2 * sizeof(float);
      break;
    case Scheme::kHadamard:
      layout.rotated_buckets = layout.quantized / bucket;
      layout.meta_bytes = static_cast<size_t>(layout.rotated_buckets) * sizeof(float) +
                          (layout.quantized % bucket != 0 ? 2 * sizeof(float) : 0);
      break;
  }
  layout.levels_offset = round_up16(layout.meta_bytes);
  layout.levels_bytes =
      static_cast<size_t>((layout.quantized + 7) / 8) * static_cast<size_t>(params.bits);
  layout.raw_offset = round_up16(layout.levels_offset + layout.levels_bytes);
  layout.total_bytes =
      layout.raw_offset + static_cast<size_t>(n - layout.quantized) * sizeof(float);
  return layout;
}

void validate(const QuantizerParams& params) {
  if (params.bits < 1 || params.bits > kMaxBits)
    throw std::invalid_argument("bits must be in 1.." + std::to_string(kMaxBits) + ", got " +
                                std::to_string(params.bits));
  if (params.bucket_size < 1)
    throw std::invalid_argument("bucket_size must be >= 1, got " +
                                std::to_string(params.bucket_size));
  const std::string problem = scheme_problem(params.scheme, params.bits, params.bucket_size);
  if (!problem.empty()) throw std::invalid_argument(problem);
}

size_t compressed_bytes(const QuantizerParams& params, int64_t n) {
  validate(params);
  check_count(n);
  return wire_layout(params, n).total_bytes;
}

void compress(const QuantizerParams& params, const float* src, int64_t n, uint8_t* dst,
              uint64_t seed, uint64_t stream_offset, int threads) {
  validate(params);
  check_count(n);
  const Layout layout = wire_layout(params, n);
  if (layout.total_bytes == 0) return;
  switch (params.scheme) {
    case Scheme::kMaxMin:
      encode_maxmin(params, layout, src, seed, static_cast<uint32_t>(stream_offset), dst, {}, threads);
      break;
    case Scheme::kHadamard:
      encode_hadamard_buffer(params, layout, src, seed, static_cast<uint32_t>(stream_offset), dst, threads);
      break;
  }
  finish_compressed(layout, src, n, dst);
}

void compress_and_decode(const QuantizerParams& params, float* values, int64_t n, uint8_t* dst,
                         uint64_t seed, uint64_t stream_offset, float* residual,
                         bool decode_in_place, int threads) {
  if (!rule_of(params.scheme).fused_compress_and_decode)
    throw std::invalid_argument(std::string("compress_and_decode: not in one pass in the ") +
                                scheme_name(params.scheme) + " scheme");
  validate(params);
  check_count(n);
  const Layout layout = wire_layout(params, n);
  if (layout.total_bytes == 0) return;
  encode_maxmin(params, layout, values, seed, static_cast<uint32_t>(stream_offset), dst,
                {decode_in_place ? values : nullptr, residual}, threads);
  finish_compressed(layout, values, n, dst);  // the raw tail decodes to itself, drops nothing
}

void decompress(const QuantizerParams& params, const uint8_t* src, int64_t n, float* dst, int threads) {
  decode(params, src, n, /*add=*/false, dst, threads);
}

void decompress_add(const QuantizerParams& params, const uint8_t* src, int64_t n, float* dst,
                    int threads) {
  decode(params, src, n, /*add=*/true, dst, threads);
}

}  // namespace cgx::compression
