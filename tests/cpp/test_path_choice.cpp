// CGX_COMPRESSION_AUTO's choices (collectives/path_choice.h): the same on every rank however
// differently the ranks' clocks ran, made from the slowest rank's timings, not fooled by
// stalls, and the losing path re-tried more rarely the more it loses.
#include <cstdint>
#include <vector>

#include "check.h"
#include "collectives/call_agreement.h"
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

// Runs `calls` calls of kClass on this rank's chooser as the backend does: each call goes
// the way the chooser says, signs, exchanges signatures with every rank (an agreed call
// that moves nothing else), records its duration as `took(call, path)` says, and tells
// the chooser it was agreed. Returns the paths, in order.
template <typename Took>
std::vector<Path> run_calls(PathChooser& chooser, transport::Transport& transport, int rank, int size,
                            int first, int calls, collectives::Scratch& scratch, Took took) {
  const compression::LayoutCodec codec = layout({quantized(1000, 4, 512)});
  std::vector<Path> paths;
  for (int call = first; call < first + calls; ++call) {
    CallSignature signature(call, {{1000}}, 1000, codec, "Float", "SUM", 4, 512, 0);
    const Path path = chooser.next(kClass);
    chooser.sign(kClass, signature);
    collectives::AgreedCall agreement(transport, rank, size, signature, static_cast<uint32_t>(path), soon(), scratch);
    const CallSignature* all = agreement.agree();
    chooser.record(kClass, path, took(call, path));
    chooser.agreed(kClass, all, size);
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

    // Measured first compressed, then exact, a short run of each.
    const int first = PathChooser::kFirstTrialCalls;
    CHECK_EQ(count(paths, Path::kExact, 0, first), 0);
    CHECK_EQ(count(paths, Path::kExact, first, 2 * first), first);
    // Settled on exact, compressed re-tried once after 64 calls (calls 70-74), then after
    // 5 x (50000 / 3000) / 1% calls.
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
    const Path path = chooser.next(kClass);
    chooser.sign(kClass, signature);
    chooser.record(kClass, path, path == Path::kExact ? exact_us : compressed_us);
    chooser.agreed(kClass, &signature, 1);
    paths.push_back(path);
  }
  return paths;
}

// The lengths of the runs of `path` from call `from` on, and the calls between them.
std::pair<std::vector<int>, std::vector<int>> runs_of(const std::vector<Path>& paths, Path path, size_t from) {
  std::vector<int> runs, gaps;
  int gap = 0;
  for (size_t i = from; i < paths.size(); ++i) {
    if (paths[i] != path) {
      ++gap;
      continue;
    }
    if (i == from || paths[i - 1] != path) {
      runs.push_back(0);
      gaps.push_back(gap);
      gap = 0;
    }
    ++runs.back();
  }
  return {runs, gaps};
}

CGX_TEST(auto_retries_the_losing_path_more_rarely_the_more_it_loses) {
  const int run = PathChooser::kTrialCalls, first = PathChooser::kFirstTrialCalls;
  // Exact 2x slower: a run of it after the first 64 compressed calls, then after every
  // 5 x 2 / 1% = 1000: 10 of every 1010 calls' time on the slower way.
  PathChooser close;
  const std::vector<Path> a = alone(close, 2 * first + 64 + 3 * (run + 1000) + 10, 1000, 2000);
  const auto [a_runs, a_gaps] = runs_of(a, Path::kExact, 2 * first);
  CHECK_EQ(a_runs.size(), size_t{4});
  for (int r : a_runs) CHECK_EQ(r, run);
  CHECK_EQ(a_gaps[0], 64);
  for (size_t i = 1; i < a_gaps.size(); ++i) CHECK_EQ(a_gaps[i], 1000);
  // 7.76x slower (4-bit's bytes at a slow link): 1% of the time on it, 5 calls of 3,880.
  PathChooser wide;
  const std::vector<Path> w = alone(wide, 2 * first + 64 + 2 * (run + 3880) + 10, 1000, 7760);
  const auto [w_runs, w_gaps] = runs_of(w, Path::kExact, 2 * first);
  CHECK_EQ(w_runs.size(), size_t{3});
  for (size_t i = 1; i < w_gaps.size(); ++i) CHECK_EQ(w_gaps[i], 3880);
  // 1000x slower: after the first 64 calls, then after every kRetryEveryMax.
  PathChooser far;
  const std::vector<Path> b = alone(far, 2 * PathChooser::kRetryEveryMax + 100, 1000, 1e6);
  CHECK_EQ(count(b, Path::kExact, 2 * first), 3 * run);
  // Equal: compression, which the user asked for, exact re-tried after 64 calls, then
  // after every 500.
  PathChooser equal;
  const std::vector<Path> c = alone(equal, 2 * first + 64 + 2 * (run + 500) + 10, 1000, 1000);
  const auto [c_runs, c_gaps] = runs_of(c, Path::kExact, 2 * first);
  CHECK_EQ(c_runs.size(), size_t{3});
  CHECK_EQ(c_gaps[0], 64);
  for (size_t i = 1; i < c_gaps.size(); ++i) CHECK_EQ(c_gaps[i], 500);
}

