// Hierarchical allreduce: inside each host, then across hosts, then inside again.
//
// Spread form (default): the buffer is cut into k chunks for the k ranks of a host.
//   1. reduce_scatter inside the host (inner algorithm): local rank i holds chunk i
//      summed over the host;
//   2. allreduce of chunk i across hosts (cross algorithm) among the local ranks i of
//      every host (a "column"): every local rank carries 1/k of the cross-host traffic,
//      at once. It leaves every column member holding the compressed bytes that all of
//      chunk i is decoded from;
//   3. those bytes are forwarded to the host's other ranks, which decode them: nothing is
//      quantized again, and all ranks decode the same bytes (bit-identical).
// Leader form (CGX_INTRA_BROADCAST, or hosts with unequal rank counts): the host's lowest
// rank reduces the whole buffer, allreduces it with the other hosts' leaders, and
// forwards the bytes.
// Phase 1 is compressed with the call's layout (intra_compress) or moves float32.
// Across hosts, and in phase 3, only compressed bytes move.
// Large buffers go in up to 4 pieces, pipelined: a second thread runs the cross phase of
// piece p while this one reduces piece p+1 and shares piece p-1 inside the host.
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
  // Where the values are: the caller's thread works through `executor`, the cross phases
  // (a second thread when pipelined) through `cross_executor`.
  compression::Executor* executor = &compression::host_executor();
  compression::Executor* cross_executor = &compression::host_executor();
};

// Whether a group is hierarchical: several hosts, and some host with several ranks.
bool is_hierarchical(const topology::HostMap& hosts);

// data[0, codec.total()) becomes the sum over the group (`transport` reaches every rank
// of `hosts`); every rank ends bit-identical. `cross_scratch` serves the cross phases,
// which may run on a second thread. The inner and cross transports must allow one
// thread each at the same time (they reach disjoint peers).
Traffic hierarchical_allreduce(transport::Transport& transport, int rank,
                               const topology::HostMap& hosts, float* data,
                               const compression::LayoutCodec& codec,
                               const HierarchicalOptions& options, Scratch& scratch,
                               Scratch& cross_scratch);

}  // namespace cgx::collectives
