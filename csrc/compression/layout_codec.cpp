#include "compression/layout_codec.h"

#include "common/mix.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

namespace cgx::compression {

uint64_t LayoutCodec::segment_seed(uint64_t seed, size_t segment) {
  // A distinct stream per segment.
  return splitmix64(seed + 0x9e3779b97f4a7c15ULL * segment);
}

LayoutCodec::LayoutCodec(std::vector<Segment> segments, int64_t total)
    : segments_(std::move(segments)), total_(total) {
  int64_t expected = 0;
  for (size_t i = 0; i < segments_.size(); ++i) {
    const auto& s = segments_[i];
    if (s.offset != expected || s.numel < 0)
      throw std::invalid_argument("layout segment " + std::to_string(i) + " covers [" +
                                  std::to_string(s.offset) + ", " +
                                  std::to_string(s.offset + s.numel) + "), expected it to start at " +
                                  std::to_string(expected) + " with numel >= 0");
    if (!s.raw) validate(s.params);
    // Checked before adding: a huge numel from Python must not wrap the running sum.
    if (s.numel > total - expected)
      throw std::invalid_argument("layout segment " + std::to_string(i) + " ends past the " +
                                  std::to_string(total) + " elements of the tensor");
    expected += s.numel;
  }
  if (expected != total)
    throw std::invalid_argument("layout covers " + std::to_string(expected) +
                                " elements, the tensor has " + std::to_string(total));
}

LayoutCodec LayoutCodec::uniform(const QuantizerParams& params, int64_t total) {
  Segment s;
  s.numel = total;
  s.params = params;
  return LayoutCodec({s}, total);
}

LayoutCodec LayoutCodec::raw(int64_t total) {
  Segment s;
  s.numel = total;
  s.raw = true;
  return LayoutCodec({s}, total);
}

LayoutCodec LayoutCodec::repeated(const LayoutCodec& one, int times) {
  std::vector<Segment> segments;
  segments.reserve(one.segments_.size() * std::max(times, 0));
  for (int t = 0; t < times; ++t)
    for (Segment s : one.segments_) {
      s.offset += t * one.total_;
      segments.push_back(s);
    }
  return LayoutCodec(std::move(segments), one.total_ * std::max(times, 0));
}

bool LayoutCodec::all_raw() const {
  return std::all_of(segments_.begin(), segments_.end(), [](const Segment& s) { return s.raw; });
}

int64_t LayoutCodec::align_up(int64_t pos) const {
  if (pos >= total_) return total_;
  auto it = std::upper_bound(segments_.begin(), segments_.end(), pos,
                             [](int64_t v, const Segment& s) { return v < s.offset + s.numel; });
  if (it->raw || pos <= it->offset) return std::max(pos, it->offset);
  const int64_t bucket = it->params.bucket_size;
  const int64_t into = pos - it->offset;
  return std::min(it->offset + it->numel, it->offset + (into + bucket - 1) / bucket * bucket);
}

template <typename Fn>
void LayoutCodec::for_each_piece(int64_t begin, int64_t end, Fn&& fn) const {
  // First segment ending after `begin` (segments are sorted and contiguous).
  auto it = std::upper_bound(segments_.begin(), segments_.end(), begin,
                             [](int64_t v, const Segment& s) { return v < s.offset + s.numel; });
  for (; it != segments_.end() && it->offset < end; ++it) {
    const int64_t from = std::max(begin, it->offset);
    const int64_t to = std::min(end, it->offset + it->numel);
    if (to > from) fn(static_cast<size_t>(it - segments_.begin()), from, to - from);
  }
}

size_t LayoutCodec::piece_bytes(const Segment& s, int64_t n) const {
  return round_up16(s.raw ? n * sizeof(float) : compression::compressed_bytes(s.params, n));
}

size_t LayoutCodec::compressed_bytes(int64_t begin, int64_t end) const {
  size_t bytes = 0;
  for_each_piece(begin, end, [&](size_t i, int64_t, int64_t n) { bytes += piece_bytes(segments_[i], n); });
  return bytes;
}

std::vector<LayoutCodec::Piece> LayoutCodec::pieces(int64_t begin, int64_t end) const {
  std::vector<Piece> out;
  for_each_piece(begin, end, [&](size_t i, int64_t from, int64_t n) {
    out.push_back({i, from, n, piece_bytes(segments_[i], n)});
  });
  return out;
}

void LayoutCodec::compress(const float* data, int64_t begin, int64_t end, uint8_t* dst,
                           uint64_t seed, int threads) const {
  for_each_piece(begin, end, [&](size_t i, int64_t from, int64_t n) {
    const auto& s = segments_[i];
    const size_t bytes = piece_bytes(s, n);
    if (s.raw) {
      std::memcpy(dst, data + from, n * sizeof(float));
      std::memset(dst + n * sizeof(float), 0, bytes - n * sizeof(float));
    } else {
      const size_t used = compression::compressed_bytes(s.params, n);
      compression::compress(s.params, data + from, n, dst, segment_seed(seed, i), from - s.offset, threads);
      std::memset(dst + used, 0, bytes - used);
    }
    dst += bytes;
  });
}

void LayoutCodec::compress_and_decode(float* data, int64_t begin, int64_t end, uint8_t* dst,
                                      uint64_t seed, float* residual, bool decode_in_place,
                                      int threads) const {
  for_each_piece(begin, end, [&](size_t i, int64_t from, int64_t n) {
    const auto& s = segments_[i];
    const size_t bytes = piece_bytes(s, n);
    if (s.raw) {  // decodes to itself, drops nothing
      std::memcpy(dst, data + from, n * sizeof(float));
      std::memset(dst + n * sizeof(float), 0, bytes - n * sizeof(float));
    } else if (!rule_of(s.params.scheme).fused_compress_and_decode) {  // the calls in turn
      compress(data, from, from + n, dst, seed, threads);
      if (residual) add_error(dst, from, from + n, data, residual, threads);
      if (decode_in_place) decompress(dst, from, from + n, data, threads);
    } else {
      const size_t used = compression::compressed_bytes(s.params, n);
      compression::compress_and_decode(s.params, data + from, n, dst, segment_seed(seed, i),
                                       from - s.offset, residual ? residual + from : nullptr,
                                       decode_in_place, threads);
      std::memset(dst + used, 0, bytes - used);
    }
    dst += bytes;
  });
}

void LayoutCodec::decompress(const uint8_t* src, int64_t begin, int64_t end, float* data,
                             int threads) const {
  for_each_piece(begin, end, [&](size_t i, int64_t from, int64_t n) {
    const auto& s = segments_[i];
    if (s.raw)
      std::memcpy(data + from, src, n * sizeof(float));
    else
      compression::decompress(s.params, src, n, data + from, threads);
    src += piece_bytes(s, n);
  });
}

void LayoutCodec::decompress_add(const uint8_t* src, int64_t begin, int64_t end, float* data,
                                 int threads) const {
  for_each_piece(begin, end, [&](size_t i, int64_t from, int64_t n) {
    const auto& s = segments_[i];
    if (s.raw) {
      const auto* values = reinterpret_cast<const float*>(src);  // 16-byte aligned piece
      for (int64_t k = 0; k < n; ++k) data[from + k] += values[k];
    } else {
      compression::decompress_add(s.params, src, n, data + from, threads);
    }
    src += piece_bytes(s, n);
  });
}

void LayoutCodec::add_error(const uint8_t* src, int64_t begin, int64_t end, const float* values,
                            float* residual, int threads) const {
  thread_local std::vector<float> decoded;
  for_each_piece(begin, end, [&](size_t i, int64_t from, int64_t n) {
    const auto& s = segments_[i];
    if (!s.raw) {
      decoded.resize(static_cast<size_t>(n));
      compression::decompress(s.params, src, n, decoded.data(), threads);
      for (int64_t k = 0; k < n; ++k) {
        const float dropped = values[from + k] - decoded[k];
        if (std::isfinite(dropped)) residual[from + k] += dropped;
      }
    }
    src += piece_bytes(s, n);
  });
}

}  // namespace cgx::compression