CGX_TEST(auto_sends_a_class_s_seventh_call_the_faster_way) {
  // Three compressed calls, three exact, then the faster way, whichever it is.
  for (const double exact_us : {100.0, 10000.0}) {
    PathChooser chooser;
    const std::vector<Path> paths = alone(chooser, 12, 1000, exact_us);
    const Path faster = exact_us < 1000 ? Path::kExact : Path::kCompressed;
    CHECK_EQ(count(paths, Path::kExact, 0, 3), 0);
    CHECK_EQ(count(paths, Path::kExact, 3, 6), 3);
    CHECK_EQ(count(paths, faster, 6, 12), 6);
  }
}

// Two ranks; a call takes `took(rank, its paths so far, path)` us. Each rank checks its
// paths with `check`, and every rank's are the same.
template <typename Took, typename Check>
void with_times(int calls, Took took, Check check) {
  run_ranks(2, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    transport::ShmTransport transport(rank, ranks_below(2), prefix, kRingBytes, store);
    collectives::Scratch scratch;
    PathChooser chooser;
    std::vector<Path> before;  // this rank's paths so far, to tell where a call stands
    const auto paths = run_calls(chooser, transport, rank, 2, 0, calls, scratch, [&](int, Path path) {
      const double us = took(rank, before, path);
      before.push_back(path);
      return us;
    });
    std::vector<float> mine;
    for (Path p : paths) mine.push_back(static_cast<float>(p));
    const auto every = from_every_rank(transport, rank, 2, mine);
    CHECK(every[1] == every[0]);
    check(paths);
  });
}

// Exact calls take 500 us and compressed ones 2000 us, except that rank 1's take
// `stalled(its paths so far, path)` us more.
template <typename Stalled, typename Check>
void with_stalls(int calls, Stalled stalled, Check check) {
  with_times(calls, [&](int rank, const std::vector<Path>& before, Path path) {
    return (path == Path::kExact ? 500.0 : 2000.0) + (rank == 1 ? stalled(before, path) : 0.0);
  }, check);
}

CGX_TEST(auto_is_not_fooled_by_the_first_call_after_a_switch_stalling) {
  // Each path's first call after the other (an idle connection waking, say) stalls, on
  // one rank: a median of alternating trials would see only stalls of the exact path.
  const int run = PathChooser::kTrialCalls, first = PathChooser::kFirstTrialCalls;
  auto after_a_switch = [](const std::vector<Path>& before, Path path) {
    return !before.empty() && before.back() != path ? 20000.0 : 0.0;
  };
  with_stalls(2 * first + 64 + 2 * 2000 + 3 * run, after_a_switch, [&](const std::vector<Path>& paths) {
    // Exact from the first comparison on (the smaller of its first two calls); compressed
    // only in its re-try runs, after the first 64 calls, then after every 5 x 4 / 1%.
    const auto [runs, gaps] = runs_of(paths, Path::kCompressed, 2 * first);
    CHECK_EQ(runs.size(), size_t{3});
    for (int r : runs) CHECK_EQ(r, run);
    CHECK_EQ(gaps[0], 64);
    for (size_t i = 1; i < gaps.size(); ++i) CHECK_EQ(gaps[i], 2000);
  });
}

CGX_TEST(auto_takes_a_second_look_when_its_trials_met_a_stall) {
  // Every exact call of the first trial run stalls, on one rank: compression wins the first
  // comparison (2000 us against 20000), and the first re-try, 64 calls later (not the
  // 64 x 10 the stalled ratio gives), finds exact 4x faster.
  const int run = PathChooser::kTrialCalls, first = PathChooser::kFirstTrialCalls;
  auto in_the_first_trials = [&](const std::vector<Path>& before, Path path) {
    return path == Path::kExact && before.size() < size_t{2 * first} ? 19500.0 : 0.0;
  };
  const int settled = 2 * first + 64 + run;
  with_stalls(settled + 2 * (2000 + run) + 10, in_the_first_trials, [&](const std::vector<Path>& paths) {
    CHECK_EQ(count(paths, Path::kExact, 2 * first, 2 * first + 64), 0);
    CHECK_EQ(count(paths, Path::kExact, 2 * first + 64, settled), run);
    // Exact from then on; compressed re-tried after every 5 x 2000 / 500 / 1% calls.
    const auto [runs, gaps] = runs_of(paths, Path::kCompressed, settled);
    CHECK_EQ(runs.size(), size_t{2});
    for (int g : gaps) CHECK_EQ(g, 2000);
  });
}

