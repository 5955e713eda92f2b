#include "compression/rotated_loops.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "compression/level_stream.h"
#include "compression/packed_levels_avx2.h"
#include "compression/rotation.h"

namespace cgx::compression {
namespace {

// ---- portable

bool rotate_portable(const float* src, const float* signs, int64_t n, float* y) {
  int in_range = 1;
  for (int64_t k = 0; k < n; ++k) in_range &= std::fabs(src[k]) < kMaxRotatedMagnitude;
  if (in_range) rotate(src, y, n, signs);
  return in_range;
}

double sum_of_squares(const float* y, int64_t n) {
  double lanes[4] = {0, 0, 0, 0};
  for (int64_t k = 0; k < n; k += 4)
    for (int l = 0; l < 4; ++l) lanes[l] += static_cast<double>(y[k + l]) * y[k + l];
  return (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
}

void sums_of_squares_portable(const float* y, int64_t n, int count, double* sums) {
  for (int b = 0; b < count; ++b) sums[b] = sum_of_squares(y + b * n, n);
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

// Levels of 64 values at a time, then packed (level_stream.h).
void nearest_portable(const float* y, int64_t n, float inv, const GaussianLevels& t, int bits,
                      uint8_t* stream) {
  uint8_t levels[64];
  for (int64_t k = 0; k < n; k += 64) {
    const int64_t len = std::min<int64_t>(64, n - k);
    switch (bits) {
      case 1: nearest_of_width<1>(y + k, len, inv, t, levels); break;
      case 2: nearest_of_width<2>(y + k, len, inv, t, levels); break;
      case 3: nearest_of_width<3>(y + k, len, inv, t, levels); break;
      default: nearest_of_width<4>(y + k, len, inv, t, levels);
    }
    codec::pack(bits, levels, len / 8, stream + k / 8 * bits);
  }
}

void unrotate_portable(const uint8_t* stream, int bits, const float* scaled, const float* signs, int64_t n,
                       float* scratch, bool add, float* out) {
  for (int64_t k = 0; k < n; k += 8) {
    uint8_t levels[8];
    codec::unpack(bits, stream + k / 8 * bits, 1, levels);
    for (int j = 0; j < 8; ++j) scratch[k + j] = scaled[levels[j]];
  }
  unrotate(scratch, n, signs, add, out);
}

// ---- AVX2

#ifdef CGX_HAS_AVX2_LOOPS
using avx2::store_packed;

// One stage inside each 8-value register: with b the register's values swapped in pairs at
// distance h, lanes whose partner is above them take b + a and the others b - a, the
// scalar stage's a + b and a - b for that pair: one fused multiply-add by +-1 (the product
// exact, the sum rounded once, as the scalar addition or subtraction is).
CGX_AVX2 inline __m256 stage_in_register(__m256 a, __m256 b, __m256 sign) {
  return _mm256_fmadd_ps(a, sign, b);
}

CGX_AVX2 inline __m256 low_stages_in_register(__m256 v) {
  const __m256 pairs = _mm256_setr_ps(1, -1, 1, -1, 1, -1, 1, -1);
  const __m256 quads = _mm256_setr_ps(1, 1, -1, -1, 1, 1, -1, -1);
  const __m256 halves = _mm256_setr_ps(1, 1, 1, 1, -1, -1, -1, -1);
  v = stage_in_register(v, _mm256_permute_ps(v, 0b10110001), pairs);
  v = stage_in_register(v, _mm256_permute_ps(v, 0b01001110), quads);
  return stage_in_register(v, _mm256_permute2f128_ps(v, v, 1), halves);
}

// The stages across Count registers (1, 2, 4 or 8) in order: pairs 1, then 2, then 4
// apart. Count a constant, so that the loops unroll and v stays in registers.
template <int Count>
CGX_AVX2 inline void stages_across(__m256* v) {
#pragma GCC unroll 4
  for (int h = 1; h < Count; h *= 2)
#pragma GCC unroll 8
    for (int i = 0; i < Count; i += 2 * h)
#pragma GCC unroll 8
      for (int k = i; k < i + h; ++k) {
        const __m256 a = v[k], b = v[k + h];
        v[k] = _mm256_add_ps(a, b);
        v[k + h] = _mm256_sub_ps(a, b);
      }
}

// The stages h, 2h, ... (log2 Count of them) of x (h >= 8): each pass loads Count
// registers at distance h, makes the stages in them and gives them to `store(k, v)`.
template <int Count, typename Store>
CGX_AVX2 inline void stages_across_memory(float* x, int64_t n, int64_t h, Store& store) {
  for (int64_t i = 0; i < n; i += Count * h)
    for (int64_t k = i; k < i + h; k += 8) {
      __m256 v[Count];
      for (int j = 0; j < Count; ++j) v[j] = _mm256_loadu_ps(x + k + j * h);
      stages_across<Count>(v);
      for (int j = 0; j < Count; ++j) store(k + j * h, v[j]);
    }
}

// Registers stored back where they came from.
struct InPlace {
  float* x;
  CGX_AVX2 void operator()(int64_t k, __m256 v) const { _mm256_storeu_ps(x + k, v); }
};

// The stages h, 2h, ... n/2 of x (h >= 8, a power of two below n), three a pass where
// they can; the last pass gives its registers to `store`.
template <typename Store>
CGX_AVX2 inline void stages_from(float* x, int64_t n, int64_t h, Store& store) {
  InPlace in_place{x};
  for (; 8 * h < n; h *= 8) stages_across_memory<8>(x, n, h, in_place);
  if (8 * h == n) stages_across_memory<8>(x, n, h, store);
  else if (4 * h == n) stages_across_memory<4>(x, n, h, store);
  else stages_across_memory<2>(x, n, h, store);
}

// The first stages (h = 1 .. 4 * Count) of each 8 * Count values, whose registers
// `load(k)` gives in turn, to `store(k, v)`.
template <int Count, typename Load, typename Store>
CGX_AVX2 inline void low_stages_of(Load& load, int64_t n, Store& store) {
  for (int64_t i = 0; i < n; i += 8 * Count) {
    __m256 v[Count];
    for (int j = 0; j < Count; ++j) v[j] = low_stages_in_register(load(i + 8 * j));
    stages_across<Count>(v);
    for (int j = 0; j < Count; ++j) store(i + 8 * j, v[j]);
  }
}

// The n-point transform of the values `load` gives, its registers to `store` at the end:
// the first six stages (as far as n reaches) of each 64 values in registers (into y where
// stages remain), then the rest.
template <typename Load, typename Store>
CGX_AVX2 inline void walsh_hadamard_of(Load& load, int64_t n, float* y, Store& store) {
  InPlace in_y{y};
  switch (std::min<int64_t>(n / 8, 8)) {
    case 1: return low_stages_of<1>(load, n, store);
    case 2: return low_stages_of<2>(load, n, store);
    case 4: return low_stages_of<4>(load, n, store);
    default:
      if (n == 64) return low_stages_of<8>(load, n, store);
      low_stages_of<8>(load, n, in_y);
  }
  stages_from(y, n, 64, store);
}

// A bucket's registers as rotate reads them: signed and scaled by 1/n, noting any value
// out of range.
struct SignedInput {
  const float* src;
  const float* signs;
  __m256 inv_n, magnitude, limit;
  __m256 outside;  // all ones in a lane that met a value >= limit, or NaN
  CGX_AVX2 __m256 operator()(int64_t k) {
    const __m256 x = _mm256_loadu_ps(src + k);
    outside = _mm256_or_ps(outside, _mm256_cmp_ps(_mm256_and_ps(x, magnitude), limit, _CMP_NLT_UQ));
    return _mm256_mul_ps(x, _mm256_mul_ps(_mm256_loadu_ps(signs + k), inv_n));
  }
};

CGX_AVX2 bool rotate_avx2(const float* src, const float* signs, int64_t n, float* y) {
  SignedInput input{src, signs, _mm256_set1_ps(1.0f / static_cast<float>(n)),
                    _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)),
                    _mm256_set1_ps(kMaxRotatedMagnitude), _mm256_setzero_ps()};
  InPlace into_y{y};
  walsh_hadamard_of(input, n, y, into_y);
  return _mm256_testz_ps(input.outside, input.outside);
}

// Four buckets' chains of additions interleaved (each in its own order), so that each
// waits less on the latency of the last.
CGX_AVX2 void sums_of_squares_avx2(const float* y, int64_t n, int count, double* sums) {
  int b = 0;
  for (; b + 4 <= count; b += 4) {
    __m256d lanes[4] = {_mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd(), _mm256_setzero_pd()};
    for (int64_t k = 0; k < n; k += 4)
      for (int c = 0; c < 4; ++c) {
        const __m256d v = _mm256_cvtps_pd(_mm_loadu_ps(y + (b + c) * n + k));
        lanes[c] = _mm256_add_pd(lanes[c], _mm256_mul_pd(v, v));
      }
    for (int c = 0; c < 4; ++c) {
      alignas(32) double l[4];
      _mm256_store_pd(l, lanes[c]);
      sums[b + c] = (l[0] + l[1]) + (l[2] + l[3]);
    }
  }
  for (; b < count; ++b) sums[b] = sum_of_squares(y + b * n, n);
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

// 1..3 bits: a register's levels as the count of midpoints reached, one comparison each
// (a mask of all ones is -1).
template <int Bits>
struct ByCount {
  __m256 midpoint[(1 << Bits) - 1];
  CGX_AVX2 explicit ByCount(const GaussianLevels& t) {
    for (int j = 0; j < (1 << Bits) - 1; ++j) midpoint[j] = _mm256_set1_ps(t.midpoint[j]);
  }
  CGX_AVX2 __m256i operator()(__m256 z) const {
    __m256i level = _mm256_setzero_si256();
    for (int j = 0; j < (1 << Bits) - 1; ++j) level = _mm256_sub_epi32(level, reached(z, midpoint[j]));
    return level;
  }
};

// 4 bits: a binary search over the 15 sorted midpoints m, four comparisons instead of 15:
// with m7, then m3 or m11, then m[level + 1] (of 4), then m[level] (of 8).
struct BySearch {
  __m256 m7, m3, m11, quarter, even;
  CGX_AVX2 explicit BySearch(const GaussianLevels& t) {
    const float* m = t.midpoint;
    m7 = _mm256_set1_ps(m[7]), m3 = _mm256_set1_ps(m[3]), m11 = _mm256_set1_ps(m[11]);
    quarter = _mm256_setr_ps(m[1], m[5], m[9], m[13], 0, 0, 0, 0);
    even = _mm256_setr_ps(m[0], m[2], m[4], m[6], m[8], m[10], m[12], m[14]);
  }
  CGX_AVX2 __m256i operator()(__m256 z) const {
    const __m256i upper = reached(z, m7);
    __m256i level = _mm256_and_si256(upper, _mm256_set1_epi32(8));
    const __m256 second = _mm256_blendv_ps(m3, m11, _mm256_castsi256_ps(upper));
    level = _mm256_add_epi32(level, _mm256_and_si256(reached(z, second), _mm256_set1_epi32(4)));
    const __m256 third = _mm256_permutevar8x32_ps(quarter, _mm256_srli_epi32(level, 2));
    level = _mm256_add_epi32(level, _mm256_and_si256(reached(z, third), _mm256_set1_epi32(2)));
    const __m256 fourth = _mm256_permutevar8x32_ps(even, _mm256_srli_epi32(level, 1));
    return _mm256_sub_epi32(level, reached(z, fourth));
  }
};

// The levels of n values (a multiple of 32), each register's from `level_of`, packed.
template <int Bits, typename LevelOf>
CGX_AVX2 void nearest_packed(const float* y, int64_t n, float inv, const LevelOf& level_of, uint8_t* stream) {
  const __m256 scale = _mm256_set1_ps(inv);
  for (int64_t k = 0; k < n; k += 32) {
    __m256i level[4];
    for (int j = 0; j < 4; ++j) level[j] = level_of(_mm256_mul_ps(_mm256_loadu_ps(y + k + 8 * j), scale));
    store_packed<Bits>(level, stream + k / 8 * Bits);
  }
}

CGX_AVX2 void nearest_avx2(const float* y, int64_t n, float inv, const GaussianLevels& t, int bits,
                           uint8_t* stream) {
  if (n % 32 != 0) return nearest_portable(y, n, inv, t, bits, stream);  // buckets of 8 and 16
  switch (bits) {
    case 1: return nearest_packed<1>(y, n, inv, ByCount<1>(t), stream);
    case 2: return nearest_packed<2>(y, n, inv, ByCount<2>(t), stream);
    case 3: return nearest_packed<3>(y, n, inv, ByCount<3>(t), stream);
    default: return nearest_packed<4>(y, n, inv, BySearch(t), stream);
  }
}

// A bucket's registers as unrotate reads them from its packed levels (B bits each, B in
// 1..4: 8 levels in B bytes, level j at bit B j): each value its level's entry of the table.
template <int B>
struct LevelEntries {
  const uint8_t* stream;
  __m256 low, high;
  CGX_AVX2 __m256 operator()(int64_t k) const {
    uint32_t word = 0;
    std::memcpy(&word, stream + k / 8 * B, B);
    const __m256i shifts = _mm256_setr_epi32(0, B, 2 * B, 3 * B, 4 * B, 5 * B, 6 * B, 7 * B);
    const __m256i level = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(word)), shifts),
                                           _mm256_set1_epi32((1 << B) - 1));
    return entry_at(level, low, high);
  }
};

