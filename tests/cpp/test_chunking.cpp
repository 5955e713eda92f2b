// collectives::Chunking: how an allreduce splits its range among the ranks.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "check.h"
#include "collectives/allreduce.h"
#include "fixtures.h"

namespace cgx::test {
namespace {

using collectives::Chunking;
using collectives::Range;
using compression::LayoutCodec;

// Whether cutting the buffer at `pos` splits a quantization bucket: `pos` lies strictly
// inside a quantized segment, off the grid of buckets laid from the segment's start.
bool splits_bucket(const LayoutCodec& codec, int64_t pos) {
  for (const auto& s : codec.segments()) {
    if (pos <= s.offset || pos >= s.offset + s.numel || s.raw) continue;
    return (pos - s.offset) % s.params.bucket_size != 0;
  }
  return false;
}

int64_t largest_bucket(const LayoutCodec& codec) {
  int64_t largest = 1;
  for (const auto& s : codec.segments())
    if (!s.raw) largest = std::max(largest, s.params.bucket_size);
  return largest;
}

// The properties every chunking of `range` into `parts` has.
void check_chunking(const LayoutCodec& codec, Range range, int parts) {
  const Chunking chunks(codec, range, parts);
  CHECK_EQ(chunks.parts(), parts);
  CHECK_EQ(chunks.offset(0), range.begin);
  CHECK_EQ(chunks.offset(parts), range.end);
  const int64_t n = range.end - range.begin;
  int64_t covered = 0;
  for (int i = 0; i < parts; ++i) {
    CHECK(chunks.length(i) >= 0);
    CHECK_EQ(chunks.range(i).begin, chunks.offset(i));
    CHECK_EQ(chunks.range(i).end, chunks.offset(i + 1));
    covered += chunks.length(i);
    if (i > 0 && chunks.offset(i) < range.end) {
      if (splits_bucket(codec, chunks.offset(i)))
        fail(__FILE__, __LINE__,
             "cut " + std::to_string(i) + " at " + std::to_string(chunks.offset(i)) +
                 " splits a bucket (range [" + std::to_string(range.begin) + ", " +
                 std::to_string(range.end) + "), " + std::to_string(parts) + " parts)");
      // About equal: each cut at most one bucket past the equal split.
      const int64_t equal = range.begin + n / parts * i + n % parts * i / parts;
      CHECK(chunks.offset(i) >= equal);
      CHECK(chunks.offset(i) < equal + largest_bucket(codec));
    }
  }
  CHECK_EQ(covered, n);
}

CGX_TEST(chunking_never_splits_a_bucket_and_covers_the_range) {
  const LayoutCodec codec = mixed_layout();
  const int64_t total = codec.total();
  const std::vector<Range> ranges = {
      {0, total}, {0, 0}, {0, 1}, {1000, 1037}, {1037, 6037}, {5, total - 3}, {6000, total}};
  for (const Range& range : ranges)
    for (int parts = 1; parts <= 9; ++parts) check_chunking(codec, range, parts);
  // More parts than buckets: some chunks are empty, none splits a bucket.
  const LayoutCodec one_bucket = LayoutCodec::uniform({4, 512, false, false}, 512);
  check_chunking(one_bucket, {0, 512}, 4);
  const Chunking chunks(one_bucket, {0, 512}, 4);
  int non_empty = 0;
  for (int i = 0; i < 4; ++i) non_empty += chunks.length(i) > 0;
  CHECK_EQ(non_empty, 1);
}

CGX_TEST(chunking_of_a_uniform_layout_cuts_on_the_bucket_grid) {
  const LayoutCodec codec = LayoutCodec::uniform({8, 100, false, false}, 1050);
  const Chunking chunks(codec, {0, 1050}, 4);
  // The equal split (262, 525, 787) moved up to the next multiple of 100.
  CHECK_EQ(chunks.offset(1), int64_t{300});
  CHECK_EQ(chunks.offset(2), int64_t{600});
  CHECK_EQ(chunks.offset(3), int64_t{800});
  CHECK_EQ(chunks.offset(4), int64_t{1050});
}

// The reason for the rule: compressing chunk by chunk decodes to the same bits as
// compressing the whole range at once (round to nearest), whoever compresses which chunk.
CGX_TEST(chunks_compress_to_the_same_values_as_the_whole) {
  const LayoutCodec codec = layout({quantized(1000, 4, 64), raw(37), quantized(5000, 8, 512),
                                    quantized(333, 1, 3), quantized(2049, 3, 1024, true),
                                    quantized(777, 6, 1)});
  const std::vector<float> x = random_values(codec.total(), 7);
  std::vector<uint8_t> whole_bytes(codec.compressed_bytes(0, codec.total()));
  codec.compress(x.data(), 0, codec.total(), whole_bytes.data(), 1);
  std::vector<float> whole(x.size());
  codec.decompress(whole_bytes.data(), 0, codec.total(), whole.data());
  for (int parts = 2; parts <= 7; ++parts) {
    const Chunking chunks(codec, {0, codec.total()}, parts);
    std::vector<float> pieced(x.size(), -1.0f);
    for (int c = 0; c < parts; ++c) {
      const Range r = chunks.range(c);
      std::vector<uint8_t> bytes(codec.compressed_bytes(r.begin, r.end));
      codec.compress(x.data(), r.begin, r.end, bytes.data(), 1);
      codec.decompress(bytes.data(), r.begin, r.end, pieced.data());
    }
    CHECK(std::memcmp(whole.data(), pieced.data(), x.size() * sizeof(float)) == 0);
  }
}

CGX_TEST(chunking_even_splits_equally_and_refuses_what_does_not_divide) {
  const Chunking chunks = Chunking::even({100, 112}, 3);
  CHECK_EQ(chunks.parts(), 3);
  for (int i = 0; i <= 3; ++i) CHECK_EQ(chunks.offset(i), int64_t{100 + 4 * i});
  const Chunking empty = Chunking::even({5, 5}, 4);
  for (int i = 0; i < 4; ++i) CHECK_EQ(empty.length(i), int64_t{0});
  CHECK_THROWS(Chunking::even({0, 10}, 3), std::invalid_argument);
  CHECK_THROWS(Chunking::even({0, 10}, 0), std::invalid_argument);
  CHECK_THROWS(Chunking::even({0, 10}, -2), std::invalid_argument);
}

CGX_TEST(chunking_to_one_puts_everything_in_the_owners_chunk) {
  for (int owner = 0; owner < 4; ++owner) {
    const Chunking chunks = Chunking::to_one({10, 50}, 4, owner);
    CHECK_EQ(chunks.parts(), 4);
    CHECK_EQ(chunks.offset(0), int64_t{10});
    CHECK_EQ(chunks.offset(4), int64_t{50});
    for (int i = 0; i < 4; ++i) CHECK_EQ(chunks.length(i), int64_t{i == owner ? 40 : 0});
    CHECK_EQ(chunks.range(owner).begin, int64_t{10});
    CHECK_EQ(chunks.range(owner).end, int64_t{50});
  }
}

// Within one call, every (rank, stage, chunk) gets its own stream.
// Distinct over calls too: consecutive calls' seeds differ in their low bits, as chunk
// numbers do (a call seed XORed in unmixed made call s ^ c's chunk 0 call s's chunk c).
CGX_TEST(stream_seed_is_deterministic_and_distinct_over_calls_and_coordinates) {
  std::vector<uint64_t> seeds;
  for (uint64_t call = 0; call < 16; ++call)
    for (int rank = 0; rank < 8; ++rank)
      for (int stage = 0; stage < 4; ++stage)
        for (int chunk = 0; chunk < 16; ++chunk) {
          const uint64_t s = collectives::stream_seed(0xdeadbeef ^ call, rank, stage, chunk);
          CHECK_EQ(s, collectives::stream_seed(0xdeadbeef ^ call, rank, stage, chunk));
          seeds.push_back(s);
        }
  std::sort(seeds.begin(), seeds.end());
  CHECK(std::adjacent_find(seeds.begin(), seeds.end()) == seeds.end());
}

}  // namespace
}  // namespace cgx::test
