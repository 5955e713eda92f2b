#include "compression/rotated_loops.h"

#include "compression/rotation.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define CGX_ROTATED_AVX2 1
#include <immintrin.h>
#endif

namespace cgx::compression {
namespace {

// ---- portable

void low_stages_portable(float* x, int64_t n) {
  butterflies(x, n, 1);  // constant strides, so that the compiler vectorizes each
  butterflies(x, n, 2);
  butterflies(x, n, 4);
}

// The width a constant, so that the loop over the midpoints unrolls.
template <int Bits>
void nearest_of_width(const float* __restrict y, int64_t n, float inv, const GaussianLevels& t,
                      uint8_t* __restrict levels) {
  for (int64_t k = 0; k < n; ++k) {
    const float z = y[k] * inv;
    int level = 0;
    for (int j = 0; j < (1 << Bits) - 1; ++j) level += z >= t.midpoint[j];
    levels[k] = static_cast<uint8_t>(level);
  }
}

void nearest_portable(const float* y, int64_t n, float inv, const GaussianLevels& t, int bits,
                      uint8_t* levels) {
  switch (bits) {
    case 1: return nearest_of_width<1>(y, n, inv, t, levels);
    case 2: return nearest_of_width<2>(y, n, inv, t, levels);
    case 3: return nearest_of_width<3>(y, n, inv, t, levels);
    default: return nearest_of_width<4>(y, n, inv, t, levels);
  }
}

void lookup_portable(const uint8_t* __restrict levels, int64_t n, const float* __restrict scaled,
                     float* __restrict y) {
  for (int64_t k = 0; k < n; ++k) y[k] = scaled[levels[k]];
}

// ---- AVX2

#ifdef CGX_ROTATED_AVX2
#define CGX_AVX2 __attribute__((target("avx2")))

// One stage inside each 8-value register: with b the register's values swapped in pairs at
// distance h, lanes whose partner is above them keep a + b and the others take b - a, which
// is the scalar stage's a - b for that pair (a + b is the same sum either way round).
template <int Mask>
CGX_AVX2 inline __m256 stage_in_register(__m256 a, __m256 b) {
  return _mm256_blend_ps(_mm256_add_ps(a, b), _mm256_sub_ps(b, a), Mask);
}

CGX_AVX2 void low_stages_avx2(float* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 8) {
    __m256 v = _mm256_loadu_ps(x + i);
    v = stage_in_register<0b10101010>(v, _mm256_permute_ps(v, 0b10110001));
    v = stage_in_register<0b11001100>(v, _mm256_permute_ps(v, 0b01001110));
    v = stage_in_register<0b11110000>(v, _mm256_permute2f128_ps(v, v, 1));
    _mm256_storeu_ps(x + i, v);
  }
}

// Entry j of a 16-entry table held as its entries 0..7 and 8..15, for each lane's j < 16.
CGX_AVX2 inline __m256 entry_at(__m256i j, __m256 low, __m256 high) {
  const __m256 from_low = _mm256_permutevar8x32_ps(low, j);  // uses j mod 8
  const __m256 from_high = _mm256_permutevar8x32_ps(high, j);
  const __m256i above = _mm256_cmpgt_epi32(j, _mm256_set1_epi32(7));
  return _mm256_blendv_ps(from_low, from_high, _mm256_castsi256_ps(above));
}

// All ones where z >= threshold (false for NaN, as the scalar comparison).
CGX_AVX2 inline __m256i reached(__m256 z, __m256 threshold) {
  return _mm256_castps_si256(_mm256_cmp_ps(z, threshold, _CMP_GE_OQ));
}

CGX_AVX2 inline void store_levels(__m256i level, uint8_t* out) {
  const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(level), _mm256_extracti128_si256(level, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm_packus_epi16(words, words));
}

// 1..3 bits: count the midpoints reached, one comparison each (a mask of all ones is -1).
template <int Bits>
CGX_AVX2 void nearest_by_count(const float* y, int64_t n, float inv, const GaussianLevels& t,
                               uint8_t* levels) {
  __m256 midpoint[(1 << Bits) - 1];
  for (int j = 0; j < (1 << Bits) - 1; ++j) midpoint[j] = _mm256_set1_ps(t.midpoint[j]);
  const __m256 scale = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_loadu_ps(y + k), scale);
    __m256i level = _mm256_setzero_si256();
    for (int j = 0; j < (1 << Bits) - 1; ++j) level = _mm256_sub_epi32(level, reached(z, midpoint[j]));
    store_levels(level, levels + k);
  }
}

