// SRA (scatter-reduce-allgather). Terms: the buffer is cut into `size` chunks
// (Chunking); rank r owns chunk r.
//   1. scatter-reduce: r compresses every chunk, sends each peer its chunk, and sums the
//      decoded contributions to its own chunk, its own included, in rank order.
//   2. r compresses the sum once and decodes it locally, so it keeps exactly what the
//      others will decode.
//   3. allgather: the compressed chunks go to every rank, which decodes them in place.
// Each value is quantized in two stages (each contribution, then the sum) on its layer's
// bucket grid, and summed in rank order: with round-to-nearest the result depends on the
// values and the layout only, not on which rank owns which chunk (so not on how DDP lays
// out its buckets). Every rank decodes the same bytes: all ranks end bit-identical.
#include "collectives/allreduce.h"

#include <algorithm>

namespace cgx::collectives {

namespace {
constexpr int kScatterStage = 0;
constexpr int kGatherStage = 1;
}  // namespace

Traffic sra_allreduce(transport::Transport& transport, int rank, int size, float* data,
                      const compression::LayoutCodec& codec, const AllreduceOptions& options,
                      Scratch& scratch) {
  const Chunking chunks(codec, size);
  auto begin = [&](int p) { return chunks.offset(p); };
  auto end = [&](int p) { return chunks.offset(p + 1); };
  const size_t mine = codec.compressed_bytes(begin(rank), end(rank));

  // Buffers: [0, size) outgoing chunk for each peer (slot `rank` holds our reduced chunk),
  // [size, 2 size) incoming: a peer's contribution to our chunk, later its reduced chunk.
  std::vector<size_t> sizes(2 * size);
  for (int p = 0; p < size; ++p) {
    sizes[p] = codec.compressed_bytes(begin(p), end(p));
    sizes[size + p] = std::max(mine, sizes[p]);
  }
  const std::vector<uint8_t*> buf = scratch.buffers(sizes);

  Traffic traffic;
  std::vector<transport::Send> sends;
  std::vector<transport::Recv> recvs;
  for (int p = 0; p < size; ++p) {
    // Our own contribution lands in slot size + rank, beside the peers' ones.
    uint8_t* dst = p == rank ? buf[size + rank] : buf[p];
    codec.compress(data, begin(p), end(p), dst, stream_seed(options.seed, rank, kScatterStage, p));
    if (p == rank) continue;
    sends.push_back({p, buf[p], sizes[p]});
    recvs.push_back({p, buf[size + p], mine});
    traffic += {sizes[p], static_cast<uint64_t>(chunks.length(p))};
  }
  transport.exchange(sends, recvs, options.deadline);
  std::fill(data + begin(rank), data + end(rank), 0.0f);
  for (int p = 0; p < size; ++p) codec.decompress_add(buf[size + p], begin(rank), end(rank), data);

  codec.compress(data, begin(rank), end(rank), buf[rank],
                 stream_seed(options.seed, rank, kGatherStage, rank));
  codec.decompress(buf[rank], begin(rank), end(rank), data);

  sends.clear();
  recvs.clear();
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    sends.push_back({p, buf[rank], sizes[rank]});
    recvs.push_back({p, buf[size + p], sizes[p]});
    traffic += {sizes[rank], static_cast<uint64_t>(chunks.length(rank))};
  }
  transport.exchange(sends, recvs, options.deadline);
  for (int p = 0; p < size; ++p)
    if (p != rank) codec.decompress(buf[size + p], begin(p), end(p), data);
  return traffic;
}

}  // namespace cgx::collectives
