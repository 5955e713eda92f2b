// Levels packed into the level stream from AVX2 registers, as level_stream.h's pack
// writes them, for the codecs' AVX2 loops (rotated_loops.cpp, maxmin_loops.cpp). x86-64
// with GCC or Clang only; functions built for AVX2 whatever the build's baseline, called
// only where the CPU has it.
#pragma once

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CGX_HAS_AVX2_LOOPS 1
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define CGX_AVX2 __attribute__((target("avx2,fma")))

namespace cgx::compression::avx2 {

// Byte shuffle indices taking, in each 128-bit half, the low B bytes of its two 64-bit
// words to its first 2 B bytes.
template <int B>
struct LowBytes {
  alignas(32) int8_t index[32] = {};
  constexpr LowBytes() {
    for (int i = 0; i < 32; ++i) {
      const int j = i % 16;
      index[i] = static_cast<int8_t>(j < B ? j : j < 2 * B ? 8 + j - B : -1);
    }
  }
};
template <int B>
inline constexpr LowBytes<B> kLowBytes{};  // one object in every file that includes this

// One step of pack_groups in each 64-bit word: the fields under `keep` stay, the others
// move down by `shift`.
CGX_AVX2 inline __m256i fields_closer(__m256i w, uint64_t keep, int shift) {
  const __m256i kept = _mm256_set1_epi64x(static_cast<int64_t>(keep));
  return _mm256_or_si256(_mm256_and_si256(w, kept), _mm256_srli_epi64(_mm256_andnot_si256(kept, w), shift));
}

// The levels (each below 2^B, B in 1..8) of 32 values, four registers of eight, packed as
// level_stream.h's pack_groups packs them: narrowed to bytes in order, each group of 8
// compacted in its 64-bit word (fields moving from a stride of 8 bits to 16, 32, then B),
// the four words' low B bytes stored together (4 B bytes).
template <int B>
CGX_AVX2 inline void store_packed(const __m256i* level, uint8_t* out) {
  const __m256i words = _mm256_packs_epi32(level[0], level[1]);  // 0-3 1-3 | 0-7 1-7 (16-bit)
  const __m256i more = _mm256_packs_epi32(level[2], level[3]);
  __m256i w = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(words, more), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  w = fields_closer(w, 0x00FF00FF00FF00FFull, 8 - B);
  w = fields_closer(w, 0x0000FFFF0000FFFFull, 16 - 2 * B);
  w = fields_closer(w, 0x00000000FFFFFFFFull, 32 - 4 * B);
  // Each 128-bit half: its two words' low B bytes side by side, then the halves joined.
  const __m256i picked = _mm256_shuffle_epi8(w, _mm256_load_si256(reinterpret_cast<const __m256i*>(kLowBytes<B>.index)));
  if constexpr (B == 4) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(picked, _mm256_setr_epi32(0, 1, 4, 5, 0, 0, 0, 0))));
  } else if constexpr (B == 2) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out),
                     _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(picked, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0))));
  } else {
    alignas(32) uint8_t bytes[32];
    _mm256_store_si256(reinterpret_cast<__m256i*>(bytes), picked);
    std::memcpy(out, bytes, 2 * B);
    std::memcpy(out + 2 * B, bytes + 16, 2 * B);
  }
}

// Whether this CPU runs the AVX2 loops (with FMA, which rotated_loops.cpp's stages use).
inline bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

}  // namespace cgx::compression::avx2

#endif
