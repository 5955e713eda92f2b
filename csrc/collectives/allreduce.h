// The compressed allreduce: one entry point, which picks the algorithm.
//
//   one rank:                        nothing moves;
//   one host, or one rank per host:  flat, the host's (inner) or the network's (cross)
//                                    algorithm over the whole group (phases.h);
//   several hosts, some with several ranks: hierarchical (hierarchical_allreduce.h).
//
// data[0, codec.total()) on every rank becomes the sum over ranks, each segment quantized
// as the codec's layout says (docs/algorithms.md); afterwards every rank holds
// bit-identical values.
#pragma once

#include <functional>

#include "collectives/phases.h"
#include "topology/host_map.h"

namespace cgx::collectives {

struct AllreduceOptions : CallOptions {
  const compression::LayoutCodec* codec = nullptr;  // the whole buffer's layout
  ReductionAlgorithm inner = ReductionAlgorithm::SRA;  // among the ranks of a host
  ReductionAlgorithm cross = ReductionAlgorithm::SRA;  // across hosts
  // Hierarchical: through one leader per host (CGX_INTRA_BROADCAST); compress inside a
  // host too (CGX_INTRA_COMPRESS).
  bool leader_form = false;
  bool intra_compress = true;
  // The hierarchical cross phases' executor and buffers (they run on `run_cross`'s
  // thread); `residual` receives what every stage of this rank dropped, summed over
  // ranks exactly the input sum minus the result, up to float32 rounding of the sums.
  compression::Executor* cross_executor = &compression::host_executor();
  Scratch* cross_scratch = nullptr;
  // Runs a job on a persistent second thread (hierarchical only; unset: no overlap of the
  // cross phases with the host's).
  std::function<void(std::function<void()>)> run_cross;
};

// Throws TimeoutError / TransportError (transport.h) when the transport fails.
Traffic allreduce(transport::Transport& transport, int rank, const topology::HostMap& hosts,
                  float* data, const AllreduceOptions& options);

}  // namespace cgx::collectives
