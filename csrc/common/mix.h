// Small integer helpers shared by the codec and the collectives.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cgx {

// splitmix64's finalizer: cheap, and every output bit depends on every input bit.
constexpr uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Compressed pieces are padded to 16 bytes (docs/wire-format.md).
constexpr size_t round_up16(size_t x) { return (x + 15) & ~size_t{15}; }

}  // namespace cgx
