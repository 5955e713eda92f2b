// The codec a collective uses for one call: a layout of segments of the flat buffer, each
// quantized with its own settings or sent raw (a layer that stays uncompressed). The
// layout travels with the call; nothing assumes an order of calls.
//
// A range [begin, end) of the buffer compresses to the concatenation of its pieces (its
// intersections with the segments), each padded to 16 bytes, in the wire format of
// quantizer.h; raw pieces are float32 values.
#pragma once

#include <cstdint>
#include <vector>

#include "compression/quantizer.h"

namespace cgx::compression {

struct Segment {
  int64_t offset = 0;
  int64_t numel = 0;
  bool raw = false;          // sent as float32, exactly
  QuantizerParams params;    // when not raw
};

class LayoutCodec {
 public:
  // Throws std::invalid_argument unless the segments cover [0, total) in order.
  LayoutCodec(std::vector<Segment> segments, int64_t total);
  // One quantized segment covering everything.
  static LayoutCodec uniform(const QuantizerParams& params, int64_t total);
  // One raw segment covering everything: the values travel exactly.
  static LayoutCodec raw(int64_t total);
  // `one` laid `times` times end to end: the layout of a buffer of `times` shards that
  // each have the layout `one` (an all-gather's output, a reduce-scatter's input).
  static LayoutCodec repeated(const LayoutCodec& one, int times);

  int64_t total() const { return total_; }
  const std::vector<Segment>& segments() const { return segments_; }
  bool all_raw() const;

  // The first position >= pos where the buffer may be cut without splitting a
  // quantization bucket (buckets are laid from each segment's start).
  int64_t align_up(int64_t pos) const;

  size_t compressed_bytes(int64_t begin, int64_t end) const;

  // The intersection of [begin, end) with one segment, and its compressed size (padded).
  struct Piece {
    size_t segment = 0;
    int64_t begin = 0;
    int64_t numel = 0;
    size_t bytes = 0;
  };
  // In buffer order: [begin, end) compresses to their bytes, concatenated.
  std::vector<Piece> pieces(int64_t begin, int64_t end) const;
  // The stochastic-rounding seed of segment `segment` in a call seeded `seed`.
  static uint64_t segment_seed(uint64_t seed, size_t segment);

  // `data` is the whole buffer; only [begin, end) is read or written. `threads`: as many
  // as the quantizer may use (quantizer.h), the same bytes and values whatever the count.
  void compress(const float* data, int64_t begin, int64_t end, uint8_t* dst, uint64_t seed,
                int threads = 1) const;
  // compress, and in the same pass what the bytes decode to: add_error onto `residual`
  // where set, and the decoded values left in `data` where `decode_in_place`. The same
  // bytes and values as those calls one after the other, in one pass over maxmin layers
  // (hadamard layers run the calls in turn).
  void compress_and_decode(float* data, int64_t begin, int64_t end, uint8_t* dst, uint64_t seed,
                           float* residual, bool decode_in_place, int threads = 1) const;
  void decompress(const uint8_t* src, int64_t begin, int64_t end, float* data, int threads = 1) const;
  void decompress_add(const uint8_t* src, int64_t begin, int64_t end, float* data,
                      int threads = 1) const;
  // residual[i] += values[i] - decoded[i] over [begin, end), where `src` holds `values`
  // compressed: what the quantization dropped, for error feedback. Raw pieces drop
  // nothing; a value whose bucket is not finite (decodes to NaN) adds nothing, so that one
  // overflowed step does not poison every later one.
  void add_error(const uint8_t* src, int64_t begin, int64_t end, const float* values,
                 float* residual, int threads = 1) const;

 private:
  // Calls fn(segment index, piece begin, piece length) for each piece of [begin, end).
  template <typename Fn>
  void for_each_piece(int64_t begin, int64_t end, Fn&& fn) const;
  size_t piece_bytes(const Segment& s, int64_t n) const;

  std::vector<Segment> segments_;
  int64_t total_;
};

}  // namespace cgx::compression
