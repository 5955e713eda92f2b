#include "collectives/hierarchical_allreduce.h"

#include <algorithm>

#include "transport/subset_transport.h"

namespace cgx::collectives {

namespace {
constexpr int kIntraScatterStage = 100;
constexpr int kCrossStage = 101;

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
  const std::vector<int> local = hosts.ranks_on_host_of(rank);
  const int k = static_cast<int>(local.size());
  const int i = index_of(local, rank);
  const int num_hosts = hosts.num_hosts();
  const int host = hosts.host_of(rank);
  const bool leader_form = options.leader_form || !hosts.balanced();

  // Inside a host: the call's codec, or float32 throughout.
  compression::Segment raw_segment;
  raw_segment.numel = total;
  raw_segment.raw = true;
  const compression::LayoutCodec raw({raw_segment}, total);
  const compression::LayoutCodec& intra_codec = options.intra_compress ? codec : raw;

  // Chunk j of the host is reduced by local rank j, and cut into one part per host for
  // the cross phase; every cut is on the call's bucket grid.
  const Chunking chunks =
      leader_form ? Chunking::to_one({0, total}, k, 0) : Chunking(codec, {0, total}, k);
  std::vector<Chunking> parts;
  std::vector<size_t> part_bytes;
  for (int j = 0; j < k; ++j) {
    parts.emplace_back(codec, chunks.range(j), num_hosts);
    for (size_t bytes : compressed_sizes(codec, parts.back())) part_bytes.push_back(bytes);
  }
  // The compressed parts as the cross phase leaves them, kept to be forwarded (arena 1:
  // the phases use arena 0).
  const std::vector<uint8_t*> kept = scratch.buffers(part_bytes, 1);
  auto kept_of = [&](int j) {
    return std::vector<uint8_t*>(kept.begin() + j * num_hosts, kept.begin() + (j + 1) * num_hosts);
  };

  std::vector<int> cross_members;
  for (int h = 0; h < num_hosts; ++h) cross_members.push_back(hosts.ranks_on_host(h)[leader_form ? 0 : i]);
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
    traffic += reduce_scatter(cross, host, data, codec, parts[i], phase, scratch);
    traffic += allgather(cross, host, data, codec, parts[i], phase, kept_of(i));
  }
  if (k > 1) {
    // Forward the bytes of our chunk's parts to the host's other ranks and decode theirs:
    // every rank decodes every part from the bytes its owner made, so all are identical.
    std::vector<transport::Send> sends;
    std::vector<transport::Recv> recvs;
    for (int j = 0; j < k; ++j) {
      if (j == i) continue;
      for (int h = 0; h < num_hosts; ++h) {
        const size_t ours = part_bytes[i * num_hosts + h];
        sends.push_back({j, kept[i * num_hosts + h], ours});
        recvs.push_back({j, kept[j * num_hosts + h], part_bytes[j * num_hosts + h]});
        traffic += {ours, static_cast<uint64_t>(parts[i].length(h))};
      }
    }
    intra.exchange(sends, recvs, options.deadline);
    for (int j = 0; j < k; ++j)
      if (j != i)
        for (int h = 0; h < num_hosts; ++h)
          codec.decompress(kept[j * num_hosts + h], parts[j].offset(h), parts[j].offset(h + 1),
                           data);
  }
  return traffic;
}

}  // namespace cgx::collectives
