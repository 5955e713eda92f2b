#include "collectives/allreduce.h"

#include <stdexcept>

#include "collectives/hierarchical_allreduce.h"

namespace cgx::collectives {

Traffic allreduce(transport::Transport& transport, int rank, const topology::HostMap& hosts,
                  float* data, const AllreduceOptions& options) {
  if (!options.codec || !options.scratch || !options.cross_scratch)
    throw std::invalid_argument("allreduce: the options need a codec and scratch buffers");
  const compression::LayoutCodec& codec = *options.codec;
  const int size = hosts.size();
  if (size == 1 || codec.total() == 0) return {};
  if (is_hierarchical(hosts)) return hierarchical_allreduce(transport, rank, hosts, data, options);

  const Phase phase{options, hosts.num_hosts() == 1 ? options.inner : options.cross};
  const Chunking chunks(codec, {0, codec.total()}, size);
  // The allgather's buffers in arena 1: the reduce_scatter's (arena 0) are still in use.
  return allreduce_chunks(transport, rank, data, codec, chunks, phase, *options.scratch,
                          options.scratch->buffers(phase.pieces(codec, chunks).chunk_bytes(), 1));
}

}  // namespace cgx::collectives
