// The allreduce (collectives/allreduce.h) over ShmTransport between forked processes.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "check.h"
#include "collectives/allreduce.h"
#include "fixtures.h"
#include "ranks.h"
#include "topology/host_map.h"
#include "transport/shm_transport.h"

namespace cgx::test {
namespace {

using transport::ShmTransport;

// The pipelined allreduce (chunks in pieces, one on the wire while the next is encoded)
// gives the very bits of the unpipelined one, on every rank, for SRA and Ring with a
// layout of mixed layers (stochastic rounding included), and bit-identical results
// across ranks.
void allreduce_pipelined_equals_unpipelined(int size, collectives::ReductionAlgorithm algorithm) {
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const compression::LayoutCodec codec = mixed_layout();
    const topology::HostMap hosts(std::vector<std::string>(size, "host"));
    const std::vector<float> input = random_values(codec.total(), 17 + rank);
    collectives::Scratch scratch, cross_scratch;
    collectives::AllreduceOptions options;
    options.codec = &codec;
    options.inner = algorithm;
    options.seed = 99;
    options.scratch = &scratch;
    options.cross_scratch = &cross_scratch;
    auto reduce = [&](int64_t piece_values) {
      std::vector<float> data = input;
      options.piece_values = piece_values;
      options.deadline = soon();
      collectives::allreduce(transport, rank, hosts, data.data(), options);
      return data;
    };
    const std::vector<float> whole = reduce(0);
    for (int64_t piece_values : {int64_t{1}, int64_t{100}, int64_t{1000}}) {
      const std::vector<float> pieces = reduce(piece_values);
      CHECK(std::memcmp(whole.data(), pieces.data(), whole.size() * sizeof(float)) == 0);
    }
    // Every rank's result against every other's, through the transport.
    for (const auto& theirs : from_every_rank(transport, rank, size, whole))
      CHECK(std::memcmp(whole.data(), theirs.data(), whole.size() * sizeof(float)) == 0);
  });
}

CGX_TEST(allreduce_pipelined_equals_unpipelined_sra_2_ranks) {
  allreduce_pipelined_equals_unpipelined(2, collectives::ReductionAlgorithm::SRA);
}

CGX_TEST(allreduce_pipelined_equals_unpipelined_sra_3_ranks) {
  allreduce_pipelined_equals_unpipelined(3, collectives::ReductionAlgorithm::SRA);
}

CGX_TEST(allreduce_pipelined_equals_unpipelined_ring_3_ranks) {
  allreduce_pipelined_equals_unpipelined(3, collectives::ReductionAlgorithm::Ring);
}

// The flat SRA allreduce runs its two phases as one pipeline (run_chained_steps): the
// allgather of a piece goes on the wire beside the reduction of the next. Its results and
// residuals are the very bits of reduce_scatter and then allgather over the same pieces,
// with error feedback or without.
CGX_TEST(chained_sra_allreduce_equals_its_two_phases_one_after_the_other) {
  const int size = 3;
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const compression::LayoutCodec codec = mixed_layout();
    const topology::HostMap hosts(std::vector<std::string>(size, "host"));
    const std::vector<float> input = random_values(codec.total(), 41 + rank);
    const size_t n = input.size();
    collectives::Scratch scratch, cross_scratch;
    for (bool feedback : {false, true}) {
      collectives::AllreduceOptions options;
      options.codec = &codec;
      options.seed = 7;
      options.scratch = &scratch;
      options.cross_scratch = &cross_scratch;
      options.piece_values = 300;
      std::vector<float> chained = input, chained_residual(n, 0.0f);
      options.residual = feedback ? chained_residual.data() : nullptr;
      options.deadline = soon();
      collectives::allreduce(transport, rank, hosts, chained.data(), options);

      std::vector<float> phased = input, phased_residual(n, 0.0f);
      options.residual = feedback ? phased_residual.data() : nullptr;
      options.deadline = soon();
      const collectives::Phase phase{options, collectives::ReductionAlgorithm::SRA};
      const collectives::Chunking chunks(codec, {0, codec.total()}, size);
      CHECK(phase.pieces(codec, chunks).count() > 2);  // pieces overlap in the chain
      collectives::reduce_scatter(transport, rank, phased.data(), codec, chunks, phase, scratch);
      collectives::allgather(transport, rank, phased.data(), codec, chunks, phase,
                             scratch.buffers(phase.pieces(codec, chunks).chunk_bytes(), 1));
      CHECK(std::memcmp(chained.data(), phased.data(), n * sizeof(float)) == 0);
      CHECK(std::memcmp(chained_residual.data(), phased_residual.data(), n * sizeof(float)) == 0);
    }
  });
}

