#include "compression/maxmin_loops.h"

#include "compression/packed_levels_avx2.h"

namespace cgx::compression {
namespace {

#ifdef CGX_HAS_AVX2_LOOPS

// Four registers at a time, each its own minimum, maximum and probe, joined at the end.
CGX_AVX2 void range_avx2(const float* x, int64_t n, float* lo, float* hi, float* probe) {
  __m256 low[4], high[4], sum[4];
  for (int j = 0; j < 4; ++j) {
    low[j] = _mm256_set1_ps(__builtin_inff());
    high[j] = _mm256_set1_ps(-__builtin_inff());
    sum[j] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < n; k += 32)
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(x + k + 8 * j);
      low[j] = _mm256_min_ps(v, low[j]);
      high[j] = _mm256_max_ps(v, high[j]);
      sum[j] = _mm256_add_ps(sum[j], _mm256_sub_ps(v, v));
    }
  const __m256 l = _mm256_min_ps(_mm256_min_ps(low[0], low[1]), _mm256_min_ps(low[2], low[3]));
  const __m256 h = _mm256_max_ps(_mm256_max_ps(high[0], high[1]), _mm256_max_ps(high[2], high[3]));
  const __m256 s = _mm256_add_ps(_mm256_add_ps(sum[0], sum[1]), _mm256_add_ps(sum[2], sum[3]));
  alignas(32) float ls[8], hs[8], ss[8];
  _mm256_store_ps(ls, l);
  _mm256_store_ps(hs, h);
  _mm256_store_ps(ss, s);
  float mn = ls[0], mx = hs[0], p = ss[0];
  for (int i = 1; i < 8; ++i) {
    mn = ls[i] < mn ? ls[i] : mn;
    mx = hs[i] > mx ? hs[i] : mx;
    p += ss[i];
  }
  *lo = mn, *hi = mx, *probe = p;
}

template <int B>
CGX_AVX2 void nearest_of_width(const float* x, int64_t n, float min, float inv, uint8_t* stream) {
  const __m256 low = _mm256_set1_ps(min), scale = _mm256_set1_ps(inv), half = _mm256_set1_ps(0.5f);
  const __m256 top = _mm256_set1_ps(static_cast<float>((1 << B) - 1));
  for (int64_t k = 0; k < n; k += 32) {
    __m256i level[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 v = _mm256_loadu_ps(x + k + 8 * j);
      const __m256 y = _mm256_add_ps(_mm256_mul_ps(_mm256_sub_ps(v, low), scale), half);
      level[j] = _mm256_cvttps_epi32(_mm256_min_ps(y, top));  // y < top ? y : top
    }
    avx2::store_packed<B>(level, stream + k / 8 * B);
  }
}

CGX_AVX2 void nearest_avx2(const float* x, int64_t n, float min, float inv, int bits, uint8_t* stream) {
  switch (bits) {
    case 1: return nearest_of_width<1>(x, n, min, inv, stream);
    case 2: return nearest_of_width<2>(x, n, min, inv, stream);
    case 3: return nearest_of_width<3>(x, n, min, inv, stream);
    case 4: return nearest_of_width<4>(x, n, min, inv, stream);
    case 5: return nearest_of_width<5>(x, n, min, inv, stream);
    case 6: return nearest_of_width<6>(x, n, min, inv, stream);
    case 7: return nearest_of_width<7>(x, n, min, inv, stream);
    default: return nearest_of_width<8>(x, n, min, inv, stream);
  }
}

#endif

}  // namespace

const MaxminLoops* avx2_maxmin_loops() {
#ifdef CGX_HAS_AVX2_LOOPS
  static const MaxminLoops loops{range_avx2, nearest_avx2};
  static const bool available = avx2::cpu_has_avx2();
  return available ? &loops : nullptr;
#else
  return nullptr;
#endif
}

}  // namespace cgx::compression
