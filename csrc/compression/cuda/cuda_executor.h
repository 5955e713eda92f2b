// Values in the memory of one GPU, processed on one CUDA stream (compression/executor.h).
//
// A range is compressed piece by piece into a device staging buffer and copied to the
// host bytes in one transfer; decompression copies the bytes up in one transfer and
// decodes from staging. Everything is queued on the stream in issue order; only sync()
// blocks, and it waits for this stream alone, never the whole device. With pinned host
// bytes (pinned_memory()) the transfers overlap the host's work.
#pragma once

#include <cuda_runtime_api.h>

#include "compression/executor.h"

namespace cgx::compression::cuda {

class CudaExecutor final : public Executor {
 public:
  // `stream` belongs to `device` and outlives the executor. Any thread may use the
  // executor, one at a time, after bind_thread() (which each call also does).
  CudaExecutor(int device, cudaStream_t stream);
  // Frees the staging buffer on the stream; `device` must be current.
  ~CudaExecutor() override;
  CudaExecutor(const CudaExecutor&) = delete;
  CudaExecutor& operator=(const CudaExecutor&) = delete;

  void compress(const LayoutCodec& codec, const float* data, int64_t begin, int64_t end,
                uint8_t* dst, uint64_t seed) override;
  void decompress(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                  float* data) override;
  void decompress_add(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                      float* data) override;
  void add_error(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                 const float* values, float* residual) override;
  void sync() override;
  bool host_values() const override { return false; }
  // Makes `device` current for the calling thread (and leaves it so: restoring a device
  // the thread never used would create a context there).
  void bind_thread() override;

  cudaStream_t stream() const { return stream_; }

 private:
  void decode(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
              float* data, bool add);
  // A device buffer of at least `bytes`, ordered on the stream (grown, never shrunk).
  uint8_t* staging(size_t bytes);
  // Queues the copy of `bytes` host bytes from `src` to staging, which has `extra` bytes
  // of room after them; returns staging.
  uint8_t* upload(const uint8_t* src, size_t bytes, size_t extra = 0);

  int device_;
  cudaStream_t stream_;
  uint8_t* staging_ = nullptr;
  size_t staging_bytes_ = 0;
};

// Page-locked host memory, for the bytes a CudaExecutor fills and reads: its copies are
// then truly asynchronous.
HostMemory pinned_memory();

}  // namespace cgx::compression::cuda
