// The sharded collectives (collectives/sharded.h, FSDP2's traffic under cgx.qsdp) over
// ShmTransport between forked processes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "check.h"
#include "collectives/sharded.h"
#include "fixtures.h"
#include "ranks.h"
#include "transport/shm_transport.h"

namespace cgx::test {
namespace {

using collectives::ReductionAlgorithm;
using compression::LayoutCodec;
using transport::ShmTransport;

// The values of shard `s` of a buffer of shards laid end to end.
std::vector<float> shard_of(const std::vector<float>& full, int64_t shard_numel, int s) {
  return {full.begin() + s * shard_numel, full.begin() + (s + 1) * shard_numel};
}

// Each owner's shard reaches every rank as the owner quantized it: all ranks end with the
// same bits, every shard within one quantization of its owner's values (raw layers exact),
// whatever the pieces; Ring (forwarding the owners' bytes) gives SRA's bits but in
// stochastically rounded layers, whose streams differ.
CGX_TEST(allgather_gives_every_rank_the_owners_shards_bit_identical) {
  const int size = 3;
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const LayoutCodec shard = mixed_layout();
    const int64_t n = shard.total();
    std::vector<float> input(size * n, std::numeric_limits<float>::quiet_NaN());  // others: overwritten
    const std::vector<float> mine = random_values(n, 7 + rank);
    std::copy(mine.begin(), mine.end(), input.begin() + rank * n);
    collectives::Scratch scratch;
    collectives::AllgatherOptions options;
    options.shard = &shard;
    options.seed = 11;
    options.scratch = &scratch;
    collectives::Traffic traffic;
    auto gather = [&](ReductionAlgorithm algorithm, int64_t piece_values) {
      std::vector<float> data = input;
      options.algorithm = algorithm;
      options.piece_values = piece_values;
      options.deadline = soon();
      traffic = collectives::compressed_allgather(transport, rank, size, data.data(), options);
      return data;
    };
    const std::vector<float> whole = gather(ReductionAlgorithm::SRA, 0);
    CHECK_EQ(traffic.bytes, (size - 1) * shard.compressed_bytes(0, n));  // its shard, to each peer
    CHECK(same_bits(whole, gather(ReductionAlgorithm::SRA, 100)));
    const std::vector<float> ring = gather(ReductionAlgorithm::Ring, 0);
    CHECK(same_bits(ring, gather(ReductionAlgorithm::Ring, 100)));
    int64_t stochastic = 0;  // values whose rounding draws differ between SRA and Ring
    for (int s = 0; s < size; ++s)
      for (const auto& segment : shard.segments())
        for (int64_t i = s * n + segment.offset; i < s * n + segment.offset + segment.numel; ++i) {
          if (!segment.raw && segment.params.stochastic) {
            stochastic += whole[i] != ring[i];
            continue;
          }
          CHECK(std::memcmp(&whole[i], &ring[i], sizeof(float)) == 0);
        }
    CHECK(stochastic > 0);
    for (const auto& theirs : from_every_rank(transport, rank, size, whole)) CHECK(same_bits(whole, theirs));
    const auto inputs = from_every_rank(transport, rank, size, mine);
    for (int owner = 0; owner < size; ++owner) {
      const std::vector<float> got = shard_of(whole, n, owner);
      const std::vector<double> bounds = quantization_bounds(shard, inputs[owner], 0, n);
      double moved = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double error = std::fabs(double(got[i]) - double(inputs[owner][i]));
        CHECK(bounds[i] == 0 ? error == 0 : error <= bounds[i]);
        moved += error;
      }
      CHECK(moved > 0);  // quantized: the bound above could fail
    }
  });
}

