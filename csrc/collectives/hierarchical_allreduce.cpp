#include "collectives/hierarchical_allreduce.h"

#include <algorithm>

#include "transport/subset_transport.h"

namespace cgx::collectives {

namespace {
constexpr int kIntraScatterStage = 100;
constexpr int kCrossStage = 101;
constexpr int kIntraGatherStage = 102;

int index_of(const std::vector<int>& ranks, int rank) {
  return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
}
}  // namespace

bool is_hierarchical(const topology::HostMap& hosts) {
  return hosts.num_hosts() > 1 && hosts.num_hosts() < hosts.size();
}

Traffic hierarchical_allreduce(transport::Transport& transport, int rank,
                               const topology::HostMap& hosts, float* data,
                               const compression::LayoutCodec& codec,
                               const HierarchicalOptions& options, Scratch& scratch) {
  const int64_t total = codec.total();
  if (total == 0) return {};
  const Range all{0, total};
  const std::vector<int> local = hosts.ranks_on_host_of(rank);
  const int k = static_cast<int>(local.size());
  const int i = index_of(local, rank);
  const int host = hosts.host_of(rank);
  const bool leader_form = options.leader_form || !hosts.balanced();

  // Inside a host: the call's codec, or float32 throughout.
  compression::Segment raw_segment;
  raw_segment.numel = total;
  raw_segment.raw = true;
  const compression::LayoutCodec raw({raw_segment}, total);
  const compression::LayoutCodec& intra_codec = options.intra_compress ? codec : raw;

  // Cut on the call's bucket grid in both forms: the cross phase compresses these chunks.
  const Chunking chunks = leader_form ? Chunking::to_one(all, k, 0) : Chunking(codec, all, k);
  std::vector<int> cross_members;
  for (int h = 0; h < hosts.num_hosts(); ++h) {
    const std::vector<int> on_host = hosts.ranks_on_host(h);
    cross_members.push_back(on_host[leader_form ? 0 : i]);
  }

  transport::SubsetTransport intra(transport, local);
  transport::SubsetTransport cross(transport, cross_members);
  Traffic traffic;
  if (k > 1) {
    const Phase phase{options.inner, stream_seed(options.seed, host, kIntraScatterStage, 0),
                      options.deadline};
    traffic += reduce_scatter(intra, i, data, intra_codec, chunks, phase, scratch);
  }
  if (!leader_form || i == 0) {
    const Phase phase{options.cross, stream_seed(options.seed, i, kCrossStage, 0),
                      options.deadline};
    traffic += allreduce(cross, host, hosts.num_hosts(), data, codec, chunks.range(i), phase,
                         scratch);
  }
  if (k > 1) {
    // The same seed on every host: chunk i is quantized to the same bytes everywhere.
    const Phase phase{options.inner, stream_seed(options.seed, 0, kIntraGatherStage, 0),
                      options.deadline};
    traffic += allgather(intra, i, data, intra_codec, chunks, phase, scratch);
  }
  return traffic;
}

}  // namespace cgx::collectives
