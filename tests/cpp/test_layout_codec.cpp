// compression::LayoutCodec: a layout of quantized and raw segments over one flat buffer.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "fixtures.h"

namespace cgx::test {
namespace {

using compression::LayoutCodec;
using compression::Segment;

size_t up16(size_t x) { return (x + 15) / 16 * 16; }

// Ranges of the mixed layout: whole, empty, within one segment, across several, unaligned.
std::vector<std::pair<int64_t, int64_t>> some_ranges(const LayoutCodec& codec) {
  std::vector<std::pair<int64_t, int64_t>> ranges = {
      {0, codec.total()}, {0, 0}, {17, 17}, {3, 900}, {990, 1050}, {1037, 6037}, {6037, 6040}};
  std::mt19937 generator(11);
  std::uniform_int_distribution<int64_t> position(0, codec.total());
  for (int i = 0; i < 20; ++i) {
    int64_t a = position(generator), b = position(generator);
    ranges.emplace_back(std::min(a, b), std::max(a, b));
  }
  return ranges;
}

CGX_TEST(layout_compressed_bytes_is_the_sum_over_its_pieces) {
  const LayoutCodec codec = mixed_layout();
  for (auto [begin, end] : some_ranges(codec)) {
    size_t expected = 0;
    int64_t next = begin;
    for (const auto& piece : codec.pieces(begin, end)) {
      const Segment& s = codec.segments()[piece.segment];
      CHECK_EQ(piece.begin, next);  // contiguous, in buffer order
      CHECK(piece.numel > 0);
      CHECK(piece.begin >= s.offset && piece.begin + piece.numel <= s.offset + s.numel);
      const size_t bytes = s.raw ? piece.numel * sizeof(float)
                                 : compression::compressed_bytes(s.params, piece.numel);
      CHECK_EQ(piece.bytes, up16(bytes));
      expected += piece.bytes;
      next += piece.numel;
    }
    CHECK_EQ(next, end);
    CHECK_EQ(codec.compressed_bytes(begin, end), expected);
  }
  CHECK_EQ(codec.compressed_bytes(5, 5), size_t{0});
}

CGX_TEST(quantizer_compressed_bytes_follows_the_documented_wire_layout) {
  // meta (8 bytes a bucket) | levels (ceil(n / 8) * bits bytes) | raw tail, 16-byte aligned.
  struct Case {
    int64_t n;
    int bits;
    int64_t bucket;
  };
  for (auto [n, bits, bucket] :
       {Case{1000, 4, 64}, Case{1, 1, 1}, Case{777, 3, 100}, Case{4096, 8, 512}}) {
    const compression::QuantizerParams params{bits, bucket, false, false};
    const size_t meta = 8 * static_cast<size_t>((n + bucket - 1) / bucket);
    const size_t levels = static_cast<size_t>((n + 7) / 8 * bits);
    CHECK_EQ(compression::compressed_bytes(params, n), up16(meta) + up16(levels));
  }
  const compression::QuantizerParams skip{4, 64, true, false};  // 960 quantized, 40 raw
  CHECK_EQ(compression::compressed_bytes(skip, 1000), up16(8 * 15) + up16(120 * 4) + 40 * 4);
  CHECK_EQ(compression::compressed_bytes(skip, 0), size_t{0});
}

// Decodes [begin, end) after a compress and checks each value: raw values and the raw
// tail of a skip_incomplete segment exactly, quantized values within half a step of their
// bucket (a whole step with stochastic rounding), plus a few float roundings.
void check_round_trip(const LayoutCodec& codec, const std::vector<float>& x, int64_t begin,
                      int64_t end) {
  std::vector<uint8_t> bytes(codec.compressed_bytes(begin, end));
  codec.compress(x.data(), begin, end, bytes.data(), 42);
  const float sentinel = 12345.0f;
  std::vector<float> y(x.size(), sentinel);
  codec.decompress(bytes.data(), begin, end, y.data());
  for (int64_t i = 0; i < static_cast<int64_t>(x.size()); ++i)
    if (i < begin || i >= end) CHECK_EQ(y[i], sentinel);  // nothing outside the range

  const std::vector<double> bounds = quantization_bounds(codec, x, begin, end);
  for (int64_t i = begin; i < end; ++i) {
    const bool exact = bounds[i] == 0 ? std::memcmp(&x[i], &y[i], sizeof(float)) == 0
                                      : std::fabs(double(y[i]) - double(x[i])) <= bounds[i];
    if (!exact)
      fail(__FILE__, __LINE__,
           "value " + std::to_string(i) + ": " + std::to_string(x[i]) + " decoded as " +
               std::to_string(y[i]) + ", bound " + std::to_string(bounds[i]));
  }
}

CGX_TEST(layout_round_trip_stays_within_the_quantizer_bound) {
  const LayoutCodec codec = mixed_layout();
  const std::vector<float> x = random_values(codec.total(), 3);
  for (auto [begin, end] : some_ranges(codec)) check_round_trip(codec, x, begin, end);
  for (int bits = 1; bits <= 8; ++bits) {
    const LayoutCodec uniform = LayoutCodec::uniform({bits, 100, false, false}, 1003);
    check_round_trip(uniform, random_values(1003, bits), 0, 1003);
  }
}

CGX_TEST(layout_decompress_add_adds_the_decoded_values) {
  const LayoutCodec codec = mixed_layout();
  const std::vector<float> x = random_values(codec.total(), 5);
  const std::vector<float> base = random_values(codec.total(), 6);
  const int64_t begin = 3, end = codec.total() - 10;
  std::vector<uint8_t> bytes(codec.compressed_bytes(begin, end));
  codec.compress(x.data(), begin, end, bytes.data(), 9);
  std::vector<float> decoded(x.size(), 0.0f), sum = base;
  codec.decompress(bytes.data(), begin, end, decoded.data());
  codec.decompress_add(bytes.data(), begin, end, sum.data());
  for (int64_t i = 0; i < codec.total(); ++i) {
    const float expected = i >= begin && i < end ? base[i] + decoded[i] : base[i];
    CHECK(std::memcmp(&sum[i], &expected, sizeof(float)) == 0);
  }
}

// compress_and_decode (the fused pass the owners and error feedback use) gives the bytes
// of compress, the residual of add_error and the values of decompress, bit for bit: every
// width, both schemes, stochastic rounding, raw layers and tails, buckets holding NaN,
// Inf or reaching FLT_MAX (the capped decode), a bucket wider than the codec's chunk, and
// ranges that cut segments.
CGX_TEST(layout_compress_and_decode_matches_its_three_calls) {
  std::vector<LayoutCodec> codecs = {mixed_layout()};
  for (int bits = 1; bits <= 8; ++bits)
    codecs.push_back(layout({quantized(700, bits, 33), quantized(9000, bits, 5000, true, true),
                             raw(5), quantized(513, bits, 512, false, bits % 2 == 0)}));
  for (int bits = 1; bits <= compression::kMaxHadamardBits; ++bits) {
    Segment s = quantized(1000, bits, 64, false, bits == 2);
    s.params.scheme = compression::Scheme::kHadamard;
    codecs.push_back(layout({s, quantized(100, 4, 16)}));
  }
  const float big = std::numeric_limits<float>::max();
  for (const LayoutCodec& codec : codecs) {
    std::vector<float> x = random_values(codec.total(), 13);
    x[40] = std::numeric_limits<float>::quiet_NaN();
    x[90] = std::numeric_limits<float>::infinity();
    x[750] = big;  // the capped decode
    x[751] = -big;
    for (auto [begin, end] : some_ranges(codec)) {
      if (!(begin == 0 && end == codec.total())) {
        // Cut where a bucket starts: a piece of a bucket is not a range a phase sends.
        begin = codec.align_up(begin);
        end = codec.align_up(end);
        if (begin > end) std::swap(begin, end);
      }
      const std::vector<float> base = random_values(codec.total(), 14);
      const size_t n = codec.compressed_bytes(begin, end);
      for (bool decode_in_place : {false, true}) {
        std::vector<uint8_t> bytes(n, 0xcd), fused_bytes(n, 0x11);
        std::vector<float> residual = base, fused_residual = base, values = x, fused = x;
        codec.compress(values.data(), begin, end, bytes.data(), 21);
        codec.add_error(bytes.data(), begin, end, values.data(), residual.data());
        if (decode_in_place) codec.decompress(bytes.data(), begin, end, values.data());
        codec.compress_and_decode(fused.data(), begin, end, fused_bytes.data(), 21,
                                  fused_residual.data(), decode_in_place);
        CHECK(bytes == fused_bytes);
        CHECK(std::memcmp(residual.data(), fused_residual.data(), base.size() * sizeof(float)) == 0);
        CHECK(std::memcmp(values.data(), fused.data(), x.size() * sizeof(float)) == 0);
        // No residual: the values alone.
        std::vector<float> alone = x;
        codec.compress_and_decode(alone.data(), begin, end, fused_bytes.data(), 21, nullptr,
                                  decode_in_place);
        CHECK(bytes == fused_bytes);
        CHECK(std::memcmp(values.data(), alone.data(), x.size() * sizeof(float)) == 0);
      }
    }
  }
}

CGX_TEST(layout_compress_is_deterministic) {
  const LayoutCodec codec = mixed_layout();  // its last segment rounds stochastically
  const std::vector<float> x = random_values(codec.total(), 8);
  const size_t n = codec.compressed_bytes(0, codec.total());
  // Prefilled differently: padding is written too, so equal inputs give equal bytes.
  std::vector<uint8_t> a(n, 0x00), b(n, 0xab), other_seed(n);
  codec.compress(x.data(), 0, codec.total(), a.data(), 1);
  codec.compress(x.data(), 0, codec.total(), b.data(), 1);
  CHECK(a == b);
  codec.compress(x.data(), 0, codec.total(), other_seed.data(), 2);
  CHECK(a != other_seed);
  // Round to nearest ignores the seed: only the stochastic segment's bytes change.
  const auto pieces = codec.pieces(0, codec.total());
  const size_t stochastic_start = n - pieces.back().bytes;
  CHECK(codec.segments()[pieces.back().segment].params.stochastic);
  CHECK(std::equal(a.begin(), a.begin() + stochastic_start, other_seed.begin()));
  CHECK(LayoutCodec::segment_seed(1, 0) != LayoutCodec::segment_seed(1, 1));
  CHECK(LayoutCodec::segment_seed(1, 0) != LayoutCodec::segment_seed(2, 0));
  CHECK_EQ(LayoutCodec::segment_seed(7, 3), LayoutCodec::segment_seed(7, 3));
}

CGX_TEST(layout_align_up_moves_to_the_next_bucket_boundary) {
  // [0, 10) buckets of 4 | [10, 13) raw | [13, 33) buckets of 8
  const LayoutCodec codec = layout({quantized(10, 4, 4), raw(3), quantized(20, 4, 8)});
  const std::vector<std::pair<int64_t, int64_t>> expected = {
      {0, 0},   {1, 4},   {4, 4},   {5, 8},   {9, 10},  {10, 10}, {11, 11}, {12, 12},
      {13, 13}, {14, 21}, {21, 21}, {22, 29}, {30, 33}, {33, 33}, {100, 33}};
  for (auto [pos, aligned] : expected) {
    if (codec.align_up(pos) != aligned)
      fail(__FILE__, __LINE__,
           "align_up(" + std::to_string(pos) + ") = " + std::to_string(codec.align_up(pos)) +
               ", expected " + std::to_string(aligned));
  }
  // An empty segment in the middle changes nothing.
  const LayoutCodec with_empty = layout({quantized(10, 4, 4), quantized(0, 4, 3), raw(3)});
  CHECK_EQ(with_empty.align_up(5), int64_t{8});
  CHECK_EQ(with_empty.align_up(10), int64_t{10});
}

CGX_TEST(layout_rejects_bad_layouts) {
  auto segment = [](int64_t offset, int64_t numel, int bits = 4, int64_t bucket = 64) {
    Segment s = quantized(numel, bits, bucket);
    s.offset = offset;
    return s;
  };
  using Segments = std::vector<Segment>;
  CHECK_THROWS(LayoutCodec(Segments{segment(1, 5)}, 6), std::invalid_argument);  // not at 0
  CHECK_THROWS(LayoutCodec(Segments{segment(0, 5), segment(6, 4)}, 10), std::invalid_argument);
  CHECK_THROWS(LayoutCodec(Segments{segment(0, 5), segment(4, 6)}, 10), std::invalid_argument);
  CHECK_THROWS(LayoutCodec(Segments{segment(0, -1)}, -1), std::invalid_argument);
  CHECK_THROWS(LayoutCodec(Segments{segment(0, 5)}, 10), std::invalid_argument);  // short
  CHECK_THROWS(LayoutCodec(Segments{segment(0, 5), segment(5, 10)}, 10), std::invalid_argument);
  CHECK_THROWS(LayoutCodec(Segments{segment(0, std::numeric_limits<int64_t>::max())}, 10),
               std::invalid_argument);
  CHECK_THROWS(LayoutCodec(Segments{}, 3), std::invalid_argument);
  CHECK_THROWS(LayoutCodec(Segments{segment(0, 10, 0)}, 10), std::invalid_argument);
  CHECK_THROWS(LayoutCodec(Segments{segment(0, 10, 9)}, 10), std::invalid_argument);
  CHECK_THROWS(LayoutCodec(Segments{segment(0, 10, 4, 0)}, 10), std::invalid_argument);
  CHECK_THROWS(LayoutCodec::uniform({4, -1, false, false}, 10), std::invalid_argument);
  // A raw segment's quantizer settings are never used.
  Segment raw_one = segment(0, 10, 0, 0);
  raw_one.raw = true;
  const LayoutCodec ok(Segments{raw_one}, 10);
  CHECK(ok.all_raw());
  CHECK_EQ(LayoutCodec(Segments{}, 0).total(), int64_t{0});
}

CGX_TEST(layout_repeated_lays_shards_end_to_end) {
  const LayoutCodec one = layout({quantized(100, 4, 16), raw(7), quantized(50, 2, 8)});
  const LayoutCodec three = LayoutCodec::repeated(one, 3);
  CHECK_EQ(three.total(), 3 * one.total());
  CHECK_EQ(three.segments().size(), size_t{9});
  for (int t = 0; t < 3; ++t) {
    for (size_t i = 0; i < one.segments().size(); ++i) {
      const Segment& s = three.segments()[t * one.segments().size() + i];
      CHECK_EQ(s.offset, one.segments()[i].offset + t * one.total());
      CHECK_EQ(s.numel, one.segments()[i].numel);
      CHECK_EQ(s.raw, one.segments()[i].raw);
    }
    CHECK_EQ(three.compressed_bytes(t * one.total(), (t + 1) * one.total()),
             one.compressed_bytes(0, one.total()));
  }
  CHECK(!three.all_raw());
}

}  // namespace
}  // namespace cgx::test
