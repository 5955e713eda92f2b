// Hierarchical allreduce: inside each host, then across hosts, then inside again.
//
// Spread form (default): the buffer is cut into k chunks for the k ranks of a host.
//   1. reduce_scatter inside the host: local rank i holds chunk i summed over the host;
//   2. allreduce of chunk i across hosts among the local ranks i of every host (a
//      "column"): every local rank carries 1/k of the cross-host traffic, at once;
//   3. allgather inside the host.
// Leader form (CGX_INTRA_BROADCAST, or hosts with unequal rank counts): the host's lowest
// rank reduces the whole buffer, allreduces it with the other hosts' leaders, and
// broadcasts the result.
// Inside a host, the phases are compressed with the call's layout (intra_compress) or
// move float32 exactly. Across hosts they are always compressed. The last inside phase
// quantizes (or copies) the same bit-identical chunk on every host the same way, so all
// ranks end bit-identical.
#pragma once

#include "collectives/allreduce.h"
#include "topology/host_map.h"

namespace cgx::collectives {

struct HierarchicalOptions {
  ReductionAlgorithm inner = ReductionAlgorithm::SRA;  // phases inside a host
  ReductionAlgorithm cross = ReductionAlgorithm::SRA;  // allreduce across hosts
  bool intra_compress = true;
  bool leader_form = false;
  uint64_t seed = 0;
  transport::Clock::time_point deadline;
};

// Whether a group is hierarchical: several hosts, and some host with several ranks.
bool is_hierarchical(const topology::HostMap& hosts);

// data[0, codec.total()) becomes the sum over the group (`transport` reaches every rank
// of `hosts`); every rank ends bit-identical.
Traffic hierarchical_allreduce(transport::Transport& transport, int rank,
                               const topology::HostMap& hosts, float* data,
                               const compression::LayoutCodec& codec,
                               const HierarchicalOptions& options, Scratch& scratch);

}  // namespace cgx::collectives
