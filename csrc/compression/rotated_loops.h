// The hadamard scheme's per-bucket loops on the CPU (hadamard_codec.cpp), each in a
// portable form, the reference, built from rotation.h's scalar stages, and on x86-64 an
// AVX2 form written with intrinsics, which the compiler does not find on its own. The AVX2
// rotation reads a bucket once: signs, the three butterfly stages inside an 8-wide register
// (each one multiply-add by +-1: the product is exact, so the sum is rounded once, as the
// scalar addition or subtraction is) and the next three across 8 registers in one pass
// over each 64 values, then three stages a pass, the last one writing the output; its
// sums of squares run over several buckets at once, whose chains of double additions (the
// order fixed by the wire format) are independent; 4-bit rounding is a binary search over
// the midpoints (4 comparisons, not 15) and writes the packed stream; decoding reads the
// packed levels and looks them up in the table of levels held in two registers. Both
// forms round every value's operations alike, so they write the same bits;
// tests/cpp/test_quantizer.cpp compares them.
#pragma once

#include <cstdint>

#include "compression/gaussian_levels.h"

namespace cgx::compression {

struct RotatedLoops {
  // y <- H D src / n (rotation.h's rotate), n a power of two from 8 up; `signs` from
  // rotation_signs(n). Returns whether every |src[k]| < kMaxRotatedMagnitude (false for NaN
  // too); y is unspecified where it returns false.
  bool (*rotate)(const float* src, const float* signs, int64_t n, float* y);
  // sums[b] = the sum of the squares of bucket b of `count` consecutive buckets of n values
  // at y, in double, as four lanes over k mod 4 in ascending k, then (l0 + l1) + (l2 + l3).
  void (*sums_of_squares)(const float* y, int64_t n, int count, double* sums);
  // The levels of y[k] * inv, each how many of t's midpoints it reaches (0 for NaN), for
  // `bits` in 1..4 and n a multiple of 8, packed into n / 8 * bits bytes at `stream`
  // (level_stream.h's pack).
  void (*nearest)(const float* y, int64_t n, float inv, const GaussianLevels& t, int bits,
                  uint8_t* stream);
  // out <- D H y (or out + D H y where `add`; rotation.h's unrotate) with y[k] =
  // scaled[level k], the levels packed `bits` (1..4) wide at `stream` (level_stream.h's
  // pack), using `scratch` (n floats) for y.
  void (*unrotate)(const uint8_t* stream, int bits, const float* scaled, const float* signs, int64_t n,
                   float* scratch, bool add, float* out);
};

// The portable loops.
const RotatedLoops& portable_rotated_loops();
// The AVX2 loops, or nullptr where this build or this CPU has no AVX2.
const RotatedLoops* avx2_rotated_loops();
// What the codec uses: the AVX2 loops where there are, else the portable ones.
const RotatedLoops& rotated_loops();

}  // namespace cgx::compression
