// Layouts, values and the quantizer's bound, shared by the core tests.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "compression/layout_codec.h"

namespace cgx::test {

// Equal to the bit: the same length and the same bytes.
inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

inline compression::Segment quantized(int64_t numel, int bits, int64_t bucket,
                                      bool skip_incomplete = false, bool stochastic = false) {
  compression::Segment s;
  s.numel = numel;
  s.params.bits = bits;
  s.params.bucket_size = bucket;
  s.params.skip_incomplete_buckets = skip_incomplete;
  s.params.stochastic = stochastic;
  return s;
}

inline compression::Segment raw(int64_t numel) {
  compression::Segment s;
  s.numel = numel;
  s.raw = true;
  return s;
}

// Segments laid end to end (their offsets filled in).
inline compression::LayoutCodec layout(std::vector<compression::Segment> segments) {
  int64_t offset = 0;
  for (auto& s : segments) {
    s.offset = offset;
    offset += s.numel;
  }
  return compression::LayoutCodec(std::move(segments), offset);
}

// A DDP-bucket-like layout: layers of odd sizes, bucket sizes and bit widths, raw layers,
// an empty one, one whose incomplete last bucket travels raw.
inline compression::LayoutCodec mixed_layout() {
  return layout({quantized(1000, 4, 64), raw(37), quantized(5000, 8, 512), quantized(0, 2, 16),
                 quantized(333, 1, 3), quantized(2049, 3, 1024, /*skip_incomplete=*/true),
                 raw(1), quantized(777, 6, 1),
                 quantized(4096, 2, 128, false, /*stochastic=*/true)});
}

inline std::vector<float> random_values(int64_t n, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(1.0f, 3.0f);
  std::vector<float> values(static_cast<size_t>(n));
  for (auto& v : values) v = normal(generator);
  return values;
}

// The most each value of [begin, end) may move when `codec` quantizes `x` once (0 outside
// the range): 0 for raw values and the raw tail of a skip_incomplete segment, half a step
// of its bucket (a whole step with stochastic rounding) for the others, plus a few float
// roundings. Maxmin segments only.
inline std::vector<double> quantization_bounds(const compression::LayoutCodec& codec,
                                               const std::vector<float>& x, int64_t begin, int64_t end) {
  std::vector<double> bounds(x.size(), 0.0);
  for (const auto& piece : codec.pieces(begin, end)) {
    const compression::Segment& s = codec.segments()[piece.segment];
    if (s.raw) continue;
    const int64_t bucket = s.params.bucket_size;
    const int64_t n = piece.numel;
    const int64_t quantized = s.params.skip_incomplete_buckets ? n / bucket * bucket : n;
    for (int64_t b = 0; b < quantized; b += bucket) {  // buckets are laid from the piece's start
      const auto first = x.begin() + piece.begin + b;
      const auto last = x.begin() + piece.begin + std::min(b + bucket, quantized);
      const auto [lo, hi] = std::minmax_element(first, last);
      const double step = (double(*hi) - double(*lo)) / ((1 << s.params.bits) - 1);
      const double magnitude = std::max(std::fabs(*lo), std::fabs(*hi));
      const double bound = (s.params.stochastic ? step : step / 2) + 4 * 0x1p-24 * magnitude;
      std::fill(bounds.begin() + (first - x.begin()), bounds.begin() + (last - x.begin()), bound);
    }
  }
  return bounds;
}

}  // namespace cgx::test