// An all-raw layout (the exact way) is exact: integers sum exactly in float32, so every
// rank must hold the exact sum, whatever the pieces, with a residual set or not (it stays
// zero: nothing is dropped), flat (values moved straight, SRA) and hierarchical (its
// cross phases forward bytes).
void raw_allreduce_is_exact(std::vector<std::string> host_names, collectives::ReductionAlgorithm algorithm) {
  const int size = static_cast<int>(host_names.size());
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const int64_t n = 10007;
    const compression::LayoutCodec codec = compression::LayoutCodec::raw(n);
    const topology::HostMap hosts(host_names);
    auto integers = [&](int r) {
      std::vector<float> v(n);
      for (int64_t i = 0; i < n; ++i) v[i] = static_cast<float>((i * 7 + r * 13) % 2001 - 1000);
      return v;
    };
    std::vector<float> sum(n, 0.0f);
    for (int r = 0; r < size; ++r)
      for (int64_t i = 0; i < n; ++i) sum[i] += integers(r)[i];
    collectives::Scratch scratch, cross_scratch;
    collectives::AllreduceOptions options;
    options.codec = &codec;
    options.inner = options.cross = algorithm;
    options.scratch = &scratch;
    options.cross_scratch = &cross_scratch;
    for (int64_t piece_values : {int64_t{0}, int64_t{1}, int64_t{1000}}) {
      for (bool with_residual : {false, true}) {
        std::vector<float> data = integers(rank), residual(n, 0.0f);
        options.piece_values = piece_values;
        options.residual = with_residual ? residual.data() : nullptr;
        options.deadline = soon();
        const collectives::Traffic traffic = collectives::allreduce(transport, rank, hosts, data.data(), options);
        CHECK(data == sum);
        CHECK(residual == std::vector<float>(n, 0.0f));
        CHECK(traffic.bytes > 0);
      }
    }
  });
}

CGX_TEST(raw_allreduce_is_exact_sra_3_ranks) {
  raw_allreduce_is_exact({"h", "h", "h"}, collectives::ReductionAlgorithm::SRA);
}

CGX_TEST(raw_allreduce_is_exact_ring_3_ranks) {
  raw_allreduce_is_exact({"h", "h", "h"}, collectives::ReductionAlgorithm::Ring);
}

CGX_TEST(raw_allreduce_is_exact_hierarchical_2x2) {
  raw_allreduce_is_exact({"a", "a", "b", "b"}, collectives::ReductionAlgorithm::SRA);
}

// Error feedback's record (AllreduceOptions::residual): every quantization a rank makes
// adds what it dropped, so the ranks' residuals sum to exactly what the result lacks of
// the input sum (up to float32 rounding of the sums), both stages, on the flat and the
// hierarchical paths; raw layers drop nothing; pipelining does not change a bit of it;
// and a non-finite bucket leaves the residual finite.
void allreduce_residuals_sum_to_what_the_result_lacks(std::vector<std::string> host_names,
                                                      collectives::ReductionAlgorithm algorithm,
                                                      bool leader_form) {
  const int size = static_cast<int>(host_names.size());
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const compression::LayoutCodec codec = mixed_layout();
    const topology::HostMap hosts(host_names);
    const std::vector<float> input = random_values(codec.total(), 31 + rank);
    collectives::Scratch scratch, cross_scratch;
    collectives::AllreduceOptions options;
    options.codec = &codec;
    options.inner = options.cross = algorithm;
    options.leader_form = leader_form;
    options.seed = 5;
    options.scratch = &scratch;
    options.cross_scratch = &cross_scratch;
    const size_t n = input.size();
    auto reduce = [&](std::vector<float> data, int64_t piece_values) {
      std::vector<float> residual(n, 0.0f);
      options.residual = residual.data();
      options.piece_values = piece_values;
      options.deadline = soon();
      collectives::allreduce(transport, rank, hosts, data.data(), options);
      return std::make_pair(data, residual);
    };
    const auto [out, residual] = reduce(input, 0);
    const auto [out_pieces, residual_pieces] = reduce(input, 100);
    CHECK(std::memcmp(out.data(), out_pieces.data(), n * sizeof(float)) == 0);
    CHECK(std::memcmp(residual.data(), residual_pieces.data(), n * sizeof(float)) == 0);

    const auto inputs = from_every_rank(transport, rank, size, input);
    const auto residuals = from_every_rank(transport, rank, size, residual);
    double dropped = 0;
    for (size_t i = 0; i < n; ++i) {
      double sum = 0, fed_back = 0, scale = std::fabs(out[i]);
      for (int r = 0; r < size; ++r) {
        sum += inputs[r][i];
        fed_back += residuals[r][i];
        scale += std::fabs(inputs[r][i]) + std::fabs(residuals[r][i]);
      }
      CHECK(std::fabs(sum - (out[i] + fed_back)) <= 1e-6 * scale + 1e-6);
      dropped += std::fabs(fed_back);
    }
    CHECK(dropped > 0);  // something was quantized: the check above could fail
    for (const auto& segment : codec.segments())
      if (segment.raw)
        for (int64_t i = segment.offset; i < segment.offset + segment.numel; ++i)
          CHECK_EQ(residual[i], 0.0f);

    std::vector<float> overflowing = input;
    overflowing[3] = std::numeric_limits<float>::infinity();
    const auto [nan_out, finite_residual] = reduce(overflowing, 0);
    CHECK(std::isnan(nan_out[3]));
    for (float r : finite_residual) CHECK(std::isfinite(r));
  });
}

CGX_TEST(allreduce_residuals_sra_2_ranks) {
  allreduce_residuals_sum_to_what_the_result_lacks({"h", "h"}, collectives::ReductionAlgorithm::SRA, false);
}

CGX_TEST(allreduce_residuals_ring_3_ranks) {
  allreduce_residuals_sum_to_what_the_result_lacks({"h", "h", "h"}, collectives::ReductionAlgorithm::Ring, false);
}

CGX_TEST(allreduce_residuals_hierarchical_2x2) {
  allreduce_residuals_sum_to_what_the_result_lacks({"a", "a", "b", "b"}, collectives::ReductionAlgorithm::SRA, false);
}

CGX_TEST(allreduce_residuals_hierarchical_leaders_ring) {
  allreduce_residuals_sum_to_what_the_result_lacks({"a", "a", "b", "b", "b"}, collectives::ReductionAlgorithm::Ring, true);
}

}  // namespace
}  // namespace cgx::test
