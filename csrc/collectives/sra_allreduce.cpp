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
// Run as one allreduce (sra_allreduce_chunks), the allgather of piece q goes on the wire
// as soon as its sum is made, beside the reduction of piece q + 1: one pipeline, not two.
#include <utility>

#include "collectives/phases.h"
#include "collectives/pipeline.h"

namespace cgx::collectives {

namespace {
constexpr int kScatterStage = 0;
constexpr int kGatherStage = 1;

// The two phases as step sequences (pipeline.h), each over the state it keeps while it
// runs: sra_reduce_scatter and sra_allgather run one, sra_allreduce_chunks chains both.
// Step q of either moves piece q of every chunk.
class PhaseSteps {
 public:
  PhaseSteps(int rank, float* data, const compression::LayoutCodec& codec, const Chunking& chunks,
             const Phase& phase)
      : rank_(rank), size_(chunks.parts()), data_(data), codec_(codec), chunks_(chunks),
        phase_(phase), pieces_(phase.pieces(codec, chunks)) {}
  virtual ~PhaseSteps() = default;

  Steps steps() {
    Steps steps;
    steps.count = pieces_.count();
    steps.encode = [this](int q) { return encode(q); };
    steps.decode = [this](int q) { decode(q); };
    return steps;
  }

 protected:
  virtual StepExchange encode(int q) = 0;
  virtual void decode(int q) = 0;

  const int rank_, size_;
  float* const data_;
  const compression::LayoutCodec& codec_;
  const Chunking& chunks_;
  const Phase& phase_;
  const PieceLayout pieces_;
};

// Each rank's contribution to each owner, summed there.
class ReduceScatterSteps final : public PhaseSteps {
 public:
  ReduceScatterSteps(int rank, float* data, const compression::LayoutCodec& codec,
                     const Chunking& chunks, const Phase& phase, Scratch& scratch)
      : PhaseSteps(rank, data, codec, chunks, phase),
        // With error feedback the owner's own contribution joins its sum unquantized: its
        // residual (which a caller adds to the input) then goes straight into the sum it
        // re-quantizes, as a server's error feedback would, instead of widening the range
        // of a first quantization. Without, every contribution is quantized alike, so the
        // result does not depend on which rank owns which chunk.
        // Exact and on the host (straight): a peer's piece is sent from the values
        // themselves, and the owner adds the others' onto its own (an exact sum has
        // nothing to keep independent of the owner; every rank still gets the owner's bits).
        straight_(phase.straight(codec)),
        own_raw_(phase.residual != nullptr || straight_) {
    // [0, size): outgoing chunk for each peer; [size, 2 size): each rank's contribution
    // to our chunk, ours included.
    sizes_ = pieces_.chunk_bytes();
    sizes_.resize(2 * size_, sizes_[rank]);
    buf_ = scratch.buffers(sizes_);
  }

  Traffic traffic() const {
    Traffic traffic;
    for (int p = 0; p < size_; ++p)
      if (p != rank_)
        traffic += {straight_ ? sizeof(float) * chunks_.length(p) : sizes_[p],
                    static_cast<uint64_t>(chunks_.length(p))};
    return traffic;
  }

 private:
  uint8_t* contribution(int p, int q) const { return buf_[size_ + p] + pieces_.offset(rank_, q); }
  size_t wire_bytes(int chunk, int q) const {
    const Range piece = pieces_.range(chunk, q);
    return straight_ ? sizeof(float) * (piece.end - piece.begin) : pieces_.bytes(chunk, q);
  }

  StepExchange encode(int q) override {
    compression::Executor& executor = *phase_.executor;
    StepExchange x;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ && own_raw_) continue;
      const Range piece = pieces_.range(p, q);
      if (p != rank_) x.recvs.push_back({p, contribution(p, q), wire_bytes(rank_, q)});
      if (straight_ && p != rank_) {
        x.sends.push_back({p, data_ + piece.begin, wire_bytes(p, q)});
        continue;
      }
      uint8_t* dst = p == rank_ ? contribution(rank_, q) : buf_[p] + pieces_.offset(p, q);
      executor.compress_and_decode(codec_, data_, piece.begin, piece.end, dst,
                                   stream_seed(phase_.seed, rank_, kScatterStage, p),
                                   phase_.residual, /*decode_in_place=*/false);
      if (p != rank_) x.sends.push_back({p, dst, wire_bytes(p, q)});
    }
    return x;
  }

