// The phases the compressed collectives are made of, written against Transport and the
// codec only (allreduce.h and sharded.h put them together).
//
// An allreduce is two phases over `size` ranks, each rank owning one chunk:
//   reduce_scatter: rank r ends holding chunk r summed over all ranks, at full precision
//     (contributions are quantized on the way: once with SRA, at every hop with Ring);
//   allgather: each owner quantizes its chunk once and keeps the decoded values, and
//     every rank decodes every chunk from the same bytes: all end bit-identical.
// The hierarchical allreduce (hierarchical_allreduce.h) combines phases over the ranks of
// a host and across hosts.
//
// Each chunk travels in pieces (PieceLayout), and a phase is a pipeline of steps, one per
// piece (pipeline.h): piece p is on the wire while piece p + 1 is compressed and piece
// p - 1 decoded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <vector>

#include "compression/executor.h"
#include "compression/layout_codec.h"
#include "transport/transport.h"

namespace cgx::collectives {

enum class ReductionAlgorithm { SRA, Ring };
// The names users write (CGX_*_REDUCTION_TYPE), in the enum's order; the one list of them.
constexpr const char* kReductionAlgorithmNames[] = {"SRA", "Ring"};
static_assert(std::size(kReductionAlgorithmNames) == static_cast<size_t>(ReductionAlgorithm::Ring) + 1);

// What one rank put on the wire: bytes, and the values they carried (the uncompressed
// algorithm would send values * element size).
struct Traffic {
  uint64_t bytes = 0;
  uint64_t values = 0;
  Traffic& operator+=(const Traffic& o) {
    bytes += o.bytes;
    values += o.values;
    return *this;
  }
};

// Buffers reused across calls so that the hot path does not allocate.
class Scratch {
 public:
  explicit Scratch(compression::HostMemory memory = compression::plain_memory())
      : memory_(memory) {}
  ~Scratch();
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;

  // Byte buffers of the given sizes from arena `arena`, valid until the next call for the
  // same arena (phases use arena 0; a caller keeping bytes across phases uses another).
  std::vector<uint8_t*> buffers(const std::vector<size_t>& sizes, int arena = 0);

 private:
  struct Arena {
    void* memory = nullptr;
    size_t bytes = 0;
  };
  compression::HostMemory memory_;
  std::vector<Arena> arenas_;
};

// A part [begin, end) of the flat buffer.
struct Range {
  int64_t begin = 0;
  int64_t end = 0;
};

// Splits `range` into `parts` chunks; chunk i is [offset(i), offset(i+1)).
class Chunking {
 public:
  // About equal chunks, cut only where no quantization bucket is split: a chunk
  // quantizes each layer on the layer's own bucket grid, whoever compresses it.
  Chunking(const compression::LayoutCodec& codec, Range range, int parts);
  // All of `range` in chunk `owner`, the others empty (a reduction to one rank).
  static Chunking to_one(Range range, int parts, int owner);
  // `parts` chunks of equal length (range's length must divide by `parts`): rank i's
  // shard of an all-gather or reduce-scatter.
  static Chunking even(Range range, int parts);

  int parts() const { return static_cast<int>(offsets_.size()) - 1; }
  int64_t offset(int i) const { return offsets_[i]; }
  int64_t length(int i) const { return offsets_[i + 1] - offsets_[i]; }
  Range range(int i) const { return {offsets_[i], offsets_[i + 1]}; }

 private:
  explicit Chunking(std::vector<int64_t> offsets) : offsets_(std::move(offsets)) {}
  std::vector<int64_t> offsets_;
};

// The pieces the chunks of a phase travel in: chunk c is cut into `count` pieces on the
// bucket grid, each compressed on its own, their bytes end to end in the chunk's buffer.
// Every chunk has the same count (some pieces may be empty), so that step p of a phase
// moves piece p of every chunk. The values decoded do not depend on the count.
class PieceLayout {
 public:
  PieceLayout(const compression::LayoutCodec& codec, const Chunking& chunks, int count);

  int count() const { return count_; }
  Range range(int chunk, int piece) const { return pieces_[chunk].range(piece); }
  // Where piece `piece` of chunk `chunk` starts in the chunk's buffer, and its size.
  size_t offset(int chunk, int piece) const { return offsets_[chunk * (count_ + 1) + piece]; }
  size_t bytes(int chunk, int piece) const { return offset(chunk, piece + 1) - offset(chunk, piece); }
  // Bytes of each chunk's buffer.
  std::vector<size_t> chunk_bytes() const;