// 4 bits: a binary search over the 15 sorted midpoints m, four comparisons instead of 15:
// with m7, then m3 or m11, then m[level + 1] (of 4), then m[level] (of 8).
CGX_AVX2 void nearest_by_search(const float* y, int64_t n, float inv, const GaussianLevels& t,
                                uint8_t* levels) {
  const float* m = t.midpoint;
  const __m256 m7 = _mm256_set1_ps(m[7]), m3 = _mm256_set1_ps(m[3]), m11 = _mm256_set1_ps(m[11]);
  const __m256 quarter = _mm256_setr_ps(m[1], m[5], m[9], m[13], 0, 0, 0, 0);
  const __m256 even = _mm256_setr_ps(m[0], m[2], m[4], m[6], m[8], m[10], m[12], m[14]);
  const __m256 scale = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256 z = _mm256_mul_ps(_mm256_loadu_ps(y + k), scale);
    const __m256i upper = reached(z, m7);
    __m256i level = _mm256_and_si256(upper, _mm256_set1_epi32(8));
    const __m256 second = _mm256_blendv_ps(m3, m11, _mm256_castsi256_ps(upper));
    level = _mm256_add_epi32(level, _mm256_and_si256(reached(z, second), _mm256_set1_epi32(4)));
    const __m256 third = _mm256_permutevar8x32_ps(quarter, _mm256_srli_epi32(level, 2));
    level = _mm256_add_epi32(level, _mm256_and_si256(reached(z, third), _mm256_set1_epi32(2)));
    const __m256 fourth = _mm256_permutevar8x32_ps(even, _mm256_srli_epi32(level, 1));
    level = _mm256_sub_epi32(level, reached(z, fourth));
    store_levels(level, levels + k);
  }
}

CGX_AVX2 void nearest_avx2(const float* y, int64_t n, float inv, const GaussianLevels& t, int bits,
                           uint8_t* levels) {
  switch (bits) {
    case 1: return nearest_by_count<1>(y, n, inv, t, levels);
    case 2: return nearest_by_count<2>(y, n, inv, t, levels);
    case 3: return nearest_by_count<3>(y, n, inv, t, levels);
    default: return nearest_by_search(y, n, inv, t, levels);
  }
}

CGX_AVX2 void lookup_avx2(const uint8_t* levels, int64_t n, const float* scaled, float* y) {
  const __m256 low = _mm256_loadu_ps(scaled), high = _mm256_loadu_ps(scaled + 8);
  for (int64_t k = 0; k < n; k += 8) {
    const __m256i j = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(levels + k)));
    _mm256_storeu_ps(y + k, entry_at(j, low, high));
  }
}

bool cpu_has_avx2() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2");
}
#endif

}  // namespace

const RotatedLoops& portable_rotated_loops() {
  static const RotatedLoops loops{low_stages_portable, nearest_portable, lookup_portable};
  return loops;
}

const RotatedLoops* avx2_rotated_loops() {
#ifdef CGX_ROTATED_AVX2
  static const RotatedLoops loops{low_stages_avx2, nearest_avx2, lookup_avx2};
  static const bool available = cpu_has_avx2();
  return available ? &loops : nullptr;
#else
  return nullptr;
#endif
}

const RotatedLoops& rotated_loops() {
  static const RotatedLoops& loops = avx2_rotated_loops() ? *avx2_rotated_loops() : portable_rotated_loops();
  return loops;
}

}  // namespace cgx::compression
