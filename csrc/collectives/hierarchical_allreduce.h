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
// Large buffers go in up to 4 pieces, pipelined: a second, persistent thread runs the
// cross phase of piece p while this one reduces piece p+1 and shares piece p-1 inside the
// host.
#pragma once

#include "collectives/allreduce.h"

namespace cgx::collectives {

// Whether a group is hierarchical: several hosts, and some host with several ranks.
bool is_hierarchical(const topology::HostMap& hosts);

// allreduce() on a hierarchical group (`transport` reaches every rank of `hosts`). The
// cross phases run through `options.cross_executor` and `cross_scratch`, on the thread of
// `options.run_cross` when the buffer is large enough to pipeline. The inner and cross
// transports must allow one thread each at the same time (they reach disjoint peers).
Traffic hierarchical_allreduce(transport::Transport& transport, int rank,
                               const topology::HostMap& hosts, float* data,
                               const AllreduceOptions& options);

}  // namespace cgx::collectives
