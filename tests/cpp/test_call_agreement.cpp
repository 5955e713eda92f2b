// A call's agreement carried in its first exchange (collectives/call_agreement.h), over
// ShmTransport between forked processes: collectives give the very bits they give on the
// plain transport, small calls (all in the first messages) and large ones (their first
// exchange finished after the agreement) alike; ranks given different calls all raise the
// same CallMismatchError whatever their calls would have sent, and the transport stays in
// step for the next call.
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "check.h"
#include "collectives/allreduce.h"
#include "collectives/call_agreement.h"
#include "fixtures.h"
#include "ranks.h"
#include "topology/host_map.h"
#include "transport/shm_transport.h"

namespace cgx::test {
namespace {

using collectives::AgreedCall;
using collectives::CallMismatchError;
using collectives::CallSignature;
using transport::ShmTransport;

CallSignature signature_of(uint64_t sequence, const compression::LayoutCodec& codec) {
  return CallSignature(sequence, {{codec.total()}}, codec.total(), codec, "Float", "SUM", 4, 512, 0x5e7);
}

struct Ranks {
  ShmTransport& transport;
  int rank, size;
  const topology::HostMap& hosts;
  collectives::Scratch& scratch;
  collectives::Scratch& cross_scratch;
};

// The allreduce of `input` under `codec`, on the plain transport (agreed: false) or on an
// AgreedCall signed with `signature`.
std::vector<float> allreduce(const Ranks& r, const compression::LayoutCodec& codec, std::vector<float> data,
                             collectives::ReductionAlgorithm algorithm, const CallSignature* signature) {
  collectives::AllreduceOptions options;
  options.codec = &codec;
  options.inner = options.cross = algorithm;
  options.seed = 7;
  options.piece_values = 1000;
  options.deadline = soon();
  options.scratch = &r.scratch;
  options.cross_scratch = &r.cross_scratch;
  if (!signature) {
    collectives::allreduce(r.transport, r.rank, r.hosts, data.data(), options);
    return data;
  }
  AgreedCall call(r.transport, r.rank, r.size, *signature, 0, options.deadline, r.scratch);
  collectives::allreduce(call, r.rank, r.hosts, data.data(), options);
  const CallSignature* all = call.agree();
  for (int p = 0; p < r.size; ++p) CHECK_EQ(all[p].sequence, signature->sequence);
  return data;
}

void agreed_equals_plain(int size, std::vector<std::string> host_names) {
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const topology::HostMap hosts(host_names);
    collectives::Scratch scratch, cross_scratch;
    const Ranks ranks{transport, rank, size, hosts, scratch, cross_scratch};
    // Small (the whole call in the first messages) and large (every first send past
    // kCarriedBytes), quantized and raw.
    const int64_t large = 3 * static_cast<int64_t>(AgreedCall::kCarriedBytes);
    uint64_t sequence = 0;
    for (const auto& codec : {mixed_layout(), layout({raw(1000)}), layout({raw(large)}),
                              layout({quantized(large, 4, 512), raw(large / 2)})}) {
      const std::vector<float> input = random_values(codec.total(), 31 + rank);
      for (auto algorithm : {collectives::ReductionAlgorithm::SRA, collectives::ReductionAlgorithm::Ring}) {
        const CallSignature signature = signature_of(++sequence, codec);
        const std::vector<float> plain = allreduce(ranks, codec, input, algorithm, nullptr);
        const std::vector<float> agreed = allreduce(ranks, codec, input, algorithm, &signature);
        CHECK(same_bits(plain, agreed));
      }
    }
  });
}

CGX_TEST(agreed_allreduce_gives_the_plain_bits_2_ranks) { agreed_equals_plain(2, {"a", "a"}); }
CGX_TEST(agreed_allreduce_gives_the_plain_bits_3_ranks) { agreed_equals_plain(3, {"a", "a", "a"}); }
CGX_TEST(agreed_allreduce_gives_the_plain_bits_hierarchical) { agreed_equals_plain(4, {"a", "a", "b", "b"}); }

CGX_TEST(a_call_the_ranks_disagree_on_raises_on_every_rank_and_the_next_one_goes_through) {
  const int size = 3;
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    const topology::HostMap hosts(std::vector<std::string>(size, "a"));
    collectives::Scratch scratch, cross_scratch;
    const Ranks ranks{transport, rank, size, hosts, scratch, cross_scratch};
    const int64_t large = 2 * static_cast<int64_t>(AgreedCall::kCarriedBytes);
    // Rank 2's call differs in size: smaller, larger (its first sends past what the others
    // take), or across the carried size; in bits; or it is a call ahead.
    struct Case {
      compression::LayoutCodec mine, rank2s;
      uint64_t rank2s_sequence_step;
      std::string expected;
    };
    const std::vector<Case> cases = {
        {layout({raw(3000)}), layout({raw(300)}), 0, "rank 0 has 3000 elements, rank 2 has 300 elements"},
        {layout({raw(3000)}), layout({raw(large)}), 0, "rank 0 has 3000 elements, rank 2 has " + std::to_string(large)},
        {layout({raw(large)}), layout({raw(large + 64)}), 0, "elements"},
        {layout({quantized(large, 4, 512)}), layout({quantized(large, 2, 512)}), 0, "the per-layer plan"},
        {layout({raw(3000)}), layout({raw(3000)}), 1, "call #"},
    };
    uint64_t sequence = 100;
    for (const Case& c : cases) {
      ++sequence;
      const bool odd = rank == 2;
      const compression::LayoutCodec& codec = odd ? c.rank2s : c.mine;
      const CallSignature signature = signature_of(sequence + (odd ? c.rank2s_sequence_step : 0), codec);
      std::string message;
      try {
        allreduce(ranks, codec, random_values(codec.total(), 5 + rank), collectives::ReductionAlgorithm::SRA, &signature);
      } catch (const CallMismatchError& e) {
        message = e.what();
      }
      CHECK(message.find("cgx: ranks were given different calls: ") == 0);
      CHECK(message.find(c.expected) != std::string::npos);
      const auto every = from_every_rank(transport, rank, size,
                                         std::vector<float>(message.begin(), message.end()));
      for (int p = 0; p < size; ++p) CHECK(every[p] == every[0]);
      // The next call agrees, and sums right.
      const compression::LayoutCodec next = layout({raw(large)});
      const CallSignature agreed = signature_of(++sequence, next);
      const std::vector<float> sum =
          allreduce(ranks, next, std::vector<float>(next.total(), 1.0f + rank), collectives::ReductionAlgorithm::SRA, &agreed);
      CHECK(sum == std::vector<float>(next.total(), 6.0f));
    }
  });
}

}  // namespace
}  // namespace cgx::test