  void decode(int q) override {
    // Added in rank order onto our own contribution, or rank 0's written first (no pass
    // zeroing).
    compression::Executor& executor = *phase_.executor;
    const Range own = pieces_.range(rank_, q);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ && own_raw_) continue;
      if (p == 0 && !own_raw_)
        executor.decompress(codec_, contribution(0, q), own.begin, own.end, data_);
      else
        executor.decompress_add(codec_, contribution(p, q), own.begin, own.end, data_);
    }
  }

  const bool straight_, own_raw_;
  std::vector<size_t> sizes_;
  std::vector<uint8_t*> buf_;
};

// Every owner's sum to every rank.
class AllgatherSteps final : public PhaseSteps {
 public:
  // buffers[p]: chunk p compressed (ours by us, the others as received).
  AllgatherSteps(int rank, float* data, const compression::LayoutCodec& codec,
                 const Chunking& chunks, const Phase& phase, const std::vector<uint8_t*>& buffers)
      : PhaseSteps(rank, data, codec, chunks, phase), buf_(buffers),
        // Exact, on the host, and no caller wanting the bytes: values move straight between
        // the owners' chunks and everyone's copies.
        straight_(phase.straight(codec) && !phase.keep_bytes) {}

  Traffic traffic() const {
    const uint64_t own_bytes =
        straight_ ? sizeof(float) * chunks_.length(rank_) : pieces_.chunk_bytes()[rank_];
    Traffic traffic;
    for (int p = 0; p < size_; ++p)
      if (p != rank_) traffic += {own_bytes, static_cast<uint64_t>(chunks_.length(rank_))};
    return traffic;
  }

 private:
  std::pair<uint8_t*, size_t> wire(int chunk, int q) const {
    const Range piece = pieces_.range(chunk, q);
    return straight_ ? std::make_pair(reinterpret_cast<uint8_t*>(data_ + piece.begin),
                                      sizeof(float) * (piece.end - piece.begin))
                     : std::make_pair(buf_[chunk] + pieces_.offset(chunk, q), pieces_.bytes(chunk, q));
  }

  StepExchange encode(int q) override {
    const auto [own, own_bytes] = wire(rank_, q);
    if (!straight_)
      quantize_owned_chunk(*phase_.executor, codec_, data_, pieces_.range(rank_, q), own,
                           stream_seed(phase_.seed, rank_, kGatherStage, rank_), phase_.residual);
    StepExchange x;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const auto [theirs, their_bytes] = wire(p, q);
      x.sends.push_back({p, own, own_bytes});
      x.recvs.push_back({p, theirs, their_bytes});
    }
    return x;
  }

  void decode(int q) override {
    if (straight_) return;
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) continue;
      const Range piece = pieces_.range(p, q);
      phase_.executor->decompress(codec_, buf_[p] + pieces_.offset(p, q), piece.begin, piece.end,
                                  data_);
    }
  }

  const std::vector<uint8_t*> buf_;
  const bool straight_;
};

}  // namespace

Traffic sra_reduce_scatter(transport::Transport& transport, int rank, float* data,
                           const compression::LayoutCodec& codec, const Chunking& chunks,
                           const Phase& phase, Scratch& scratch) {
  ReduceScatterSteps reduce(rank, data, codec, chunks, phase, scratch);
  run_steps(transport, *phase.executor, phase.deadline, reduce.steps());
  return reduce.traffic();
}

Traffic sra_allgather(transport::Transport& transport, int rank, float* data,
                      const compression::LayoutCodec& codec, const Chunking& chunks,
                      const Phase& phase, const std::vector<uint8_t*>& buffers) {
  AllgatherSteps gather(rank, data, codec, chunks, phase, buffers);
  run_steps(transport, *phase.executor, phase.deadline, gather.steps());
  return gather.traffic();
}

Traffic sra_allreduce_chunks(transport::Transport& transport, int rank, float* data,
                             const compression::LayoutCodec& codec, const Chunking& chunks,
                             const Phase& phase, Scratch& scratch,
                             const std::vector<uint8_t*>& buffers) {
  ReduceScatterSteps reduce(rank, data, codec, chunks, phase, scratch);
  AllgatherSteps gather(rank, data, codec, chunks, phase, buffers);
  run_chained_steps(transport, *phase.executor, phase.deadline, reduce.steps(), gather.steps());
  Traffic traffic = reduce.traffic();
  traffic += gather.traffic();
  return traffic;
}

}  // namespace cgx::collectives
