// CGX_COMPRESSION_AUTO's choices (collectives/path_choice.h): the same on every rank however
// differently the ranks' clocks ran, made from the slowest rank's timings, and the losing
// path re-tried more rarely the more it loses.
#include <cstdint>
#include <vector>

#include "check.h"
#include "collectives/call_signature.h"
#include "collectives/path_choice.h"
#include "fixtures.h"
#include "ranks.h"
#include "transport/shm_transport.h"

namespace cgx::test {
namespace {

using collectives::CallSignature;
using collectives::Path;
using collectives::PathChooser;

constexpr int kClass = 20;  // 1 MiB calls

// Runs `calls` calls of kClass on this rank's chooser as the backend does: each call signs,
// exchanges signatures with every rank, and its path is chosen from them; then its
// duration is recorded as `took(call, path)` says. Returns the paths, in order.
template <typename Took>
std::vector<Path> run_calls(PathChooser& chooser, transport::Transport& transport, int rank, int size,
                            int first, int calls, collectives::Scratch& scratch, Took took) {
  const compression::LayoutCodec codec = layout({quantized(1000, 4, 512)});
  std::vector<Path> paths;
  for (int call = first; call < first + calls; ++call) {
    CallSignature signature(call, {{1000}}, 1000, codec, "Float", "SUM", 4, 512, 0);
    chooser.sign(kClass, signature);
    const CallSignature* all = collectives::check_same_on_all_ranks(transport, rank, size, signature,
                                                                    soon(), scratch);
    const Path path = chooser.choose(kClass, all, size);
    chooser.record(kClass, path, took(call, path));
    paths.push_back(path);
  }
  return paths;
}

int count(const std::vector<Path>& paths, Path path, size_t from = 0, size_t to = SIZE_MAX) {
  int n = 0;
  for (size_t i = from; i < paths.size() && i < to; ++i) n += paths[i] == path;
  return n;
}

CGX_TEST(auto_choices_are_the_same_on_every_rank_and_follow_the_slowest_rank) {
  const int size = 3;
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    transport::ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    collectives::Scratch scratch;
    PathChooser chooser;
    // Each rank alone would choose differently: rank 0 finds compression 3x faster, rank 2
    // finds the exact path 300x faster. Compressed calls end when rank 1 does (50 ms), so
    // exact calls (3 ms at most) are the faster ones for the group.
    auto first_link = [&](int, Path path) {
      if (path == Path::kCompressed) return rank == 1 ? 50000.0 : 1000.0;
      return rank == 2 ? 10.0 : 3000.0;
    };
    std::vector<Path> paths = run_calls(chooser, transport, rank, size, 0, 300, scratch, first_link);
    // Then the exact path gets 100x slower everywhere (a busier link): compression wins.
    auto busier_link = [&](int call, Path path) {
      return path == Path::kExact ? 100 * first_link(call, path) : first_link(call, path);
    };
    const std::vector<Path> later = run_calls(chooser, transport, rank, size, 300, 700, scratch, busier_link);
    paths.insert(paths.end(), later.begin(), later.end());

    std::vector<float> mine;
    for (Path p : paths) mine.push_back(static_cast<float>(p));
    const auto every = from_every_rank(transport, rank, size, mine);
    for (int r = 0; r < size; ++r) CHECK(every[r] == every[0]);

    // Measured first compressed, then both ways in turn until every rank has both timings.
    CHECK_EQ(count(paths, Path::kExact, 0, PathChooser::kMinSamples), 0);
    CHECK(paths[PathChooser::kMinSamples] == Path::kExact);
    CHECK(paths[PathChooser::kMinSamples + 1] == Path::kCompressed);
    // Settled on exact, compressed re-tried about once in 32 x (50000 / 3000) calls.
    CHECK_EQ(count(paths, Path::kCompressed, 100, 300), 0);
    CHECK(count(paths, Path::kExact, 100, 300) == 200);
    // After the change, the next exact probe brings the slower exact timings: compression
    // wins from then on.
    CHECK(count(paths, Path::kCompressed, 800, 1000) >= 195);
    auto stats = chooser.stats();
    CHECK_EQ(stats.size(), size_t{1});
    CHECK_EQ(stats[0].size_class, kClass);
    CHECK(stats[0].path == Path::kCompressed);
    CHECK_EQ(stats[0].compressed_us, 50000.0);
    CHECK_EQ(stats[0].exact_calls + stats[0].compressed_calls, uint64_t{1000});
  });
}

// One rank's chooser, its signatures its own.
std::vector<Path> alone(PathChooser& chooser, int calls, double compressed_us, double exact_us) {
  std::vector<Path> paths;
  for (int call = 0; call < calls; ++call) {
    CallSignature signature;
    chooser.sign(kClass, signature);
    const Path path = chooser.choose(kClass, &signature, 1);
    chooser.record(kClass, path, path == Path::kExact ? exact_us : compressed_us);
    paths.push_back(path);
  }
  return paths;
}

CGX_TEST(auto_retries_the_losing_path_more_rarely_the_more_it_loses) {
  // Exact 2x slower: re-tried every 64 calls once settled.
  PathChooser close;
  const std::vector<Path> a = alone(close, 2000, 1000, 2000);
  CHECK_EQ(count(a, Path::kExact, 1000, 2000), 16);  // 1000 calls, one in 64
  // 1000x slower: every kProbeEveryMax calls.
  PathChooser far;
  const std::vector<Path> b = alone(far, 2 * PathChooser::kProbeEveryMax + 100, 1000, 1e6);
  CHECK_EQ(count(b, Path::kExact, 100), 2);
  // Equal: compression, which the user asked for.
  PathChooser equal;
  const std::vector<Path> c = alone(equal, 200, 1000, 1000);
  CHECK(count(c, Path::kCompressed, 100) >= 96);
}

}  // namespace
}  // namespace cgx::test
