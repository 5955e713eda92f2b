#include "collectives/allreduce.h"

#include <algorithm>
#include <stdexcept>

namespace cgx::collectives {

std::vector<uint8_t*> Scratch::buffers(const std::vector<size_t>& sizes) {
  // 64-byte aligned slices of one arena.
  constexpr size_t kAlign = 64;
  size_t total = kAlign;
  for (size_t s : sizes) total += (s + kAlign - 1) / kAlign * kAlign;
  if (arena_.size() < total) arena_.resize(total);
  auto base = reinterpret_cast<uintptr_t>(arena_.data());
  uintptr_t cursor = (base + kAlign - 1) / kAlign * kAlign;
  std::vector<uint8_t*> out;
  out.reserve(sizes.size());
  for (size_t s : sizes) {
    out.push_back(reinterpret_cast<uint8_t*>(cursor));
    cursor += (s + kAlign - 1) / kAlign * kAlign;
  }
  return out;
}

Chunking::Chunking(const compression::LayoutCodec& codec, int parts) : offsets_(parts + 1, 0) {
  const int64_t n = codec.total();
  for (int i = 1; i <= parts; ++i)
    offsets_[i] = std::max(offsets_[i - 1], codec.align_up(n / parts * i + n % parts * i / parts));
}

uint64_t stream_seed(uint64_t call_seed, int rank, int stage, int chunk) {
  // splitmix64 over the packed coordinates: cheap, and well mixed in every bit.
  uint64_t z = call_seed ^ (uint64_t(uint32_t(rank)) << 40) ^ (uint64_t(uint32_t(stage)) << 20) ^
               uint64_t(uint32_t(chunk));
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

Traffic allreduce(transport::Transport& transport, int rank, int size, float* data,
                  const compression::LayoutCodec& codec, const AllreduceOptions& options,
                  Scratch& scratch) {
  if (size == 1 || codec.total() == 0) return {};
  switch (options.algorithm) {
    case ReductionAlgorithm::SRA:
      return sra_allreduce(transport, rank, size, data, codec, options, scratch);
    case ReductionAlgorithm::Ring:
      return ring_allreduce(transport, rank, size, data, codec, options, scratch);
  }
  throw std::invalid_argument("unknown reduction algorithm");
}

}  // namespace cgx::collectives