CGX_TEST(auto_takes_a_second_look_when_the_chosen_path_gets_slower) {
  // As above, compression wins the first comparison from stalled exact trials, and the
  // first re-try (calls 70-74) is stalled too; then compression gets 2x slower (still 5x
  // faster than the stalled estimate): exact is re-tried at once and wins, long before
  // the 5,000 calls the ratio alone would wait.
  const int run = PathChooser::kTrialCalls, first = PathChooser::kFirstTrialCalls;
  auto stalls_then_slower = [&](const std::vector<Path>& before, Path path) {
    if (path == Path::kExact) return before.size() < 80 ? 19500.0 : 0.0;
    return before.size() >= 100 ? 2000.0 : 0.0;
  };
  with_stalls(200, stalls_then_slower, [&](const std::vector<Path>& paths) {
    CHECK_EQ(count(paths, Path::kExact, 2 * first, 70), 0);
    CHECK_EQ(count(paths, Path::kExact, 70, 75), run);
    CHECK_EQ(count(paths, Path::kExact, 75, 100), 0);
    // Rank 1's estimate (the 3rd smallest of its last 8) has grown once 6 slower calls are
    // in: call 106's signature carries it, and the re-try begins with the next call.
    CHECK_EQ(count(paths, Path::kExact, 100, 107), 0);
    CHECK_EQ(count(paths, Path::kExact, 107, 200), 200 - 107);
  });
}

CGX_TEST(auto_takes_a_second_look_when_a_re_try_met_a_stall) {
  // Exact (500 us) wins; compressed (2000 us) is re-tried at calls 70-74, then 2,000 calls
  // later, at 2075-2079. From call 2075 compression is faster (200 us), but rank 1 stalls
  // through that whole run (+20,000 us): the run finds compression 10x slower than before.
  // It is tried again 64 calls later, not after the 20,000 its stalled ratio gives, and
  // wins from then on.
  const int run = PathChooser::kTrialCalls;
  auto took = [&](int rank, const std::vector<Path>& before, Path path) {
    if (path == Path::kExact) return 500.0;
    if (before.size() < 2075) return 2000.0;
    return 200.0 + (rank == 1 && before.size() < 2075 + size_t{run} ? 20000.0 : 0.0);
  };
  with_times(2600, took, [&](const std::vector<Path>& paths) {
    CHECK_EQ(count(paths, Path::kCompressed, 6, 70), 0);
    CHECK_EQ(count(paths, Path::kCompressed, 2075, 2080), run);
    CHECK_EQ(count(paths, Path::kCompressed, 2080, 2144), 0);
    CHECK_EQ(count(paths, Path::kCompressed, 2144, 2149), run);
    // Rank 1's estimate from the second look reaches the others with the call after it.
    CHECK(count(paths, Path::kCompressed, 2160, 2600) >= 2600 - 2160 - 2 * run);
  });
}

CGX_TEST(auto_keeps_to_its_share_and_its_ranks_agree_under_random_stalls) {
  // Three ranks, exact 7.76x slower (4 bits' payload at a slow link); on each rank a call
  // in 20 stalls (a seeded draw per rank: the ranks stall at different calls) by up to 10x.
  // Every rank sends every call the same way, and from call 200 on the slower way takes at
  // most 1.5% of the calls' time (the share is 1%; 64 x ratio spacing took 7%): stalls
  // neither lock the class on it nor start re-tries beyond the share.
  const int size = 3, calls = 20000;
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    transport::ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    collectives::Scratch scratch;
    PathChooser chooser;
    uint32_t state = 12345u + 977u * static_cast<uint32_t>(rank);
    auto draw = [&] {  // xorshift32
      state ^= state << 13, state ^= state >> 17, state ^= state << 5;
      return state;
    };
    const std::vector<Path> paths = run_calls(chooser, transport, rank, size, 0, calls, scratch, [&](int, Path path) {
      const double stall = draw() % 20 == 0 ? (draw() % 10 + 1) * 1000.0 : 0.0;
      return (path == Path::kExact ? 7760.0 : 1000.0) + stall;
    });
    std::vector<float> mine;
    for (Path p : paths) mine.push_back(static_cast<float>(p));
    const auto every = from_every_rank(transport, rank, size, mine);
    for (int r = 0; r < size; ++r) CHECK(every[r] == every[0]);
    const double exact_time = 7760.0 * count(paths, Path::kExact, 200);
    CHECK(exact_time <= 0.015 * (exact_time + 1000.0 * count(paths, Path::kCompressed, 200)));
  });
}

}  // namespace
}  // namespace cgx::test