// Registers signed into out (added to it where `add`).
struct SignedOutput {
  const float* signs;
  float* out;
  bool add;
  CGX_AVX2 void operator()(int64_t k, __m256 v) const {
    v = _mm256_mul_ps(v, _mm256_loadu_ps(signs + k));
    _mm256_storeu_ps(out + k, add ? _mm256_add_ps(_mm256_loadu_ps(out + k), v) : v);
  }
};

template <int B>
CGX_AVX2 void unrotate_of_width(const uint8_t* stream, const float* scaled, const float* signs, int64_t n,
                                float* scratch, bool add, float* out) {
  LevelEntries<B> entries{stream, _mm256_loadu_ps(scaled), _mm256_loadu_ps(scaled + 8)};
  SignedOutput into_out{signs, out, add};
  walsh_hadamard_of(entries, n, scratch, into_out);
}

CGX_AVX2 void unrotate_avx2(const uint8_t* stream, int bits, const float* scaled, const float* signs, int64_t n,
                           float* scratch, bool add, float* out) {
  switch (bits) {
    case 1: return unrotate_of_width<1>(stream, scaled, signs, n, scratch, add, out);
    case 2: return unrotate_of_width<2>(stream, scaled, signs, n, scratch, add, out);
    case 3: return unrotate_of_width<3>(stream, scaled, signs, n, scratch, add, out);
    default: return unrotate_of_width<4>(stream, scaled, signs, n, scratch, add, out);
  }
}

#endif

}  // namespace

const RotatedLoops& portable_rotated_loops() {
  static const RotatedLoops loops{rotate_portable, sums_of_squares_portable, nearest_portable, unrotate_portable};
  return loops;
}

const RotatedLoops* avx2_rotated_loops() {
#ifdef CGX_HAS_AVX2_LOOPS
  static const RotatedLoops loops{rotate_avx2, sums_of_squares_avx2, nearest_avx2, unrotate_avx2};
  static const bool available = avx2::cpu_has_avx2();
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
