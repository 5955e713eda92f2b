// Layouts and values shared by the codec and chunking tests.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "compression/layout_codec.h"

namespace cgx::test {

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

}  // namespace cgx::test
