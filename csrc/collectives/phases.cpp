#include "collectives/phases.h"

#include "common/mix.h"

#include <algorithm>
#include <new>
#include <stdexcept>
#include <string>

namespace cgx::collectives {

Scratch::~Scratch() {
  for (const Arena& a : arenas_) memory_.release(a.memory);
}

std::vector<uint8_t*> Scratch::buffers(const std::vector<size_t>& sizes, int arena) {
  // 64-byte aligned slices of one arena.
  constexpr size_t kAlign = 64;
  size_t total = kAlign;
  for (size_t s : sizes) total += (s + kAlign - 1) / kAlign * kAlign;
  if (static_cast<int>(arenas_.size()) <= arena) arenas_.resize(arena + 1);
  Arena& a = arenas_[arena];
  if (a.bytes < total) {
    // Grown, never shrunk; the old contents need not survive.
    memory_.release(a.memory);
    a = {};
    a.memory = memory_.allocate(total);
    if (!a.memory) throw std::bad_alloc();
    a.bytes = total;
  }
  auto base = reinterpret_cast<uintptr_t>(a.memory);
  uintptr_t cursor = (base + kAlign - 1) / kAlign * kAlign;
  std::vector<uint8_t*> out;
  out.reserve(sizes.size());
  for (size_t s : sizes) {
    out.push_back(reinterpret_cast<uint8_t*>(cursor));
    cursor += (s + kAlign - 1) / kAlign * kAlign;
  }
  return out;
}

Chunking::Chunking(const compression::LayoutCodec& codec, Range range, int parts)
    : offsets_(parts + 1, range.begin) {
  const int64_t n = range.end - range.begin;
  for (int i = 1; i <= parts; ++i)
    offsets_[i] = std::min(
        range.end,
        std::max(offsets_[i - 1],
                 codec.align_up(range.begin + n / parts * i + n % parts * i / parts)));
  offsets_[parts] = range.end;
}

Chunking Chunking::to_one(Range range, int parts, int owner) {
  std::vector<int64_t> offsets(parts + 1, range.begin);
  for (int i = owner + 1; i <= parts; ++i) offsets[i] = range.end;
  return Chunking(std::move(offsets));
}

Chunking Chunking::even(Range range, int parts) {
  const int64_t n = range.end - range.begin;
  if (parts < 1 || n % parts != 0)
    throw std::invalid_argument(std::to_string(n) + " elements do not split into " +
                                std::to_string(parts) + " equal shards");
  std::vector<int64_t> offsets(parts + 1);
  for (int i = 0; i <= parts; ++i) offsets[i] = range.begin + n / parts * i;
  return Chunking(std::move(offsets));
}

uint64_t stream_seed(uint64_t call_seed, int rank, int stage, int chunk) {
  // The call seed is mixed before the coordinates join it: XORed in raw, call s ^ c's
  // chunk 0 would share call s's chunk c stream (consecutive calls differ in low bits).
  const uint64_t coordinates = (uint64_t(uint32_t(rank)) << 40) ^
                               (uint64_t(uint32_t(stage)) << 20) ^ uint64_t(uint32_t(chunk));
  return splitmix64(splitmix64(call_seed) ^ coordinates);
}

void quantize_owned_chunk(compression::Executor& executor, const compression::LayoutCodec& codec,
                          float* data, Range chunk, uint8_t* dst, uint64_t seed, float* residual) {
  executor.compress_and_decode(codec, data, chunk.begin, chunk.end, dst, seed, residual,
                               /*decode_in_place=*/true);
}

namespace {
// Each algorithm's two phases, chosen in one place.
struct AlgorithmPhases {
  decltype(&sra_reduce_scatter) reduce_scatter;
  decltype(&sra_allgather) allgather;
};

const AlgorithmPhases& phases_of(ReductionAlgorithm algorithm) {
  static const AlgorithmPhases sra{sra_reduce_scatter, sra_allgather};
  static const AlgorithmPhases ring{ring_reduce_scatter, ring_allgather};
  switch (algorithm) {
    case ReductionAlgorithm::SRA: return sra;
    case ReductionAlgorithm::Ring: return ring;
  }
  throw std::invalid_argument("unknown reduction algorithm");
}
}  // namespace

Traffic reduce_scatter(transport::Transport& transport, int rank, float* data,
                       const compression::LayoutCodec& codec, const Chunking& chunks,
                       const Phase& phase, Scratch& scratch) {
  return phases_of(phase.algorithm).reduce_scatter(transport, rank, data, codec, chunks, phase, scratch);
}

PieceLayout::PieceLayout(const compression::LayoutCodec& codec, const Chunking& chunks, int count)
    : count_(count) {
  pieces_.reserve(chunks.parts());
  offsets_.reserve(static_cast<size_t>(chunks.parts()) * (count + 1));
  for (int c = 0; c < chunks.parts(); ++c) {
    pieces_.emplace_back(codec, chunks.range(c), count);
    size_t offset = 0;
    offsets_.push_back(offset);
    for (int p = 0; p < count; ++p) {
      offset += codec.compressed_bytes(pieces_[c].offset(p), pieces_[c].offset(p + 1));
      offsets_.push_back(offset);
    }
  }
}

std::vector<size_t> PieceLayout::chunk_bytes() const {
  std::vector<size_t> sizes(pieces_.size());
  for (size_t c = 0; c < sizes.size(); ++c) sizes[c] = offset(static_cast<int>(c), count_);
  return sizes;
}

PieceLayout Phase::pieces(const compression::LayoutCodec& codec, const Chunking& chunks) const {
  // Enough pieces to overlap, few enough that each exchange stays worth its latency.
  constexpr int64_t kMaxPieces = 64;
  int64_t longest = 0;
  for (int c = 0; c < chunks.parts(); ++c) longest = std::max(longest, chunks.length(c));
  const int64_t count =
      piece_values > 0 ? std::clamp<int64_t>((longest + piece_values - 1) / piece_values, 1, kMaxPieces)
                       : 1;
  return PieceLayout(codec, chunks, static_cast<int>(count));
}

Traffic allgather(transport::Transport& transport, int rank, float* data,
                  const compression::LayoutCodec& codec, const Chunking& chunks,
                  const Phase& phase, const std::vector<uint8_t*>& buffers) {
  return phases_of(phase.algorithm).allgather(transport, rank, data, codec, chunks, phase, buffers);
}

Traffic allreduce_chunks(transport::Transport& transport, int rank, float* data,
                         const compression::LayoutCodec& codec, const Chunking& chunks,
                         const Phase& phase, Scratch& scratch, const std::vector<uint8_t*>& buffers) {
  if (phase.algorithm == ReductionAlgorithm::SRA)
    return sra_allreduce_chunks(transport, rank, data, codec, chunks, phase, scratch, buffers);
  Traffic traffic = reduce_scatter(transport, rank, data, codec, chunks, phase, scratch);
  traffic += allgather(transport, rank, data, codec, chunks, phase, buffers);
  return traffic;
}

}  // namespace cgx::collectives
