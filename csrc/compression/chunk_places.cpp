#include "compression/chunk_places.h"

#include <algorithm>
#include <bit>
#include <cstring>
#include <vector>

namespace cgx::compression {
namespace {

// A float's magnitude as an integer of the same order (NaN above infinity).
uint32_t magnitude_key(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits & 0x7fffffffu;
}

void set_bit(uint8_t* bytes, int64_t at) { bytes[at >> 3] |= static_cast<uint8_t>(1u << (at & 7)); }

// `count` (at most 57) bits of `bytes` (`size` of them) from bit `at` on, the first lowest.
static_assert(std::endian::native == std::endian::little, "bits_at reads a byte stream as a little-endian word");
uint64_t bits_at(const uint8_t* bytes, int64_t size, int64_t at, int count) {
  uint64_t word = 0;
  const int64_t first = at >> 3;
  std::memcpy(&word, bytes + first, static_cast<size_t>(std::min<int64_t>(8, size - first)));
  return (word >> (at & 7)) & ((uint64_t{1} << count) - 1);
}

}  // namespace

ChunkPlaces ChunkPlaces::of(int64_t numel, int64_t chunk, int64_t k) {
  const int64_t width = std::min(chunk, numel);
  const int64_t kept = std::min(k, width);
  const int low_bits = static_cast<int>(std::bit_width(static_cast<uint64_t>(width / kept))) - 1;
  return {(numel + width - 1) / width, width, kept, low_bits};
}

void select_places(const float* values, int64_t numel, const ChunkPlaces& shape, uint8_t* code,
                   float* kept_values, int64_t* places) {
  std::memset(code, 0, shape.code_bytes());
  uint8_t* high = code + shape.low_bytes();
  const int64_t high_width = shape.high_width();
  const int64_t group = shape.width / shape.kept;  // `kept` groups, the last one longer
  std::vector<uint32_t> keys(shape.width), candidate_keys(shape.width);
  std::vector<int64_t> candidates(shape.width);
  for (int64_t row = 0; row < shape.rows; ++row) {
    const int64_t start = row * shape.width;
    const int64_t present = std::clamp<int64_t>(numel - start, 0, shape.width);
    for (int64_t i = 0; i < present; ++i) keys[i] = magnitude_key(values[start + i]);
    std::fill(keys.begin() + present, keys.end(), 0);
    // The smallest of the `kept` groups' largest keys: `kept` keys are at least it, so the
    // kept-th largest is too, and only the keys at least it are ordered. (Where a chunk
    // keeps more than an eighth, that bound passes most keys: all are ordered.)
    uint32_t bound = 0;
    for (int64_t g = 0; shape.kept * 8 <= shape.width && g < shape.kept; ++g) {
      uint32_t largest = 0;
      for (int64_t i = g * group, end = g + 1 < shape.kept ? i + group : shape.width; i < end; ++i) {
        largest = std::max(largest, keys[i]);
      }
      bound = g == 0 ? largest : std::min(bound, largest);
    }
    int64_t count = 0;
    for (int64_t i = 0; i < shape.width; ++i) {  // without a branch: few pass, at random places
      candidates[count] = i;
      candidate_keys[count] = keys[i];
      count += keys[i] >= bound;
    }
    // The kept-th largest key, then the candidates in place order: every key above it, and
    // as many equal to it, first first, as fill the chunk's `kept`.
    const auto nth = candidate_keys.begin() + (count - shape.kept);
    std::nth_element(candidate_keys.begin(), nth, candidate_keys.begin() + count);
    const uint32_t threshold = *nth;
    int64_t equal_left =
        shape.kept - std::count_if(nth + 1, candidate_keys.begin() + count, [&](uint32_t k) { return k > threshold; });
    int64_t j = 0;
    for (int64_t c = 0; c < count && j < shape.kept; ++c) {
      const int64_t i = candidates[c];
      if (keys[i] < threshold || (keys[i] == threshold && equal_left-- <= 0)) continue;
      const int64_t index = row * shape.kept + j;
      places[index] = i;
      kept_values[index] = i < present ? values[start + i] : 0.0f;
      for (int b = 0; b < shape.low_bits; ++b) {
        if ((i >> b) & 1) set_bit(code, index * shape.low_bits + b);
      }
      set_bit(high, row * high_width + (i >> shape.low_bits) + j);
      ++j;
    }
  }
}

bool read_places(const uint8_t* code, const ChunkPlaces& shape, int64_t* places) {
  const uint8_t* high = code + shape.low_bytes();
  const int64_t high_width = shape.high_width(), high_bytes = shape.high_bytes(), low_bytes = shape.low_bytes();
  constexpr int kWord = 56;  // bits read at once
  for (int64_t row = 0; row < shape.rows; ++row) {
    int64_t j = 0;
    for (int64_t q0 = 0; q0 < high_width; q0 += kWord) {
      const int count = static_cast<int>(std::min<int64_t>(kWord, high_width - q0));
      for (uint64_t word = bits_at(high, high_bytes, row * high_width + q0, count); word != 0; word &= word - 1) {
        if (j == shape.kept) return false;  // a place too many
        const int64_t index = row * shape.kept + j;
        const int64_t q = q0 + std::countr_zero(word);
        int64_t place = (q - j) << shape.low_bits;
        if (shape.low_bits > 0) {
          place |= static_cast<int64_t>(bits_at(code, low_bytes, index * shape.low_bits, shape.low_bits));
        }
        if (place >= shape.width || (j > 0 && place <= places[index - 1])) return false;
        places[index] = place;
        ++j;
      }
    }
    if (j != shape.kept) return false;  // a place too few
  }
  return true;
}

}  // namespace cgx::compression
