// CGX_CODEC_THREADS (compression/codec_threads.h): a codec call split over threads gives
// the bytes and values of the call on one thread, for every scheme and shape of buffer;
// the pool runs every part once, hands back a part's exception, serves several callers at
// once, and works in the child of a fork().
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

#include "check.h"
#include "compression/codec_threads.h"
#include "compression/quantizer.h"
#include "fixtures.h"

namespace cgx::test {
namespace {

using compression::QuantizerParams;
using compression::Scheme;

std::vector<float> normal_values(int64_t n, uint32_t seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = dist(gen);
  return v;
}

// Every codec call on `threads` threads against the same call on one.
void check_same_on_threads(const QuantizerParams& params, int64_t n, int threads) {
  std::vector<float> values = normal_values(n, static_cast<uint32_t>(n + params.bucket_size));
  values[static_cast<size_t>(n / 3)] = std::numeric_limits<float>::infinity();  // a NaN bucket
  const size_t bytes = compression::compressed_bytes(params, n);
  std::vector<uint8_t> one(bytes), many(bytes);
  compression::compress(params, values.data(), n, one.data(), 7, 1000, 1);
  compression::compress(params, values.data(), n, many.data(), 7, 1000, threads);
  CHECK(one == many);

  std::vector<float> out_one(values.size()), out_many(values.size());
  compression::decompress(params, one.data(), n, out_one.data(), 1);
  compression::decompress(params, one.data(), n, out_many.data(), threads);
  CHECK(same_bits(out_one, out_many));
  std::vector<float> sum_one = values, sum_many = values;
  compression::decompress_add(params, one.data(), n, sum_one.data(), 1);
  compression::decompress_add(params, one.data(), n, sum_many.data(), threads);
  CHECK(same_bits(sum_one, sum_many));

  if (params.scheme != Scheme::kMaxMin) return;
  std::vector<float> fed_one = values, fed_many = values;
  std::vector<float> residual_one(values.size(), 0.5f), residual_many(values.size(), 0.5f);
  compression::compress_and_decode(params, fed_one.data(), n, one.data(), 3, 0, residual_one.data(), true, 1);
  compression::compress_and_decode(params, fed_many.data(), n, many.data(), 3, 0, residual_many.data(), true,
                                   threads);
  CHECK(one == many);
  CHECK(same_bits(fed_one, fed_many));
  CHECK(same_bits(residual_one, residual_many));
}

CGX_TEST(codec_threads_give_the_bytes_and_values_of_one_thread) {
  // Sizes from one part (below 2 x 32768 values: no split) to parts that end inside a
  // bucket, with a shorter last bucket and a raw tail; 3 threads (8 parts of unequal
  // runs of buckets), then other counts on one shape.
  const int64_t sizes[] = {1000, 65536 * 3 + 8, 200003};
  for (const int64_t n : sizes) {
    for (const bool stochastic : {false, true}) {
      for (const bool skip : {false, true}) {
        for (const int bits : {1, 2, 4, 8}) {
          for (const int64_t bucket : {int64_t{100}, int64_t{512}, int64_t{4096}}) {
            QuantizerParams maxmin{bits, bucket, skip, stochastic, Scheme::kMaxMin};
            check_same_on_threads(maxmin, n, 3);
            QuantizerParams hadamard{bits, bucket, skip, stochastic, Scheme::kHadamard};
            if (compression::scheme_fits(compression::Scheme::kHadamard, bits, bucket)) check_same_on_threads(hadamard, n, 3);
          }
        }
      }
    }
  }
  for (const int threads : {2, 8}) {
    for (const Scheme scheme : {Scheme::kMaxMin, Scheme::kHadamard}) {
      check_same_on_threads(QuantizerParams{4, 512, false, true, scheme}, 200003, threads);
    }
  }
}

CGX_TEST(codec_threads_run_every_part_once_and_hand_back_an_exception) {
  std::vector<std::atomic<int>> runs(100);
  compression::run_parts(100, 4, [&](int k) { ++runs[static_cast<size_t>(k)]; });
  for (auto& r : runs) CHECK_EQ(r.load(), 1);
  std::atomic<int> done{0};
  CHECK_THROWS(compression::run_parts(10, 3,
                                      [&](int k) {
                                        ++done;
                                        if (k == 4) throw std::runtime_error("part 4");
                                      }),
               std::runtime_error);
  CHECK_EQ(done.load(), 10);  // the other parts still ran
}

CGX_TEST(codec_threads_serve_several_callers_at_once) {
  // Four threads (groups' workers) each split calls over 3 threads of one pool.
  std::vector<std::thread> callers;
  std::atomic<int64_t> total{0};
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      for (int call = 0; call < 200; ++call)
        compression::run_parts(8, 3, [&](int k) { total += k + 1; });
    });
  for (auto& t : callers) t.join();
  CHECK_EQ(total.load(), int64_t{4 * 200 * 36});
}

CGX_TEST(codec_threads_work_in_a_forked_child) {
  compression::run_parts(4, 4, [](int) {});  // the parent's pool has workers
  const pid_t child = fork();
  if (child == 0) {
    std::atomic<int> parts{0};
    compression::run_parts(16, 4, [&](int) { ++parts; });
    _exit(parts.load() == 16 ? 0 : 1);
  }
  int status = 0;
  CHECK_EQ(waitpid(child, &status, 0), child);
  CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

}  // namespace
}  // namespace cgx::test
