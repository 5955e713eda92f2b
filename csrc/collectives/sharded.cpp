#include "collectives/sharded.h"

#include <stdexcept>

namespace cgx::collectives {
namespace {

void check_options(const CallOptions& options, const compression::LayoutCodec* shard, const char* what) {
  if (!shard || !options.scratch)
    throw std::invalid_argument(std::string(what) + ": the options need a shard layout and scratch buffers");
}

}  // namespace

Traffic compressed_allgather(transport::Transport& transport, int rank, int size, float* data,
                             const AllgatherOptions& options) {
  check_options(options, options.shard, "compressed_allgather");
  if (options.residual) throw std::invalid_argument("compressed_allgather: a residual, but nothing is reduced");
  const auto codec = compression::LayoutCodec::repeated(*options.shard, size);
  const Range all{0, codec.total()};
  if (size == 1 || all.end == 0) return {};
  const Chunking shards = Chunking::even(all, size);
  const Phase phase{options, options.algorithm};
  return allgather(transport, rank, data, codec, shards, phase,
                   options.scratch->buffers(phase.pieces(codec, shards).chunk_bytes()));
}

Traffic compressed_reduce_scatter(transport::Transport& transport, int rank, int size, float* data,
                                  const ReduceScatterOptions& options) {
  check_options(options, options.shard, "compressed_reduce_scatter");
  const auto codec = compression::LayoutCodec::repeated(*options.shard, size);
  const Range all{0, codec.total()};
  if (size == 1 || all.end == 0) return {};  // one rank's sum is its values: exact, as the allreduce
  const Chunking shards = Chunking::even(all, size);
  const Phase phase{options, ReductionAlgorithm::SRA};
  return sra_reduce_scatter(transport, rank, data, codec, shards, phase, *options.scratch);
}

}  // namespace cgx::collectives
