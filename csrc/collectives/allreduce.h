// Compressed allreduce of a float32 buffer, written against Transport and the codec only.
#pragma once

#include <cstdint>
#include <vector>

#include "compression/layout_codec.h"
#include "transport/transport.h"

namespace cgx::collectives {

enum class ReductionAlgorithm { SRA, Ring };

struct AllreduceOptions {
  ReductionAlgorithm algorithm = ReductionAlgorithm::SRA;
  // Stochastic-rounding stream of this call; identical on all ranks, different per call.
  uint64_t seed = 0;
  transport::Clock::time_point deadline;
};

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
  // Returns `count` byte buffers of the given sizes, valid until the next call.
  std::vector<uint8_t*> buffers(const std::vector<size_t>& sizes);

 private:
  std::vector<uint8_t> arena_;
};

// data[0, codec.total()) on every rank becomes the sum over ranks, each segment quantized
// as the codec's layout says (docs/algorithms.md); afterwards every rank holds
// bit-identical values. `rank` and `size`
// are the group's. Throws TimeoutError (transport) at the deadline.
Traffic allreduce(transport::Transport& transport, int rank, int size, float* data,
                  const compression::LayoutCodec& codec, const AllreduceOptions& options,
                  Scratch& scratch);

// The two algorithms (one file each).
Traffic sra_allreduce(transport::Transport& transport, int rank, int size, float* data,
                      const compression::LayoutCodec& codec, const AllreduceOptions& options,
                      Scratch& scratch);
Traffic ring_allreduce(transport::Transport& transport, int rank, int size, float* data,
                       const compression::LayoutCodec& codec, const AllreduceOptions& options,
                       Scratch& scratch);

// Splits the codec's buffer into `parts` chunks of about equal size, cut only where no
// quantization bucket is split: a chunk quantizes each layer on the layer's own bucket
// grid, whoever compresses it. Chunk i is [offset(i), offset(i+1)).
class Chunking {
 public:
  Chunking(const compression::LayoutCodec& codec, int parts);
  int64_t offset(int i) const { return offsets_[i]; }
  int64_t length(int i) const { return offsets_[i + 1] - offsets_[i]; }

 private:
  std::vector<int64_t> offsets_;
};

// A distinct stochastic-rounding seed for each (call, compressing rank, stage, chunk).
uint64_t stream_seed(uint64_t call_seed, int rank, int stage, int chunk);

}  // namespace cgx::collectives
