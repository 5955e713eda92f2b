#include "collectives/sharded.h"

namespace cgx::collectives {

Traffic compressed_allgather(transport::Transport& transport, int rank, int size, float* data,
                             const AllgatherOptions& options, Scratch& scratch) {
  const auto codec = compression::LayoutCodec::repeated(*options.shard, size);
  const Range all{0, codec.total()};
  if (size == 1 || all.end == 0) return {};
  const Chunking shards = Chunking::even(all, size);
  Phase phase{options.algorithm, options.seed, options.deadline, options.executor};
  phase.piece_values = options.piece_values;
  return allgather(transport, rank, data, codec, shards, phase,
                   scratch.buffers(phase.pieces(codec, shards).chunk_bytes()));
}

Traffic compressed_reduce_scatter(transport::Transport& transport, int rank, int size, float* data,
                                  const ReduceScatterOptions& options, Scratch& scratch) {
  const auto codec = compression::LayoutCodec::repeated(*options.shard, size);
  const Range all{0, codec.total()};
  if (all.end == 0) return {};
  const Chunking shards = Chunking::even(all, size);
  Phase phase{ReductionAlgorithm::SRA, options.seed, options.deadline, options.executor};
  phase.residual = options.residual;
  phase.piece_values = options.piece_values;
  return sra_reduce_scatter(transport, rank, data, codec, shards, phase, scratch);
}

}  // namespace cgx::collectives
