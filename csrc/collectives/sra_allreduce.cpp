// SRA (scatter-reduce-allgather), as the two phases of allreduce.h. Rank r owns chunk r.
//   reduce_scatter: r compresses every chunk, sends each peer its chunk, and sums the
//     decoded contributions to its own chunk, its own included, in rank order.
//   allgather: r compresses its sum once and decodes it locally, so it keeps exactly what
//     the others will decode; the compressed chunks go to every rank, which decodes them
//     in place.
// Each value is quantized in two stages (each contribution, then the sum) on its layer's
// bucket grid, and summed in rank order: with round-to-nearest the result depends on the
// values and the layout only, not on which rank owns which chunk (so not on how DDP lays
// out its buckets). Every rank decodes the same bytes: all ranks end bit-identical.
#include "collectives/allreduce.h"

namespace cgx::collectives {

namespace {
constexpr int kScatterStage = 0;
constexpr int kGatherStage = 1;
}  // namespace

Traffic sra_reduce_scatter(transport::Transport& transport, int rank, float* data,
                           const compression::LayoutCodec& codec, const Chunking& chunks,
                           const Phase& phase, Scratch& scratch) {
  const int size = chunks.parts();
  const Range own = chunks.range(rank);
  const size_t mine = codec.compressed_bytes(own.begin, own.end);
  // [0, size): outgoing chunk for each peer; [size, 2 size): each rank's contribution to
  // our chunk, ours included.
  std::vector<size_t> sizes = compressed_sizes(codec, chunks);
  sizes.resize(2 * size, mine);
  const std::vector<uint8_t*> buf = scratch.buffers(sizes);

  compression::Executor& executor = *phase.executor;
  Traffic traffic;
  std::vector<transport::Send> sends;
  std::vector<transport::Recv> recvs;
  for (int p = 0; p < size; ++p) {
    uint8_t* dst = p == rank ? buf[size + rank] : buf[p];
    executor.compress(codec, data, chunks.offset(p), chunks.offset(p + 1), dst,
                      stream_seed(phase.seed, rank, kScatterStage, p));
    if (phase.sent)
      executor.decompress(codec, dst, chunks.offset(p), chunks.offset(p + 1), phase.sent);
    if (p == rank) continue;
    sends.push_back({p, buf[p], sizes[p]});
    recvs.push_back({p, buf[size + p], mine});
    traffic += {sizes[p], static_cast<uint64_t>(chunks.length(p))};
  }
  executor.sync();
  transport.exchange(sends, recvs, phase.deadline);
  executor.zero(data, own.begin, own.end);
  for (int p = 0; p < size; ++p)
    executor.decompress_add(codec, buf[size + p], own.begin, own.end, data);
  executor.sync();
  return traffic;
}

Traffic sra_allgather(transport::Transport& transport, int rank, float* data,
                      const compression::LayoutCodec& codec, const Chunking& chunks,
                      const Phase& phase, const std::vector<uint8_t*>& buf) {
  const int size = chunks.parts();
  // buf[p]: chunk p compressed (ours by us, the others as received).
  const std::vector<size_t> sizes = compressed_sizes(codec, chunks);
  compression::Executor& executor = *phase.executor;
  quantize_owned_chunk(executor, codec, data, chunks.range(rank), buf[rank],
                       stream_seed(phase.seed, rank, kGatherStage, rank));

  Traffic traffic;
  std::vector<transport::Send> sends;
  std::vector<transport::Recv> recvs;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    sends.push_back({p, buf[rank], sizes[rank]});
    recvs.push_back({p, buf[p], sizes[p]});
    traffic += {sizes[rank], static_cast<uint64_t>(chunks.length(rank))};
  }
  executor.sync();
  transport.exchange(sends, recvs, phase.deadline);
  for (int p = 0; p < size; ++p)
    if (p != rank) executor.decompress(codec, buf[p], chunks.offset(p), chunks.offset(p + 1), data);
  executor.sync();
  return traffic;
}

}  // namespace cgx::collectives
