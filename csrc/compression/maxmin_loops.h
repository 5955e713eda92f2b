// The maxmin scheme's per-bucket loops in AVX2, written with intrinsics, for whole buckets
// of a multiple of 32 values rounded to nearest (quantizer.cpp's fast walk). The scalar
// walk in quantizer.cpp is the reference: min, max and the finiteness probe do not depend
// on the order they are taken in (quantizer.cpp makes both zeros +0), and the rounding is
// the same operations per value (no FMA), so both write the same bits;
// tests/cpp/test_quantizer.cpp compares them.
#pragma once

#include <cstdint>

namespace cgx::compression {

struct MaxminLoops {
  // The smallest and the largest of x[0, n) and the sum of x[k] - x[k] over them (+0, or
  // NaN where a value is NaN or infinite); n a multiple of 32.
  void (*range)(const float* x, int64_t n, float* lo, float* hi, float* probe);
  // Levels trunc(min((x[k] - min) * inv + 0.5, 2^bits - 1)) of x[0, n), packed into
  // n / 8 * bits bytes at `stream` (level_stream.h's pack); n a multiple of 32, bits 1..8,
  // every (x[k] - min) * inv finite and >= 0.
  void (*nearest)(const float* x, int64_t n, float min, float inv, int bits, uint8_t* stream);
};

// The AVX2 loops, or nullptr where this build or this CPU has no AVX2.
const MaxminLoops* avx2_maxmin_loops();

}  // namespace cgx::compression
