// The hadamard scheme's three hottest per-bucket loops on the CPU (quantizer.cpp), each in
// a portable form and, on x86-64, an AVX2 form written with intrinsics, which the compiler
// does not find on its own: the three lowest butterfly stages inside 8-wide registers,
// round-to-nearest at 4 bits by a binary search over the midpoints (4 comparisons, not
// 15), and decoding through the table of levels held in two registers. Both forms do the
// same float operations on every value (sums and differences of the same pairs,
// comparisons, one multiply), so they write the same bits; tests/cpp/test_quantizer.cpp
// compares them.
#pragma once

#include <cstdint>

#include "compression/gaussian_levels.h"

namespace cgx::compression {

struct RotatedLoops {
  // The butterfly stages h = 1, 2 and 4 of rotation.h's walsh_hadamard, in order, on x[0, n)
  // (n a multiple of 8).
  void (*low_stages)(float* x, int64_t n);
  // levels[k] = how many of t's midpoints y[k] * inv reaches (0 for NaN), for `bits` in
  // 1..4 and n a multiple of 8.
  void (*nearest)(const float* y, int64_t n, float inv, const GaussianLevels& t, int bits,
                  uint8_t* levels);
  // y[k] = scaled[levels[k]] (levels below 16; n a multiple of 8).
  void (*lookup)(const uint8_t* levels, int64_t n, const float* scaled, float* y);
};

// The portable loops.
const RotatedLoops& portable_rotated_loops();
// The AVX2 loops, or nullptr where this build or this CPU has no AVX2.
const RotatedLoops* avx2_rotated_loops();
// What the codec uses: the AVX2 loops where there are, else the portable ones.
const RotatedLoops& rotated_loops();

}  // namespace cgx::compression
