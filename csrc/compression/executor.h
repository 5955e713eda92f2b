// Where the values of a collective live, and the codec operations on them. Compressed
// bytes are always in host memory, the transports' side; the values are in host memory
// (HostExecutor) or on a GPU (cuda/cuda_executor.h).
//
// Operations may run asynchronously, in issue order: the bytes a compress writes are
// ready, the bytes a decompress reads may be overwritten, and the values may be read by
// another executor, only after sync().
#pragma once

#include <cstddef>
#include <cstdint>

#include "compression/layout_codec.h"

namespace cgx::compression {

class Executor {
 public:
  virtual ~Executor() = default;

  // The LayoutCodec operations on [begin, end) of `data` (the whole buffer).
  virtual void compress(const LayoutCodec& codec, const float* data, int64_t begin, int64_t end,
                        uint8_t* dst, uint64_t seed) = 0;
  virtual void decompress(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                          int64_t end, float* data) = 0;
  virtual void decompress_add(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                              int64_t end, float* data) = 0;
  // LayoutCodec::add_error: residual += values - decoded, for error feedback.
  virtual void add_error(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                         int64_t end, const float* values, float* residual) = 0;
  // LayoutCodec::compress_and_decode: compress, add_error where `residual` is set, and
  // decompress into `data` where `decode_in_place`. By default those calls in turn; an
  // executor may fuse them (the same bytes and values).
  virtual void compress_and_decode(const LayoutCodec& codec, float* data, int64_t begin,
                                   int64_t end, uint8_t* dst, uint64_t seed, float* residual,
                                   bool decode_in_place) {
    compress(codec, data, begin, end, dst, seed);
    if (residual) add_error(codec, dst, begin, end, data, residual);
    if (decode_in_place) decompress(codec, dst, begin, end, data);
  }
  // Readies the calling thread, before its first use of the executor or of memory it
  // needs (a CUDA executor makes its device current there).
  virtual void bind_thread() {}
  // Returns once every operation issued so far is complete.
  virtual void sync() = 0;
  // Whether the values are in host memory, where a transport can read and write them.
  virtual bool host_values() const { return true; }
};

// Values in host memory: every operation completes before it returns, its buckets split
// over up to `threads` threads (codec_threads.h). Holds nothing else, so one instance
// serves every thread.
class HostExecutor final : public Executor {
 public:
  explicit HostExecutor(int threads = 1) : threads_(threads) {}
  void compress(const LayoutCodec& codec, const float* data, int64_t begin, int64_t end,
                uint8_t* dst, uint64_t seed) override {
    codec.compress(data, begin, end, dst, seed, threads_);
  }
  void decompress(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                  float* data) override {
    codec.decompress(src, begin, end, data, threads_);
  }
  void decompress_add(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                      float* data) override {
    codec.decompress_add(src, begin, end, data, threads_);
  }
  void add_error(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                 const float* values, float* residual) override {
    codec.add_error(src, begin, end, values, residual, threads_);
  }
  void compress_and_decode(const LayoutCodec& codec, float* data, int64_t begin, int64_t end,
                           uint8_t* dst, uint64_t seed, float* residual,
                           bool decode_in_place) override {
    codec.compress_and_decode(data, begin, end, dst, seed, residual, decode_in_place, threads_);
  }
  void sync() override {}

 private:
  const int threads_;
};

// One thread's: the default of options that name no executor.
HostExecutor& host_executor();

// How the host memory that holds compressed bytes is allocated: plain (malloc), or in a
// form an executor needs (cuda::pinned_memory()).
struct HostMemory {
  void* (*allocate)(size_t bytes);
  void (*release)(void* pointer);
};
HostMemory plain_memory();

}  // namespace cgx::compression
