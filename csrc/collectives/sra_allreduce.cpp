// SRA (scatter-reduce-allgather). Terms: the buffer is cut into `size` chunks
// (Chunking); rank r owns chunk r.
//   1. scatter-reduce: r compresses every peer's chunk and sends it to that peer; it
//      decompress-adds what it receives into its own chunk (its own values stay exact).
//   2. r compresses the reduced chunk once and decodes it locally, so it keeps exactly
//      what the others will decode.
//   3. allgather: the compressed chunks go to every rank, which decodes them in place.
// Each value is quantized in two stages (a peer's contribution, then the sum); every rank
// decodes the same bytes, so all ranks end bit-identical.
#include "collectives/allreduce.h"

#include <algorithm>

namespace cgx::collectives {

namespace {
constexpr int kScatterStage = 0;
constexpr int kGatherStage = 1;
}  // namespace

Traffic sra_allreduce(transport::Transport& transport, int rank, int size, float* data,
                      int64_t n, const AllreduceOptions& options, Scratch& scratch) {
  const auto& q = options.quantizer;
  const Chunking chunks(n, size, q.bucket_size);
  const int64_t mine = chunks.length(rank);
  float* my_chunk = data + chunks.offset(rank);

  // Buffers: [0, size) outgoing chunk for each peer (slot `rank` holds our reduced chunk),
  // [size, 2 size) incoming: a peer's contribution to our chunk, later its reduced chunk.
  std::vector<size_t> sizes(2 * size);
  for (int p = 0; p < size; ++p) {
    sizes[p] = compression::compressed_bytes(q, chunks.length(p));
    sizes[size + p] = std::max(compression::compressed_bytes(q, mine), sizes[p]);
  }
  const std::vector<uint8_t*> buf = scratch.buffers(sizes);

  Traffic traffic;
  std::vector<transport::Send> sends;
  std::vector<transport::Recv> recvs;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    compression::compress(q, data + chunks.offset(p), chunks.length(p), buf[p],
                          stream_seed(options.seed, rank, kScatterStage, p));
    sends.push_back({p, buf[p], sizes[p]});
    recvs.push_back({p, buf[size + p], compression::compressed_bytes(q, mine)});
    traffic += {sizes[p], static_cast<uint64_t>(chunks.length(p))};
  }
  transport.exchange(sends, recvs, options.deadline);
  for (int p = 0; p < size; ++p)
    if (p != rank) compression::decompress_add(q, buf[size + p], mine, my_chunk);

  compression::compress(q, my_chunk, mine, buf[rank],
                        stream_seed(options.seed, rank, kGatherStage, rank));
  compression::decompress(q, buf[rank], mine, my_chunk);

  sends.clear();
  recvs.clear();
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    sends.push_back({p, buf[rank], sizes[rank]});
    recvs.push_back({p, buf[size + p], sizes[p]});
    traffic += {sizes[rank], static_cast<uint64_t>(mine)};
  }
  transport.exchange(sends, recvs, options.deadline);
  for (int p = 0; p < size; ++p)
    if (p != rank)
      compression::decompress(q, buf[size + p], chunks.length(p), data + chunks.offset(p));
  return traffic;
}

}  // namespace cgx::collectives
