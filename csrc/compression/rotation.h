// The randomized Hadamard rotation of one bucket, used by the hadamard scheme of the
// quantizer (quantizer.h, docs/wire-format.md): y = H D x / n, where D flips the signs of a
// fixed pseudo-random half of the positions and H is the n-point Walsh-Hadamard transform
// (n a power of two). Rotating spreads an outlier over the whole bucket, so the rotated
// values are close to normal and a few levels cover them well. Header-only: the codec's
// portable loops (rotated_loops.h) are these; the AVX2 loops and the CUDA kernels make the
// same stages in their own order of passes.
//
// The prescale by 1/n is exact (a power of two) and happens first, so no butterfly can
// overflow: every partial sum is a mean of at most n values. The butterflies run in a fixed
// order, each sum and difference rounded on its own, so every machine computes the same bits.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "compression/stream_hash.h"

namespace cgx::compression {

// Magnitudes from here up make a rotated bucket non-finite (stored as NaN): below it the
// inverse rotation of any decoded bucket stays under FLT_MAX (docs/wire-format.md).
constexpr float kMaxRotatedMagnitude = 0x1p100f;

// Position j's sign in every bucket, on every rank: -1 where bit 0 of the hash is set.
constexpr uint32_t kRotationSignKey = 0x5bd1e995u;

CGX_HOST_DEVICE_INLINE float rotation_sign(int64_t j) {
  return (lowbias32(static_cast<uint32_t>(j) ^ kRotationSignKey) & 1u) ? -1.0f : 1.0f;
}

// rotation_sign(j) for j < n, computed once per thread and bucket size.
inline const float* rotation_signs(int64_t n) {
  thread_local std::vector<float> signs;
  if (static_cast<int64_t>(signs.size()) < n) {
    const int64_t from = static_cast<int64_t>(signs.size());
    signs.resize(static_cast<size_t>(n));
    for (int64_t j = from; j < n; ++j) signs[static_cast<size_t>(j)] = rotation_sign(j);
  }
  return signs.data();
}

// One stage of butterflies: x[k], x[k + h] <- x[k] + x[k + h], x[k] - x[k + h].
CGX_HOST_DEVICE_INLINE void butterflies(float* __restrict x, int64_t n, int64_t h) {
  for (int64_t i = 0; i < n; i += 2 * h)
    for (int64_t k = i; k < i + h; ++k) {
      const float a = x[k], b = x[k + h];
      x[k] = a + b;
      x[k + h] = a - b;
    }
}

// The stages h = 8, 16, ... n/2 in turn, two at a time where it can: each pass reads four
// values at distance h and makes both stages' sums and differences of them in registers,
// the same operations as two passes of butterflies.
inline void high_stages(float* __restrict x, int64_t n) {
  int64_t h = 8;
  for (; 4 * h <= n; h *= 4)
    for (int64_t i = 0; i < n; i += 4 * h)
      for (int64_t k = i; k < i + h; ++k) {
        const float a = x[k], b = x[k + h], c = x[k + 2 * h], d = x[k + 3 * h];
        const float ab = a + b, a_b = a - b, cd = c + d, c_d = c - d;
        x[k] = ab + cd;
        x[k + h] = a_b + c_d;
        x[k + 2 * h] = ab - cd;
        x[k + 3 * h] = a_b - c_d;
      }
  if (h < n) butterflies(x, n, h);
}

// The n-point Walsh-Hadamard transform of x in place: the stages h = 1, 2, 4 (constant
// strides, so that the compiler vectorizes each), then high_stages.
inline void walsh_hadamard(float* __restrict x, int64_t n) {
  butterflies(x, n, 1);
  butterflies(x, n, 2);
  butterflies(x, n, 4);
  high_stages(x, n);
}

// x <- H D src / n; `signs` from rotation_signs(n). The reference for rotated_loops.h.
inline void rotate(const float* __restrict src, float* __restrict x, int64_t n,
                   const float* __restrict signs) {
  const float inv_n = 1.0f / static_cast<float>(n);  // exact: n is a power of two
  for (int64_t j = 0; j < n; ++j) x[j] = src[j] * (signs[j] * inv_n);
  walsh_hadamard(x, n);
}

// out <- D H y (or out + D H y where `add`), the inverse of rotate (H H = n I) up to float
// rounding; y is left rotated back but unsigned.
inline void unrotate(float* __restrict y, int64_t n, const float* __restrict signs, bool add,
                     float* __restrict out) {
  walsh_hadamard(y, n);
  if (add)
    for (int64_t j = 0; j < n; ++j) out[j] = out[j] + y[j] * signs[j];
  else
    for (int64_t j = 0; j < n; ++j) out[j] = y[j] * signs[j];
}

}  // namespace cgx::compression