// Shard r of the result on rank r is the sum of every rank's shard r, each contribution
// quantized once (within the sum of their bounds, raw layers exact up to float rounding);
// the other shards are left as they were; pieces do not change a bit. With a residual, the
// owner's own contribution joins unquantized, and the ranks' residuals hold exactly what
// the owner's sum lacks.
CGX_TEST(reduce_scatter_sums_each_shard_at_its_owner_and_feeds_back_what_it_dropped) {
  const int size = 3;
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const LayoutCodec shard = mixed_layout();
    const LayoutCodec full = LayoutCodec::repeated(shard, size);
    const int64_t n = shard.total();
    const std::vector<float> input = random_values(size * n, 23 + rank);
    collectives::Scratch scratch;
    collectives::ReduceScatterOptions options;
    options.shard = &shard;
    options.seed = 3;
    options.scratch = &scratch;
    auto reduce = [&](int64_t piece_values, std::vector<float>* residual) {
      std::vector<float> data = input;
      options.piece_values = piece_values;
      options.residual = residual ? residual->data() : nullptr;
      options.deadline = soon();
      collectives::compressed_reduce_scatter(transport, rank, size, data.data(), options);
      return data;
    };
    const std::vector<float> out = reduce(0, nullptr);
    CHECK(same_bits(out, reduce(100, nullptr)));
    for (int s = 0; s < size; ++s)
      if (s != rank) CHECK(same_bits(shard_of(out, n, s), shard_of(input, n, s)));

    const auto inputs = from_every_rank(transport, rank, size, input);
    std::vector<double> allowed(n, 0.0);
    for (int r = 0; r < size; ++r) {
      const std::vector<double> bounds = quantization_bounds(full, inputs[r], rank * n, (rank + 1) * n);
      for (int64_t i = 0; i < n; ++i) allowed[i] += bounds[rank * n + i];
    }
    for (int64_t i = 0; i < n; ++i) {
      double sum = 0, magnitude = 0;
      for (int r = 0; r < size; ++r) {
        sum += inputs[r][rank * n + i];
        magnitude += std::fabs(inputs[r][rank * n + i]);
      }
      CHECK(std::fabs(out[rank * n + i] - sum) <= allowed[i] + 4 * 0x1p-24 * magnitude);
    }

    std::vector<float> residual(size * n, 0.0f);
    const std::vector<float> fed = reduce(0, &residual);
    CHECK(same_bits(shard_of(residual, n, rank), std::vector<float>(n, 0.0f)));  // own: unquantized
    const auto residuals = from_every_rank(transport, rank, size, residual);
    double dropped = 0;
    for (int64_t i = 0; i < n; ++i) {
      double sum = 0, fed_back = 0, scale = std::fabs(fed[rank * n + i]);
      for (int r = 0; r < size; ++r) {
        sum += inputs[r][rank * n + i];
        fed_back += residuals[r][rank * n + i];
        scale += std::fabs(inputs[r][rank * n + i]) + std::fabs(residuals[r][rank * n + i]);
      }
      CHECK(std::fabs(sum - (fed[rank * n + i] + fed_back)) <= 1e-6 * scale + 1e-6);
      dropped += std::fabs(fed_back);
    }
    CHECK(dropped > 0);
  });
}

// One rank: nothing moves and nothing is quantized, as for the allreduce.
CGX_TEST(sharded_collectives_on_one_rank_leave_the_values_exact) {
  run_ranks(1, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, {0}, prefix, kRingBytes, store);
    const LayoutCodec shard = mixed_layout();
    const std::vector<float> input = random_values(shard.total(), 5);
    collectives::Scratch scratch;
    std::vector<float> data = input, residual(input.size(), 0.0f);
    for (float* feedback : {static_cast<float*>(nullptr), residual.data()}) {
      collectives::ReduceScatterOptions reduce_options;
      reduce_options.shard = &shard;
      reduce_options.scratch = &scratch;
      reduce_options.residual = feedback;
      reduce_options.deadline = soon();
      CHECK_EQ(collectives::compressed_reduce_scatter(transport, rank, 1, data.data(), reduce_options).bytes,
               uint64_t{0});
      CHECK(same_bits(data, input));
    }
    CHECK(same_bits(residual, std::vector<float>(input.size(), 0.0f)));
    collectives::AllgatherOptions gather_options;
    gather_options.shard = &shard;
    gather_options.scratch = &scratch;
    gather_options.deadline = soon();
    CHECK_EQ(collectives::compressed_allgather(transport, rank, 1, data.data(), gather_options).bytes, uint64_t{0});
    CHECK(same_bits(data, input));
  });
}

}  // namespace
}  // namespace cgx::test
