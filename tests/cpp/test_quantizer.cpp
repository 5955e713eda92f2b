// compression/quantizer.h: the wire bytes, checked against the documented format
// (docs/wire-format.md) computed here independently.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "compression/level_stream.h"
#include "compression/maxmin_loops.h"
#include "compression/quantizer.h"
#include "compression/rotated_loops.h"
#include "compression/rotation.h"
#include "fixtures.h"

namespace cgx::test {
namespace {

using compression::QuantizerParams;

float float_at(const std::vector<uint8_t>& bytes, size_t offset) {
  float v;
  std::memcpy(&v, bytes.data() + offset, sizeof(v));
  return v;
}

// Level i of a little-endian bit stream of `bits`-bit fields.
int level_at(const uint8_t* stream, int64_t i, int bits) {
  int level = 0;
  for (int b = 0; b < bits; ++b) {
    const int64_t bit = i * bits + b;
    level |= ((stream[bit / 8] >> (bit % 8)) & 1) << b;
  }
  return level;
}

uint32_t lowbias32(uint32_t x) {  // Chris Wellons' hash, as documented
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

CGX_TEST(quantizer_known_answer) {
  // Bucket 0: {0, 1, 2, 3}, min 0, scale 1, levels 0 1 2 3. Bucket 1: {5, 7}, min 5,
  // scale 2/3, levels 0 3.
  const std::vector<float> x = {0, 1, 2, 3, 5, 7};
  const QuantizerParams params{2, 4, false, false};
  std::vector<uint8_t> bytes(compression::compressed_bytes(params, 6), 0xcd);
  CHECK_EQ(bytes.size(), size_t{32});  // meta 16 | levels 2, padded to 16
  compression::compress(params, x.data(), 6, bytes.data(), 0, 0);
  CHECK_EQ(float_at(bytes, 0), 0.0f);
  CHECK_EQ(float_at(bytes, 4), 1.0f);
  CHECK_EQ(float_at(bytes, 8), 5.0f);
  CHECK_EQ(float_at(bytes, 12), 2.0f / 3.0f);
  CHECK_EQ(int(bytes[16]), 0xe4);  // 0 | 1 << 2 | 2 << 4 | 3 << 6
  CHECK_EQ(int(bytes[17]), 0x0c);  // 0 | 3 << 2
  for (size_t i = 18; i < bytes.size(); ++i) CHECK_EQ(int(bytes[i]), 0);
  std::vector<float> y(6);
  compression::decompress(params, bytes.data(), 6, y.data());
  for (int i = 0; i < 4; ++i) CHECK_EQ(y[i], x[i]);
  CHECK_EQ(y[4], 5.0f);
  CHECK_EQ(y[5], 5.0f + 3.0f * (2.0f / 3.0f));
}

// Every level and (min, scale) pair equals the documented arithmetic: scale =
// (max - min) / (2^bits - 1), level = min(2^bits - 1, trunc((x - min) * (1 / scale) + u)),
// u = 0.5 or the stream hash of (index, seed).
void check_against_reference(const QuantizerParams& params, int64_t n, uint64_t seed) {
  const std::vector<float> x = random_values(n, static_cast<uint32_t>(n + params.bits));
  std::vector<uint8_t> bytes(compression::compressed_bytes(params, n));
  compression::compress(params, x.data(), n, bytes.data(), seed, 0);
  const auto wire = compression::wire_layout(params, n);
  const uint32_t key =
      lowbias32(static_cast<uint32_t>(seed) ^ lowbias32(static_cast<uint32_t>(seed >> 32)));
  const float max_level = static_cast<float>((1 << params.bits) - 1);
  int mismatches = 0;
  for (int64_t b = 0; b < wire.buckets; ++b) {
    const auto first = x.begin() + b * params.bucket_size;
    const auto last = x.begin() + std::min((b + 1) * params.bucket_size, wire.quantized);
    const float mn = *std::min_element(first, last) + 0.0f;  // +0, never -0
    const float mx = *std::max_element(first, last) + 0.0f;
    const float scale = (mx - mn) / max_level;
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
    CHECK_EQ(float_at(bytes, 8 * b), mn);
    CHECK_EQ(float_at(bytes, 8 * b + 4), scale);
    for (auto it = first; it != last; ++it) {
      const int64_t i = it - x.begin();
      float u = 0.5f;
      if (params.stochastic)
        u = static_cast<float>(lowbias32(static_cast<uint32_t>(i) ^ key) >> 8) * 0x1p-24f;
      const float y = std::min((*it - mn) * inv + u, max_level);
      mismatches += level_at(bytes.data() + wire.levels_offset, i, params.bits) !=
                    static_cast<int>(y);
    }
  }
  if (mismatches)
    fail(__FILE__, __LINE__,
         std::to_string(mismatches) + " levels differ from the reference (bits " +
             std::to_string(params.bits) + ", stochastic " +
             std::to_string(params.stochastic) + ")");
  CHECK(std::memcmp(bytes.data() + wire.raw_offset, x.data() + wire.quantized,
                    (n - wire.quantized) * sizeof(float)) == 0);
}

CGX_TEST(quantizer_bits_follow_the_documented_arithmetic) {
  for (int bits = 1; bits <= 8; ++bits) {
    check_against_reference({bits, 100, false, false}, 1003, 0);
    check_against_reference({bits, 100, false, true}, 1003, 0x123456789abcdefull);
    // Buckets across the codec's 4096-value chunks, and a raw tail.
    check_against_reference({bits, 100, true, true}, 9050, 5);
  }
}

CGX_TEST(quantizer_non_finite_bucket_decodes_to_nan_alone) {
  std::vector<float> x = random_values(30, 1);
  x[15] = std::numeric_limits<float>::infinity();
  const QuantizerParams params{4, 10, false, false};
  std::vector<uint8_t> bytes(compression::compressed_bytes(params, 30));
  compression::compress(params, x.data(), 30, bytes.data(), 0, 0);
  CHECK(std::isnan(float_at(bytes, 8)) && std::isnan(float_at(bytes, 12)));
  std::vector<float> y(30);
  compression::decompress(params, bytes.data(), 30, y.data());
  for (int i = 0; i < 30; ++i) CHECK_EQ(std::isnan(y[i]), i >= 10 && i < 20);
}

CGX_TEST(quantizer_constant_bucket_decodes_exactly) {
  const std::vector<float> x(100, 3.25f);
  const QuantizerParams params{3, 32, false, true};
  std::vector<uint8_t> bytes(compression::compressed_bytes(params, 100));
  compression::compress(params, x.data(), 100, bytes.data(), 77, 0);
  std::vector<float> y(100);
  compression::decompress(params, bytes.data(), 100, y.data());
  CHECK(y == x);
}

CGX_TEST(quantizer_rejects_bad_parameters) {
  CHECK_THROWS(compression::validate({0, 64, false, false}), std::invalid_argument);
  CHECK_THROWS(compression::validate({9, 64, false, false}), std::invalid_argument);
  CHECK_THROWS(compression::validate({4, 0, false, false}), std::invalid_argument);
  CHECK_THROWS(compression::compressed_bytes({4, 64, false, false}, -1), std::invalid_argument);
  compression::validate({1, 1, false, false});
  compression::validate({8, 1 << 20, true, true});
}

CGX_TEST(rotation_inverse_recovers_the_input) {
  for (int64_t n = 8; n <= compression::kMaxHadamardBucket; n *= 8) {
    const std::vector<float> x = random_values(n, static_cast<uint32_t>(n));
    std::vector<float> y(x.size()), back(x.size());
    const float* signs = compression::rotation_signs(n);
    compression::rotate(x.data(), y.data(), n, signs);
    CHECK(y != x);
    compression::unrotate(y.data(), n, signs, false, back.data());
    float worst = 0, largest = 0;
    for (int64_t i = 0; i < n; ++i) {
      worst = std::max(worst, std::fabs(back[i] - x[i]));
      largest = std::max(largest, std::fabs(x[i]));
    }
    // log2(n) roundings per butterfly path, each a half ulp of a partial sum <= max |x|.
    CHECK(worst <= 2 * std::log2(static_cast<float>(n)) * 0x1p-24f * largest);
  }
}

// Values that stress the hadamard loops: ordinary ones at many scales, exact midpoints
// and their float neighbours (where a comparison flips), zeros of both signs, NaN, Inf.
std::vector<float> loop_inputs(const compression::GaussianLevels& t, int bits, int64_t n, uint32_t seed) {
  std::vector<float> v = random_values(n, seed);
  std::vector<float> special = {0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(),
                                std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                std::numeric_limits<float>::max(), -std::numeric_limits<float>::denorm_min(), 1e30f};
  for (int j = 0; j < (1 << bits) - 1; ++j)
    for (const float m : {t.midpoint[j], std::nextafter(t.midpoint[j], -1e9f), std::nextafter(t.midpoint[j], 1e9f)})
      special.push_back(m);
  for (int64_t i = 0; i < n; ++i) {
    if (i % 3 == 0) v[static_cast<size_t>(i)] = special[static_cast<size_t>(i / 3) % special.size()];
    else v[static_cast<size_t>(i)] *= std::ldexp(1.0f, static_cast<int>(i % 11) - 5);
  }
  return v;
}

// The AVX2 loops write the portable loops' bits (rotation, its range check, sums of
// squares over 1-5 buckets, rounding, the inverse rotation with and without the add), and
// nearest counts the midpoints reached.
CGX_TEST(hadamard_avx2_loops_write_the_portable_loops_bits) {
  const compression::RotatedLoops& portable = compression::portable_rotated_loops();
  const compression::RotatedLoops* avx2 = compression::avx2_rotated_loops();
#if defined(__x86_64__)
  CHECK(avx2 != nullptr);  // every machine cgx is built and tested on has AVX2
#endif
  const compression::RotatedLoops& fast = avx2 ? *avx2 : portable;
  for (int bits = 1; bits <= compression::kMaxHadamardBits; ++bits) {
    const compression::GaussianLevels t = compression::gaussian_levels_of(bits);
    for (const int64_t n : {8, 16, 32, 64, 128, 512, 4096, 32768}) {
      const float* signs = compression::rotation_signs(n);
      const std::vector<float> in = loop_inputs(t, bits, n, static_cast<uint32_t>(n * 7 + bits));
      // In range: ordinary values at many scales (loop_inputs without its specials).
      std::vector<float> ordinary = random_values(n, static_cast<uint32_t>(n * 5 + bits));
      for (int64_t k = 0; k < n; ++k) ordinary[static_cast<size_t>(k)] *= std::ldexp(1.0f, static_cast<int>(k % 13) - 6);
      std::vector<float> ya(static_cast<size_t>(n)), yb(static_cast<size_t>(n));
      CHECK(portable.rotate(ordinary.data(), signs, n, ya.data()));
      CHECK(fast.rotate(ordinary.data(), signs, n, yb.data()));
      CHECK(same_bits(ya, yb));
      // Out of range (NaN, Inf, FLT_MAX, 1e30 among them) anywhere: both say so.
      CHECK(!portable.rotate(in.data(), signs, n, ya.data()));
      CHECK(!fast.rotate(in.data(), signs, n, yb.data()));
      for (const float outside : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity(),
                                  compression::kMaxRotatedMagnitude, -0x1p100f}) {
        std::vector<float> one = ordinary;
        one[static_cast<size_t>((n * 3) / 4 + 1) % static_cast<size_t>(n)] = outside;
        CHECK(!portable.rotate(one.data(), signs, n, ya.data()));
        CHECK(!fast.rotate(one.data(), signs, n, yb.data()));
      }
      for (int count = 1; count <= 5; ++count) {
        std::vector<float> many(static_cast<size_t>(n * count));
        for (size_t k = 0; k < many.size(); ++k) many[k] = in[k % in.size()] * static_cast<float>(1 + k / in.size());
        std::vector<double> sa(static_cast<size_t>(count)), sb(static_cast<size_t>(count));
        portable.sums_of_squares(many.data(), n, count, sa.data());
        fast.sums_of_squares(many.data(), n, count, sb.data());
        CHECK(std::memcmp(sa.data(), sb.data(), sa.size() * sizeof(double)) == 0);
      }
      for (const float inv : {1.0f, 0.0f, 0.37f, 3.0f, 1e30f}) {
        std::vector<uint8_t> sa(static_cast<size_t>(n / 8 * bits)), sb(sa.size()), lb(static_cast<size_t>(n));
        portable.nearest(in.data(), n, inv, t, bits, sa.data());
        fast.nearest(in.data(), n, inv, t, bits, sb.data());
        CHECK(sa == sb);
        compression::codec::unpack(bits, sb.data(), n / 8, lb.data());
        for (int64_t k = 0; k < n; ++k) {
          int reached = 0;
          for (int j = 0; j < (1 << bits) - 1; ++j) reached += in[static_cast<size_t>(k)] * inv >= t.midpoint[j];
          CHECK_EQ(static_cast<int>(lb[static_cast<size_t>(k)]), reached);
        }
      }
      std::vector<uint8_t> levels(static_cast<size_t>(n));
      for (int64_t k = 0; k < n; ++k) levels[static_cast<size_t>(k)] = static_cast<uint8_t>((k * 7 + k / 16) % (1 << bits));
      float scaled[16];
      for (int j = 0; j < 16; ++j) scaled[j] = ordinary[static_cast<size_t>(j % n)];
      std::vector<uint8_t> packed(static_cast<size_t>(n / 8 * bits));
      std::vector<uint8_t> scratch_levels = levels;  // pack uses its input as scratch
      compression::codec::pack(bits, scratch_levels.data(), n / 8, packed.data());
      for (const bool add : {false, true}) {
        std::vector<float> oa = ordinary, ob = ordinary, oc = ordinary, scratch(static_cast<size_t>(n));
        portable.unrotate(packed.data(), bits, scaled, signs, n, scratch.data(), add, oa.data());
        fast.unrotate(packed.data(), bits, scaled, signs, n, scratch.data(), add, ob.data());
        // The reference: each level's entry, then rotation.h's unrotate.
        for (int64_t k = 0; k < n; ++k) scratch[static_cast<size_t>(k)] = scaled[levels[static_cast<size_t>(k)]];
        compression::unrotate(scratch.data(), n, signs, add, oc.data());
        CHECK(same_bits(oa, oc));
        CHECK(same_bits(oa, ob));
        CHECK(!same_bits(oa, ordinary));
      }
    }
  }
}

// The maxmin AVX2 loops give the scalar definitions' bits: range (min, max, probe) over
// ordinary values, zeros of both signs, NaN and Inf, and rounding at every width.
CGX_TEST(maxmin_avx2_loops_write_the_scalar_bits) {
  const compression::MaxminLoops* loops = compression::avx2_maxmin_loops();
#if defined(__x86_64__)
  CHECK(loops != nullptr);
#endif
  if (loops == nullptr) return;
  for (const int64_t n : {32, 64, 96, 512, 4096}) {
    std::vector<float> x = random_values(n, static_cast<uint32_t>(n * 3));
    for (int64_t k = 0; k < n; ++k) x[static_cast<size_t>(k)] *= std::ldexp(1.0f, static_cast<int>(k % 9) - 4);
    for (const float special : {0.0f, -0.0f, std::numeric_limits<float>::quiet_NaN(),
                                std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()}) {
      std::vector<float> v = x;
      v[static_cast<size_t>(n / 3)] = special;
      float mn = v[0], mx = v[0], probe = 0;
      for (const float value : v) {
        mn = value < mn ? value : mn;
        mx = value > mx ? value : mx;
        probe += value - value;
      }
      float lo, hi, p;
      loops->range(v.data(), n, &lo, &hi, &p);
      CHECK(std::isnan(probe) == std::isnan(p));
      if (!std::isnan(probe)) CHECK(lo + 0.0f == mn + 0.0f && hi + 0.0f == mx + 0.0f && p == probe);
    }
    float mn = x[0], mx = x[0];
    for (const float value : x) mn = std::min(mn, value), mx = std::max(mx, value);
    for (int bits = 1; bits <= 8; ++bits) {
      const float top = static_cast<float>((1 << bits) - 1);
      const float inv = top / (mx - mn);
      std::vector<uint8_t> levels(static_cast<size_t>(n)), expected(static_cast<size_t>(n / 8 * bits));
      for (int64_t k = 0; k < n; ++k) {
        float y = (x[static_cast<size_t>(k)] - mn) * inv + 0.5f;
        y = y < top ? y : top;
        levels[static_cast<size_t>(k)] = static_cast<uint8_t>(static_cast<int32_t>(y));
      }
      compression::codec::pack(bits, levels.data(), n / 8, expected.data());
      std::vector<uint8_t> got(expected.size());
      loops->nearest(x.data(), n, mn, inv, bits, got.data());
      CHECK(got == expected);
    }
  }
}

CGX_TEST(hadamard_scheme_layout_and_limits) {
  QuantizerParams params{2, 512, false, false, compression::Scheme::kHadamard};
  // 1000 values: one whole bucket (4-byte rms) and a 488-value maxmin bucket (8 bytes).
  const auto layout = compression::wire_layout(params, 1000);
  CHECK_EQ(layout.rotated_buckets, int64_t{1});
  CHECK_EQ(layout.meta_bytes, size_t{12});
  CHECK_EQ(layout.levels_offset, size_t{16});
  CHECK_EQ(layout.total_bytes, size_t{16 + 256});
  params.skip_incomplete_buckets = true;  // the tail then travels raw
  CHECK_EQ(compression::wire_layout(params, 1000).meta_bytes, size_t{4});
  CHECK_THROWS(compression::validate({5, 512, false, false, compression::Scheme::kHadamard}),
               std::invalid_argument);
  CHECK_THROWS(compression::validate({2, 96, false, false, compression::Scheme::kHadamard}),
               std::invalid_argument);
  CHECK_THROWS(compression::validate({2, 1 << 17, false, false, compression::Scheme::kHadamard}),
               std::invalid_argument);
  compression::validate({4, 8, false, true, compression::Scheme::kHadamard});
}

CGX_TEST(hadamard_pieces_at_bucket_boundaries_give_the_whole_bytes) {
  // Stochastic rounding draws by stream position: two pieces at their offsets encode the
  // same levels as the whole.
  const std::vector<float> x = random_values(4096, 3);
  const QuantizerParams params{3, 256, false, true, compression::Scheme::kHadamard};
  std::vector<uint8_t> whole(compression::compressed_bytes(params, 4096));
  compression::compress(params, x.data(), 4096, whole.data(), 11, 0);
  std::vector<uint8_t> first(compression::compressed_bytes(params, 1024));
  std::vector<uint8_t> second(compression::compressed_bytes(params, 3072));
  compression::compress(params, x.data(), 1024, first.data(), 11, 0);
  compression::compress(params, x.data() + 1024, 3072, second.data(), 11, 1024);
  const auto w = compression::wire_layout(params, 4096);
  const auto a = compression::wire_layout(params, 1024);
  const auto b = compression::wire_layout(params, 3072);
  CHECK(std::equal(first.begin(), first.begin() + 16, whole.begin()));  // 4 rms
  CHECK(std::equal(second.begin(), second.begin() + 48, whole.begin() + 16));  // 12 rms
  CHECK(std::equal(first.begin() + a.levels_offset, first.begin() + a.levels_offset + a.levels_bytes,
                   whole.begin() + w.levels_offset));
  CHECK(std::equal(second.begin() + b.levels_offset, second.begin() + b.levels_offset + b.levels_bytes,
                   whole.begin() + w.levels_offset + 1024 * 3 / 8));
}

}  // namespace
}  // namespace cgx::test
