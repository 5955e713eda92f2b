#include "compression/deferred_executor.h"

#include <algorithm>
#include <cstring>

namespace cgx::compression {

namespace {
constexpr uint8_t kNotYetWritten = 0xA5;
}  // namespace

void DeferredExecutor::compress(const LayoutCodec& codec, const float* data, int64_t begin,
                                int64_t end, uint8_t* dst, uint64_t seed) {
  std::memset(dst, kNotYetWritten, codec.compressed_bytes(begin, end));
  queue_.push_back([&codec, data, begin, end, dst, seed] {
    codec.compress(data, begin, end, dst, seed);
  });
}

void DeferredExecutor::decompress(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                                  int64_t end, float* data) {
  queue_.push_back([&codec, src, begin, end, data] { codec.decompress(src, begin, end, data); });
}

void DeferredExecutor::decompress_add(const LayoutCodec& codec, const uint8_t* src,
                                      int64_t begin, int64_t end, float* data) {
  queue_.push_back(
      [&codec, src, begin, end, data] { codec.decompress_add(src, begin, end, data); });
}

void DeferredExecutor::add_error(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                                 int64_t end, const float* values, float* residual) {
  queue_.push_back([&codec, src, begin, end, values, residual] {
    codec.add_error(src, begin, end, values, residual);
  });
}

void DeferredExecutor::sync() {
  for (auto& op : queue_) op();
  queue_.clear();
}

}  // namespace cgx::compression
