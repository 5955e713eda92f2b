// compression::select_places / read_places: each chunk's k largest magnitudes and their
// Elias-Fano code, against a plain sort; ties, NaN, zeros, padding; codes refused.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <random>
#include <tuple>
#include <vector>

#include "check.h"
#include "compression/chunk_places.h"

namespace cgx::test {
namespace {

using compression::ChunkPlaces;

// The expected places of one chunk: a stable sort by magnitude, descending, NaN first.
std::vector<int64_t> sorted_places(const std::vector<float>& chunk, int64_t kept) {
  std::vector<int64_t> order(chunk.size());
  std::iota(order.begin(), order.end(), 0);
  auto magnitude = [&](int64_t i) {
    return std::isnan(chunk[i]) ? std::numeric_limits<float>::infinity() * 2 : std::fabs(chunk[i]);
  };
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    const bool nan_a = std::isnan(chunk[a]), nan_b = std::isnan(chunk[b]);
    if (nan_a != nan_b) return nan_a;
    return magnitude(a) > magnitude(b);
  });
  order.resize(kept);
  std::sort(order.begin(), order.end());
  return order;
}

void check_selection(const std::vector<float>& values, int64_t chunk, int64_t k) {
  const int64_t numel = static_cast<int64_t>(values.size());
  const ChunkPlaces shape = ChunkPlaces::of(numel, chunk, k);
  const int64_t width = shape.width, kept = shape.kept;
  std::vector<uint8_t> code(shape.code_bytes());
  std::vector<float> kept_values(shape.rows * kept);
  std::vector<int64_t> places(shape.rows * kept), read(shape.rows * kept);
  compression::select_places(values.data(), numel, shape, code.data(), kept_values.data(), places.data());
  for (int64_t row = 0; row < shape.rows; ++row) {
    std::vector<float> chunk(width, 0.0f);
    for (int64_t i = 0; i < width && row * width + i < numel; ++i) chunk[i] = values[row * width + i];
    const auto expected = sorted_places(chunk, kept);
    for (int64_t j = 0; j < kept; ++j) {
      CHECK_EQ(places[row * kept + j], expected[j]);
      const float want = chunk[expected[j]], got = kept_values[row * kept + j];
      CHECK(std::isnan(want) ? std::isnan(got) : got == want);
    }
  }
  CHECK(compression::read_places(code.data(), shape, read.data()));
  CHECK(read == places);
}

CGX_TEST(chunk_places_of_a_layer_takes_one_chunk_where_the_layer_is_smaller) {
  const ChunkPlaces layer = ChunkPlaces::of(5000, 1024, 32);
  CHECK(layer.rows == 5 && layer.width == 1024 && layer.kept == 32 && layer.low_bits == 5);
  const ChunkPlaces small = ChunkPlaces::of(20, 1024, 32);
  CHECK(small.rows == 1 && small.width == 20 && small.kept == 20 && small.low_bits == 0);
  CHECK(ChunkPlaces::of(999, 1000, 3).low_bits == 8);  // floor(log2(333))
}

CGX_TEST(select_places_takes_each_chunks_largest_magnitudes_in_place_order) {
  std::mt19937 generator(5);
  std::normal_distribution<float> normal;
  for (auto [numel, width, kept] : {std::tuple<int64_t, int64_t, int64_t>{5000, 1024, 32}, {3000, 7, 7},
                                    {1000, 7, 1}, {1999, 1000, 3}, {4096, 256, 200}, {1, 1, 1}}) {
    std::vector<float> values(numel);
    for (auto& v : values) v = normal(generator);
    check_selection(values, width, kept);
  }
}

CGX_TEST(select_places_breaks_ties_first_first_and_ranks_nan_above_infinity) {
  std::vector<float> ties(2048, 0.5f);  // every magnitude equal, signs mixed
  for (size_t i = 0; i < ties.size(); i += 3) ties[i] = -0.5f;
  check_selection(ties, 1024, 32);
  check_selection(std::vector<float>(3000, 0.0f), 1024, 32);  // all zeros (and padding)
  std::vector<float> odd(1024, 1.0f);
  odd[700] = std::numeric_limits<float>::quiet_NaN();
  odd[9] = -std::numeric_limits<float>::infinity();
  odd[500] = 2.0f;
  check_selection(odd, 1024, 4);
}

CGX_TEST(read_places_refuses_a_code_with_a_place_too_many_too_few_or_past_the_chunk) {
  std::vector<float> values(2048);
  std::iota(values.begin(), values.end(), 1.0f);
  const ChunkPlaces shape = ChunkPlaces::of(2048, 1024, 32);
  std::vector<uint8_t> code(shape.code_bytes());
  std::vector<float> kept(64);
  std::vector<int64_t> places(64);
  compression::select_places(values.data(), 2048, shape, code.data(), kept.data(), places.data());
  CHECK(compression::read_places(code.data(), shape, places.data()));
  for (int64_t flip = 0; flip < shape.high_width() * 2; ++flip) {  // each bit of the unary parts
    auto broken = code;
    const int64_t at = shape.low_bytes() * 8 + flip;
    broken[at >> 3] ^= static_cast<uint8_t>(1u << (at & 7));
    CHECK(!compression::read_places(broken.data(), shape, places.data()));
  }
}

CGX_TEST(read_places_on_random_bytes_refuses_or_gives_ascending_places_in_the_chunk) {
  std::mt19937 generator(9);
  for (auto [rows, width, kept] : {std::tuple<int64_t, int64_t, int64_t>{3, 1024, 32}, {5, 7, 7}, {4, 100, 1}}) {
    const ChunkPlaces shape = ChunkPlaces::of(rows * width, width, kept);
    std::vector<uint8_t> code(shape.code_bytes());
    std::vector<int64_t> places(rows * kept);
    int read = 0;
    for (int trial = 0; trial < 2000; ++trial) {
      for (auto& byte : code) byte = static_cast<uint8_t>(generator());
      if (!compression::read_places(code.data(), shape, places.data())) continue;
      ++read;
      for (int64_t row = 0; row < rows; ++row) {
        for (int64_t j = 0; j < kept; ++j) {
          const int64_t place = places[row * kept + j];
          CHECK(place >= 0 && place < width);
          CHECK(j == 0 || place > places[row * kept + j - 1]);
        }
      }
    }
    CHECK(read < 2000);  // random bytes are mostly refused
  }
}

}  // namespace
}  // namespace cgx::test
