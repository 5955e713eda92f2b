// The hadamard scheme's levels (quantizer.h, docs/wire-format.md): the Lloyd-Max levels of
// a standard normal distribution for 1..4 bits (those that minimise its mean squared
// error), in units of a bucket's root mean square, with what quantizing to them compares
// against. One definition for the CPU codec and the CUDA kernels: the same float
// operations make the same bits on both (no fused multiply-add in either build).
#pragma once

#include "compression/stream_hash.h"  // CGX_HOST_DEVICE_INLINE

namespace cgx::compression {

struct GaussianLevels {
  float level[16];     // ascending; 2^bits of them
  float inv_gap[15];   // 1 / (level[k + 1] - level[k])
  float midpoint[15];  // (level[k] + level[k + 1]) / 2: round to nearest compares with these
};

// The table for `bits` in 1..4 (kMaxHadamardBits); the levels are symmetric about 0.
CGX_HOST_DEVICE_INLINE GaussianLevels gaussian_levels_of(int bits) {
  const float upper1[] = {0.7978846f};
  const float upper2[] = {0.4527800f, 1.5104176f};
  const float upper3[] = {0.2450942f, 0.7560053f, 1.3439093f, 2.1519457f};
  const float upper4[] = {0.1283950f, 0.3880483f, 0.6567591f, 0.9423405f,
                          1.2562312f, 1.6180464f, 2.0690172f, 2.7325896f};
  const float* upper = bits == 1 ? upper1 : bits == 2 ? upper2 : bits == 3 ? upper3 : upper4;
  const int half = 1 << (bits - 1);
  GaussianLevels t{};
  for (int j = 0; j < half; ++j) {
    t.level[half + j] = upper[j];
    t.level[half - 1 - j] = -upper[j];
  }
  for (int k = 0; k + 1 < 2 * half; ++k) {
    t.inv_gap[k] = 1.0f / (t.level[k + 1] - t.level[k]);
    t.midpoint[k] = (t.level[k] + t.level[k + 1]) * 0.5f;
  }
  return t;
}

}  // namespace cgx::compression
