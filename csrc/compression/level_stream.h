// The pieces the schemes' CPU codecs share (quantizer.cpp, hadamard_codec.cpp): the level
// stream's packing, the AVX2 clones, a buffer's work in parts over threads, and a run of
// maxmin buckets laid inside a buffer. Internal to the codec; not part of its interface.
#pragma once

#include <algorithm>
#include <cfloat>
#include <cstdint>
#include <cstring>

#include "compression/codec_threads.h"
#include "compression/quantizer.h"

// The chunk and bucket walks of both codecs are compiled twice on x86-64 glibc, for the
// SSE2 baseline and for AVX2, and picked at load time (GCC/Clang ifunc); every helper they
// call is inlined into both. AVX2 is 1.3-1.7x faster in cache (8-wide vectors, 32-bit
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

namespace cgx::compression::codec {

static_assert(FLT_EVAL_METHOD == 0,
              "float expressions must be evaluated in float (x87 excess precision changes bits)");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the wire format is little-endian and written with plain stores");

using Layout = WireLayout;

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

inline MaxminRun maxmin_run(const QuantizerParams& params, const Layout& layout, int64_t first, int64_t last,
                     size_t meta_offset) {
  MaxminRun run;
  run.first = first;
  run.meta_offset = meta_offset;
  run.layout.quantized = last - first;
  run.layout.buckets = (last - first + params.bucket_size - 1) / params.bucket_size;
  run.layout.levels_offset = layout.levels_offset + static_cast<size_t>(first / 8 * params.bits) - meta_offset;
  return run;
}

// The maxmin chunk walks over a run (quantizer.cpp): its pairs and levels from values
// src[run.first ...], and back (added onto dst where `add`).
void encode_maxmin_run(const QuantizerParams& params, const MaxminRun& run, const float* src,
                       uint64_t seed, uint32_t stream_offset, uint8_t* dst);
void decode_maxmin_run(const QuantizerParams& params, const MaxminRun& run, const uint8_t* src,
                       bool add, float* dst);

}  // namespace cgx::compression::codec
