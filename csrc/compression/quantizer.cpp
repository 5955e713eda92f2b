// Max-min bucket quantizer, CPU implementation. Wire format and arithmetic: quantizer.h and
// docs/wire-format.md. The CUDA codec reproduces every floating-point operation here, so:
//   - build with -ffp-contract=off: a fused multiply-add would change decoded bits;
//   - keep each formula in the order written (no reassociation, no fast-math).
//
// Structure: values are processed in chunks of kChunk (a multiple of 8, so chunks start on
// whole bytes of the level stream). Within a chunk, each bucket is scanned for min/max and
// then quantized while still in L1 into one byte per level; the chunk's levels are then
// packed into the bit stream by a per-width routine. Decoding unpacks a chunk to one byte
// per level, then dequantizes it bucket by bucket. The hadamard scheme goes bucket by bucket
// instead (a rotation needs the whole bucket): rotate, quantize, pack; unpack, dequantize,
// rotate back.
#include "quantizer.h"
#include "codec_threads.h"
#include "gaussian_levels.h"
#include "rotated_loops.h"
#include "rotation.h"
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
#include <vector>

namespace cgx::compression {
namespace {

static_assert(FLT_EVAL_METHOD == 0,
              "float expressions must be evaluated in float (x87 excess precision changes bits)");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian and written with plain stores");

// Levels held unpacked at a time: 4 KiB of levels plus 16 KiB of floats stay in L1.
constexpr int64_t kChunk = 4096;
static_assert(kChunk % 8 == 0, "chunks must start on a byte boundary of the level stream");

// The two chunk walks (encode_levels, decode_levels) are compiled twice on x86-64 glibc, for
// the SSE2 baseline and for AVX2, and picked at load time (GCC/Clang ifunc); every helper
// they call is inlined into both. AVX2 is 1.3-1.7x faster in cache (8-wide vectors, 32-bit
// vector multiplies for the hash); both compute the same bits, as neither uses FMA.
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define CGX_AVX2_CLONE __attribute__((target_clones("avx2", "default")))
#endif
#endif
#ifndef CGX_AVX2_CLONE
#define CGX_AVX2_CLONE
#endif
#define CGX_INLINE inline __attribute__((always_inline))

using Layout = WireLayout;

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
  // Which zero a min/max of {-0, +0} returns depends on the scan order; +0 for both makes
  // the stored bytes independent of it (the CUDA codec scans in another order).
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

// Packs groups of 8 one-byte levels (each < 2^B) into B bytes each. First every group's
// 8-byte word is compacted in place, fields moving from a stride of 8 bits to 16, 32 and
// finally B (a loop the compiler vectorizes); then the words are stored at a stride of B
// bytes with overlapping 8-byte stores, each overwriting the previous word's unused high
// bytes. The last groups are stored exactly so that nothing past out + B * groups is
// written. `levels` is used as scratch.
template <int B>
CGX_INLINE void pack_groups(uint8_t* __restrict levels, int64_t groups,
                            uint8_t* __restrict out) {
  for (int64_t g = 0; g < groups; ++g) {
    uint64_t w;
    std::memcpy(&w, levels + 8 * g, 8);
    w = (w & 0x00FF00FF00FF00FFull) | ((w & 0xFF00FF00FF00FF00ull) >> (8 - B));
    w = (w & 0x0000FFFF0000FFFFull) | ((w & 0xFFFF0000FFFF0000ull) >> (16 - 2 * B));
    w = (w & 0x00000000FFFFFFFFull) | ((w & 0xFFFFFFFF00000000ull) >> (32 - 4 * B));
    std::memcpy(levels + 8 * g, &w, 8);
  }
  const int64_t wide_groups = std::max<int64_t>(0, groups - (8 + B - 1) / B + 1);
  for (int64_t g = 0; g < wide_groups; ++g) std::memcpy(out + B * g, levels + 8 * g, 8);
  for (int64_t g = wide_groups; g < groups; ++g) std::memcpy(out + B * g, levels + 8 * g, B);
}

// Inverse of pack_groups: groups of B bytes back to 8 one-byte levels. Reads nothing past
// in + B * groups.
template <int B>
CGX_INLINE void unpack_groups(const uint8_t* __restrict in, int64_t groups,
                              uint8_t* __restrict levels) {
  constexpr uint64_t field1 = (1ull << B) - 1;
  constexpr uint64_t field2 = (1ull << 2 * B) - 1;
  constexpr uint64_t field4 = (1ull << 4 * B) - 1;
  const int64_t wide_groups = std::max<int64_t>(0, groups - (8 + B - 1) / B + 1);
  for (int64_t g = 0; g < wide_groups; ++g) std::memcpy(levels + 8 * g, in + B * g, 8);
  for (int64_t g = wide_groups; g < groups; ++g) {
    std::memset(levels + 8 * g, 0, 8);
    std::memcpy(levels + 8 * g, in + B * g, B);
  }
  for (int64_t g = 0; g < groups; ++g) {
    uint64_t w;
    std::memcpy(&w, levels + 8 * g, 8);
    w = (w & field4) | ((w << (32 - 4 * B)) & (field4 << 32));
    w = (w & (field2 * 0x0000000100000001ull)) | ((w << (16 - 2 * B)) & 0xFFFF0000FFFF0000ull);
    w = (w & (field1 * 0x0001000100010001ull)) | ((w << (8 - B)) & 0xFF00FF00FF00FF00ull);
    std::memcpy(levels + 8 * g, &w, 8);
  }
}

CGX_INLINE void pack(int bits, uint8_t* levels, int64_t groups, uint8_t* out) {
  switch (bits) {
    case 1: return pack_groups<1>(levels, groups, out);
    case 2: return pack_groups<2>(levels, groups, out);
    case 3: return pack_groups<3>(levels, groups, out);
    case 4: return pack_groups<4>(levels, groups, out);
    case 5: return pack_groups<5>(levels, groups, out);
    case 6: return pack_groups<6>(levels, groups, out);
    case 7: return pack_groups<7>(levels, groups, out);
    default: return pack_groups<8>(levels, groups, out);
  }
}

CGX_INLINE void unpack(int bits, const uint8_t* in, int64_t groups, uint8_t* levels) {
  switch (bits) {
    case 1: return unpack_groups<1>(in, groups, levels);
    case 2: return unpack_groups<2>(in, groups, levels);
    case 3: return unpack_groups<3>(in, groups, levels);
    case 4: return unpack_groups<4>(in, groups, levels);
    case 5: return unpack_groups<5>(in, groups, levels);
    case 6: return unpack_groups<6>(in, groups, levels);
    case 7: return unpack_groups<7>(in, groups, levels);
    default: return unpack_groups<8>(in, groups, levels);
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

CGX_AVX2_CLONE void encode_levels(const QuantizerParams& params, const Layout& layout,
                                  const float* src, uint64_t seed, uint32_t stream_offset,
                                  uint8_t* dst, FedBack fed_back = {}) {
  const int64_t bucket = params.bucket_size;
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

// ---- the hadamard scheme

const GaussianLevels& gaussian_levels(int bits) {
  static const GaussianLevels tables[kMaxHadamardBits] = {
      gaussian_levels_of(1), gaussian_levels_of(2), gaussian_levels_of(3), gaussian_levels_of(4)};
  return tables[bits - 1];
}

// One bucket's working space on this thread: its values, its levels, the rotation's signs,
// and the loops (rotated_loops.h) this CPU runs, looked up once per buffer.
struct Scratch {
  float* values;
  uint8_t* levels;
  const float* signs;
  const RotatedLoops* loops;
};

Scratch bucket_scratch(int64_t bucket) {
  thread_local std::vector<float> values;
  thread_local std::vector<uint8_t> levels;
  values.resize(static_cast<size_t>(bucket));
  levels.resize(static_cast<size_t>(bucket));
  return {values.data(), levels.data(), rotation_signs(bucket), &rotated_loops()};
}

// Rotates one whole bucket of `src` into the scratch's values and writes its levels there;
// returns the bucket's rms, or NaN (levels all 0) for a bucket holding NaN, Inf or a
// magnitude of kMaxRotatedMagnitude or more.
CGX_INLINE float encode_rotated(const float* __restrict src, int64_t len, int bits, bool stochastic,
                                uint32_t first_index, uint32_t key, const Scratch& scratch) {
  float* __restrict y = scratch.values;
  uint8_t* __restrict levels = scratch.levels;
  const RotatedLoops& loops = *scratch.loops;
  int in_range = 1;
  for (int64_t k = 0; k < len; ++k) in_range &= std::fabs(src[k]) < kMaxRotatedMagnitude;
  if (!in_range) {
    std::memset(levels, 0, static_cast<size_t>(len));
    return std::numeric_limits<float>::quiet_NaN();
  }
  rotate(src, y, len, scratch.signs, loops.low_stages);
  double lanes[4] = {0, 0, 0, 0};  // a fixed summation order: the same bits everywhere
  for (int64_t k = 0; k < len; k += 4)
    for (int l = 0; l < 4; ++l) lanes[l] += static_cast<double>(y[k + l]) * y[k + l];
  const double mean_square = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) / static_cast<double>(len);
  const float rms = static_cast<float>(std::sqrt(mean_square));
  float inv = rms > 0.0f ? 1.0f / rms : 0.0f;
  if (!std::isfinite(inv)) inv = 0.0f;

  const GaussianLevels& t = gaussian_levels(bits);
  const int top = (1 << bits) - 1;
  if (!stochastic) {
    loops.nearest(y, len, inv, t, bits, levels);
    return rms;
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
  return rms;
}

// Decodes the whole bucket whose levels are in the scratch into `out` (or adds it where
// `add`).
CGX_INLINE void decode_rotated(int64_t len, int bits, float rms, const Scratch& scratch, bool add,
                               float* __restrict out) {
  const GaussianLevels& t = gaussian_levels(bits);
  float scaled[16] = {};  // each level times rms: the product every value of it decodes to
  for (int j = 0; j < (1 << bits); ++j) scaled[j] = t.level[j] * rms;
  scratch.loops->lookup(scratch.levels, len, scaled, scratch.values);
  unrotate(scratch.values, len, scratch.signs, scratch.loops->low_stages, add, out);
}

// Values [first, last) of a buffer laid out as `layout`, quantized as maxmin, seen as a
// maxmin buffer of their own laid inside it: its (min, scale) pairs at meta_offset, its
// levels where theirs lie in the buffer's level stream (`first` on a byte of it). A
// hadamard buffer's shorter last bucket is one; so is each part of a maxmin buffer split
// over threads.
struct MaxminRun {
  Layout layout;       // relative to meta_offset
  size_t meta_offset;  // in the buffer
  int64_t first;       // its first value
};

MaxminRun maxmin_run(const QuantizerParams& params, const Layout& layout, int64_t first, int64_t last,
                     size_t meta_offset) {
  MaxminRun run;
  run.first = first;
  run.meta_offset = meta_offset;
  run.layout.quantized = last - first;
  run.layout.buckets = (last - first + params.bucket_size - 1) / params.bucket_size;
  run.layout.levels_offset = layout.levels_offset + static_cast<size_t>(first / 8 * params.bits) - meta_offset;
  return run;
}

// A hadamard buffer's shorter last bucket: its (min, scale) after the whole buckets' rms.
MaxminRun hadamard_tail(const QuantizerParams& params, const Layout& layout) {
  const int64_t first = layout.rotated_buckets * params.bucket_size;
  return maxmin_run(params, layout, first, layout.quantized,
                    static_cast<size_t>(layout.rotated_buckets) * sizeof(float));
}

// Whole buckets [first, last) of a hadamard buffer.
CGX_AVX2_CLONE void encode_hadamard(const QuantizerParams& params, const Layout& layout,
                                    const float* src, uint64_t seed, uint32_t stream_offset,
                                    uint8_t* dst, int64_t first, int64_t last) {
  const int64_t bucket = params.bucket_size;
  const uint32_t key = stream_key(seed);
  uint8_t* stream = dst + layout.levels_offset;
  const Scratch scratch = bucket_scratch(bucket);
  for (int64_t b = first; b < last; ++b) {
    const int64_t start = b * bucket;
    const float rms = encode_rotated(src + start, bucket, params.bits, params.stochastic,
                                     stream_offset + static_cast<uint32_t>(start), key, scratch);
    std::memcpy(dst + b * sizeof(float), &rms, sizeof(rms));
    pack(params.bits, scratch.levels, bucket / 8, stream + start / 8 * params.bits);
  }
}

CGX_AVX2_CLONE void decode_hadamard(const QuantizerParams& params, const Layout& layout,
                                    const uint8_t* src, bool add, float* dst, int64_t first,
                                    int64_t last) {
  const int64_t bucket = params.bucket_size;
  const uint8_t* stream = src + layout.levels_offset;
  const Scratch scratch = bucket_scratch(bucket);
  for (int64_t b = first; b < last; ++b) {
    const int64_t start = b * bucket;
    float rms;
    std::memcpy(&rms, src + b * sizeof(float), sizeof(rms));
    unpack(params.bits, stream + start / 8 * params.bits, bucket / 8, scratch.levels);
    decode_rotated(bucket, params.bits, rms, scratch, add, dst + start);
  }
}

// ---- the work of one buffer, in parts for several threads

// A part of a codec call holds at least this many values (128 KiB of float32, tens of
// microseconds of work): a smaller one would cost more to hand over than it saves.
constexpr int64_t kMinPartValues = int64_t{1} << 15;
// Parts per thread: the threads take them as they come, so that one that starts late (a
// worker waking up, a core busy for a moment) leaves its share to the others.
constexpr int64_t kPartsPerThread = 4;

// Calls part(first, last) over [0, count) cut into runs of whole `unit`s, up to `threads`
// at once; in one run on this thread where count is small.
template <typename Part>
void in_parts(int64_t count, int64_t unit, int threads, Part part) {
  const int64_t wanted = std::min<int64_t>(threads * kPartsPerThread, count / kMinPartValues);
  if (threads <= 1 || wanted <= 1) {
    part(int64_t{0}, count);
    return;
  }
  const int64_t units = (count + unit - 1) / unit;
  const int64_t per_part = (units + wanted - 1) / wanted * unit;
  const int parts = static_cast<int>((count + per_part - 1) / per_part);
  run_parts(parts, threads, [&](int k) { part(k * per_part, std::min(count, (k + 1) * per_part)); });
}

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
    encode_levels(params, tail.layout, src + tail.first, seed,
                  stream_offset + static_cast<uint32_t>(tail.first), dst + tail.meta_offset);
}

void decode_hadamard_buffer(const QuantizerParams& params, const Layout& layout, const uint8_t* src,
                            bool add, float* dst, int threads) {
  const int64_t bucket = params.bucket_size;
  in_parts(layout.rotated_buckets * bucket, bucket, threads, [&](int64_t first, int64_t last) {
    decode_hadamard(params, layout, src, add, dst, first / bucket, last / bucket);
  });
  const MaxminRun tail = hadamard_tail(params, layout);
  if (tail.layout.quantized > 0)
    decode_levels(params, tail.layout, src + tail.meta_offset, add, dst + tail.first);
}

void decode(const QuantizerParams& params, const uint8_t* src, int64_t n, bool add, float* dst,
            int threads) {
  validate(params);
  check_count(n);
  const Layout layout = wire_layout(params, n);
  if (layout.total_bytes == 0) return;
  if (params.scheme == Scheme::kHadamard)
    decode_hadamard_buffer(params, layout, src, add, dst, threads);
  else
    decode_maxmin(params, layout, src, add, dst, threads);

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

WireLayout wire_layout(const QuantizerParams& params, int64_t n) {
  WireLayout layout;
  if (n == 0) return layout;
  const int64_t bucket = params.bucket_size;
  layout.quantized = params.skip_incomplete_buckets ? n / bucket * bucket : n;
  layout.buckets = layout.quantized / bucket + (layout.quantized % bucket != 0);
  if (params.scheme == Scheme::kHadamard) {
    layout.rotated_buckets = layout.quantized / bucket;
    layout.meta_bytes = static_cast<size_t>(layout.rotated_buckets) * sizeof(float) +
                        (layout.quantized % bucket != 0 ? 2 * sizeof(float) : 0);
  } else {
    layout.meta_bytes = static_cast<size_t>(layout.buckets) * 2 * sizeof(float);
  }
  layout.levels_offset = round_up16(layout.meta_bytes);
  layout.levels_bytes =
      static_cast<size_t>((layout.quantized + 7) / 8) * static_cast<size_t>(params.bits);
  layout.raw_offset = round_up16(layout.levels_offset + layout.levels_bytes);
  layout.total_bytes =
      layout.raw_offset + static_cast<size_t>(n - layout.quantized) * sizeof(float);
  return layout;
}

Scheme scheme_from_name(const std::string& name) {
  std::string known;
  for (size_t i = 0; i < std::size(kSchemeNames); ++i) {
    if (name == kSchemeNames[i]) return static_cast<Scheme>(i);
    known += (i ? " or '" : "'") + std::string(kSchemeNames[i]) + "'";
  }
  throw std::invalid_argument("scheme must be " + known + ", got '" + name + "'");
}

bool hadamard_fits(int bits, int64_t bucket_size) {
  return bits >= 1 && bits <= kMaxHadamardBits && bucket_size >= 8 &&
         bucket_size <= kMaxHadamardBucket && (bucket_size & (bucket_size - 1)) == 0;
}

void validate(const QuantizerParams& params) {
  if (params.bits < 1 || params.bits > kMaxBits)
    throw std::invalid_argument("bits must be in 1.." + std::to_string(kMaxBits) + ", got " +
                                std::to_string(params.bits));
  if (params.bucket_size < 1)
    throw std::invalid_argument("bucket_size must be >= 1, got " +
                                std::to_string(params.bucket_size));
  if (params.scheme == Scheme::kHadamard && !hadamard_fits(params.bits, params.bucket_size)) {
    if (params.bits > kMaxHadamardBits)
      throw std::invalid_argument("the hadamard scheme quantizes to 1.." +
                                  std::to_string(kMaxHadamardBits) + " bits, got " +
                                  std::to_string(params.bits));
    throw std::invalid_argument(
        "the hadamard scheme needs a bucket_size that is a power of two in 8.." +
        std::to_string(kMaxHadamardBucket) + ", got " + std::to_string(params.bucket_size));
  } else if (params.scheme != Scheme::kMaxMin && params.scheme != Scheme::kHadamard) {
    throw std::invalid_argument("unknown quantizer scheme " +
                                std::to_string(static_cast<int>(params.scheme)));
  }
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
  if (params.scheme == Scheme::kHadamard)
    encode_hadamard_buffer(params, layout, src, seed, static_cast<uint32_t>(stream_offset), dst, threads);
  else
    encode_maxmin(params, layout, src, seed, static_cast<uint32_t>(stream_offset), dst, {}, threads);
  finish_compressed(layout, src, n, dst);
}

void compress_and_decode(const QuantizerParams& params, float* values, int64_t n, uint8_t* dst,
                         uint64_t seed, uint64_t stream_offset, float* residual,
                         bool decode_in_place, int threads) {
  if (params.scheme != Scheme::kMaxMin)
    throw std::invalid_argument("compress_and_decode: the maxmin scheme only");
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
