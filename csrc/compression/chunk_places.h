// Sparse outer gradients' places (cgx.diloco.TopK): of each chunk of a layer's values,
// the k largest in magnitude, and their places in Elias-Fano's code (docs/diloco.md,
// "Sparse outer gradients": a place's low bits packed, then each chunk's high parts in
// unary). Torch-free; the tensor checks are in the bindings.
#pragma once

#include <cstdint>

namespace cgx::compression {

// How a layer's values split into chunks and how its places are coded.
struct ChunkPlaces {
  int64_t rows = 0;   // chunks
  int64_t width = 0;  // values a chunk holds (the last one padded with zeros to it)
  int64_t kept = 0;   // places of each chunk
  int low_bits = 0;   // a place's low bits, stored as they are; its high part in unary

  // `numel` (>= 1) values in chunks of `chunk` (one chunk where fewer), `k` of each kept;
  // floor(log2(width / kept)) low bits, the fewest bits in all.
  static ChunkPlaces of(int64_t numel, int64_t chunk, int64_t k);

  // Bits a chunk's unary high parts take: one set per place, one clear per high value passed.
  int64_t high_width() const { return kept + ((width - 1) >> low_bits) + 1; }
  int64_t low_bytes() const { return (rows * kept * low_bits + 7) / 8; }
  int64_t high_bytes() const { return (rows * high_width() + 7) / 8; }
  int64_t code_bytes() const { return low_bytes() + high_bytes(); }
};

// Of each chunk of `values` (`numel` of them; the last chunk's missing values count as
// zeros), the `kept` largest in magnitude (NaN above every number; of equal magnitudes, the
// first), in ascending order of place: their places coded into `code` (code_bytes()),
// their values into `kept_values` and their places into `places` (rows * kept each).
void select_places(const float* values, int64_t numel, const ChunkPlaces& shape, uint8_t* code,
                   float* kept_values, int64_t* places);

// The places `select_places` coded in `code` into `places` (rows * kept). False where the
// code does not hold `kept` strictly ascending places below `width` in every chunk.
bool read_places(const uint8_t* code, const ChunkPlaces& shape, int64_t* places);

}  // namespace cgx::compression