 private:
  int count_;
  std::vector<Chunking> pieces_;  // [chunk]
  std::vector<size_t> offsets_;   // [chunk * (count + 1) + piece]
};

// Values per piece of the pipeline: 2 MiB of float32, 256 KiB at 4 bits, so the pipeline
// fills after ~0.2 ms of compression (the codec's ~10 GB/s on one core). Measured on the
// 2-core VM (docs/benchmarks.md): 2^19 gave 6.77x over Gloo at 1 Gbit/s, 4 bits, 64 MiB,
// 2^21 gave 6.26x and was no better at 10 Gbit/s.
constexpr int64_t kPieceValues = int64_t{1} << 19;

// What every compressed call carries, whatever its shape (allreduce, all-gather,
// reduce-scatter): the backend builds it once per call, each entry point's options extend
// it, and each phase gets it unchanged (a new per-call setting is a field here and the
// line that sets it in the backend).
struct CallOptions {
  // Picks the stochastic-rounding streams: allgather's must be the same wherever the same
  // chunk is to come out bit-identical.
  uint64_t seed = 0;
  transport::Clock::time_point deadline;
  // Holds the values (`data` points into its memory); work on them is complete when a
  // phase returns.
  compression::Executor* executor = &compression::host_executor();
  Scratch* scratch = nullptr;  // buffers reused across calls, for the executor's thread
  // Where set (the whole buffer, in the executor's memory): every quantization this rank
  // makes adds what it dropped at the values it quantized (add_error). Over an allreduce
  // the ranks' residuals then sum to exactly what the result lacks: error feedback's
  // record, for both stages (docs/error-feedback.md).
  float* residual = nullptr;
  // Chunks travel in pieces of about this many values (0: each chunk in one piece).
  int64_t piece_values = kPieceValues;
};

// One phase of an allreduce among `chunks.parts()` ranks of `transport` (this one is
// `rank`), under its call's options.
struct Phase : CallOptions {
  ReductionAlgorithm algorithm = ReductionAlgorithm::SRA;
  // allgather: a caller forwards the bytes left in its buffers (see allgather below).
  bool keep_bytes = false;

  // The pieces of `chunks` under this phase (the same on every rank of the phase).
  PieceLayout pieces(const compression::LayoutCodec& codec, const Chunking& chunks) const;
  // Whether values travel straight from and into the buffer, not through compressed
  // bytes: an all-raw layout (the exact path) on host values, under SRA. A piece then
  // moves as its float32 values, unpadded. Same sums, same bits, fewer passes.
  bool straight(const compression::LayoutCodec& codec) const {
    return codec.all_raw() && executor->host_values() && algorithm == ReductionAlgorithm::SRA;
  }
};

Traffic reduce_scatter(transport::Transport& transport, int rank, float* data,
                       const compression::LayoutCodec& codec, const Chunking& chunks,
                       const Phase& phase, Scratch& scratch);
// `buffers[c]` has room for chunk c compressed (phase.pieces(...).chunk_bytes()); afterwards,
// where phase.keep_bytes, it holds the bytes every rank decoded chunk c from, for a caller
// that forwards them.
Traffic allgather(transport::Transport& transport, int rank, float* data,
                  const compression::LayoutCodec& codec, const Chunking& chunks,
                  const Phase& phase, const std::vector<uint8_t*>& buffers);

// reduce_scatter then allgather over the same chunks (`buffers` as allgather's, in
// another arena than `scratch`'s phases use): every rank ends with every chunk's sum.
// SRA runs the two as one pipeline (sra_allreduce_chunks); the results are the same bits
// as the two phases one after the other.
Traffic allreduce_chunks(transport::Transport& transport, int rank, float* data,
                         const compression::LayoutCodec& codec, const Chunking& chunks,
                         const Phase& phase, Scratch& scratch, const std::vector<uint8_t*>& buffers);

// The phases of each algorithm (one file each).
Traffic sra_reduce_scatter(transport::Transport& transport, int rank, float* data,
                           const compression::LayoutCodec& codec, const Chunking& chunks,
                           const Phase& phase, Scratch& scratch);
Traffic sra_allgather(transport::Transport& transport, int rank, float* data,
                      const compression::LayoutCodec& codec, const Chunking& chunks,
                      const Phase& phase, const std::vector<uint8_t*>& buffers);
Traffic sra_allreduce_chunks(transport::Transport& transport, int rank, float* data,
                             const compression::LayoutCodec& codec, const Chunking& chunks,
                             const Phase& phase, Scratch& scratch,
                             const std::vector<uint8_t*>& buffers);
Traffic ring_reduce_scatter(transport::Transport& transport, int rank, float* data,
                            const compression::LayoutCodec& codec, const Chunking& chunks,
                            const Phase& phase, Scratch& scratch);
Traffic ring_allgather(transport::Transport& transport, int rank, float* data,
                       const compression::LayoutCodec& codec, const Chunking& chunks,
                       const Phase& phase, const std::vector<uint8_t*>& buffers);

// A distinct stochastic-rounding seed for each (call, compressing rank, stage, chunk).
uint64_t stream_seed(uint64_t call_seed, int rank, int stage, int chunk);

// The owner of a chunk quantizes it (or a piece of it) once and decodes it in place, so
// that it keeps exactly what the others will decode from `dst` (both allgathers); adds
// what it dropped to `residual` where set (Phase::residual).
void quantize_owned_chunk(compression::Executor& executor, const compression::LayoutCodec& codec,
                          float* data, Range chunk, uint8_t* dst, uint64_t seed, float* residual);

}  // namespace cgx::collectives
