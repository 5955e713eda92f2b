// SRA (scatter-reduce-allgather), as the two phases of allreduce.h. Rank r owns chunk r.
//   reduce_scatter: r compresses every chunk, sends each peer its chunk, and sums the
//     decoded contributions to its own chunk, its own included, in rank order.
//   allgather: r compresses its sum once and decodes it locally, so it keeps exactly what
//     the others will decode; the compressed chunks go to every rank, which decodes them
//     in place.
// Each value is quantized in two stages (each contribution, then the sum) on its layer's
// bucket grid, and summed in rank order: with round-to-nearest the result depends on the
// values and the layout only, not on which rank owns which chunk (so not on how DDP lays
// out its buckets). With error feedback (Phase::residual) the owner's own contribution
// is not quantized (see below). Every rank decodes the same bytes: all ranks end
// bit-identical.
#include "collectives/phases.h"
#include "collectives/pipeline.h"

namespace cgx::collectives {

namespace {
constexpr int kScatterStage = 0;
constexpr int kGatherStage = 1;
}  // namespace

// Step q moves piece q of every chunk: each rank's contribution to each owner, then the
// owners' sums.
Traffic sra_reduce_scatter(transport::Transport& transport, int rank, float* data,
                           const compression::LayoutCodec& codec, const Chunking& chunks,
                           const Phase& phase, Scratch& scratch) {
  const int size = chunks.parts();
  const PieceLayout pieces = phase.pieces(codec, chunks);
  // [0, size): outgoing chunk for each peer; [size, 2 size): each rank's contribution to
  // our chunk, ours included.
  std::vector<size_t> sizes = pieces.chunk_bytes();
  const size_t own_bytes = sizes[rank];
  sizes.resize(2 * size, own_bytes);
  const std::vector<uint8_t*> buf = scratch.buffers(sizes);
  auto contribution = [&](int p, int q) { return buf[size + p] + pieces.offset(rank, q); };

  compression::Executor& executor = *phase.executor;
  // With error feedback the owner's own contribution joins its sum unquantized: its
  // residual (which a caller adds to the input) then goes straight into the sum it
  // re-quantizes, as a server's error feedback would, instead of widening the range of
  // a first quantization. Without, every contribution is quantized alike, so the result
  // does not depend on which rank owns which chunk.
  // Exact and on the host (straight): a peer's piece is sent from the values themselves,
  // and the owner adds the others' onto its own (an exact sum has nothing to keep
  // independent of the owner; every rank still gets the owner's bits).
  const bool straight = phase.straight(codec);
  const bool own_raw = phase.residual != nullptr || straight;
  auto wire_bytes = [&](int chunk, int q) {
    const Range piece = pieces.range(chunk, q);
    return straight ? sizeof(float) * (piece.end - piece.begin) : pieces.bytes(chunk, q);
  };
  Steps steps;
  steps.count = pieces.count();
  steps.encode = [&](int q) {
    StepExchange x;
    for (int p = 0; p < size; ++p) {
      if (p == rank && own_raw) continue;
      const Range piece = pieces.range(p, q);
      if (p != rank) x.recvs.push_back({p, contribution(p, q), wire_bytes(rank, q)});
      if (straight && p != rank) {
        x.sends.push_back({p, data + piece.begin, wire_bytes(p, q)});
        continue;
      }
      uint8_t* dst = p == rank ? contribution(rank, q) : buf[p] + pieces.offset(p, q);
      executor.compress(codec, data, piece.begin, piece.end, dst,
                        stream_seed(phase.seed, rank, kScatterStage, p));
      if (phase.residual)
        executor.add_error(codec, dst, piece.begin, piece.end, data, phase.residual);
      if (p != rank) x.sends.push_back({p, dst, wire_bytes(p, q)});
    }
    return x;
  };
  steps.decode = [&](int q) {
    // Added in rank order onto our own contribution, or rank 0's written first (no pass
    // zeroing).
    const Range own = pieces.range(rank, q);
    for (int p = 0; p < size; ++p) {
      if (p == rank && own_raw) continue;
      if (p == 0 && !own_raw)
        executor.decompress(codec, contribution(0, q), own.begin, own.end, data);
      else
        executor.decompress_add(codec, contribution(p, q), own.begin, own.end, data);
    }
  };
  run_steps(transport, executor, phase.deadline, steps);

  Traffic traffic;
  for (int p = 0; p < size; ++p)
    if (p != rank)
      traffic += {straight ? sizeof(float) * chunks.length(p) : sizes[p],
                  static_cast<uint64_t>(chunks.length(p))};
  return traffic;
}

Traffic sra_allgather(transport::Transport& transport, int rank, float* data,
                      const compression::LayoutCodec& codec, const Chunking& chunks,
                      const Phase& phase, const std::vector<uint8_t*>& buf) {
  const int size = chunks.parts();
  // buf[p]: chunk p compressed (ours by us, the others as received).
  const PieceLayout pieces = phase.pieces(codec, chunks);
  compression::Executor& executor = *phase.executor;
  // Exact, on the host, and no caller wanting the bytes: values move straight between the
  // owners' chunks and everyone's copies.
  const bool straight = phase.straight(codec) && !phase.keep_bytes;
  auto wire = [&](int chunk, int q) {
    const Range piece = pieces.range(chunk, q);
    return straight ? std::make_pair(reinterpret_cast<uint8_t*>(data + piece.begin),
                                     sizeof(float) * (piece.end - piece.begin))
                    : std::make_pair(buf[chunk] + pieces.offset(chunk, q), pieces.bytes(chunk, q));
  };
  Steps steps;
  steps.count = pieces.count();
  steps.encode = [&](int q) {
    const auto [own, own_bytes] = wire(rank, q);
    if (!straight)
      quantize_owned_chunk(executor, codec, data, pieces.range(rank, q), own,
                           stream_seed(phase.seed, rank, kGatherStage, rank), phase.residual);
    StepExchange x;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const auto [theirs, their_bytes] = wire(p, q);
      x.sends.push_back({p, own, own_bytes});
      x.recvs.push_back({p, theirs, their_bytes});
    }
    return x;
  };
  steps.decode = [&](int q) {
    if (straight) return;
    for (int p = 0; p < size; ++p) {
      if (p == rank) continue;
      const Range piece = pieces.range(p, q);
      executor.decompress(codec, buf[p] + pieces.offset(p, q), piece.begin, piece.end, data);
    }
  };
  run_steps(transport, executor, phase.deadline, steps);

  const uint64_t own_bytes =
      straight ? sizeof(float) * chunks.length(rank) : pieces.chunk_bytes()[rank];
  Traffic traffic;
  for (int p = 0; p < size; ++p)
    if (p != rank) traffic += {own_bytes, static_cast<uint64_t>(chunks.length(rank))};
  return traffic;
}

}  // namespace cgx::collectives
