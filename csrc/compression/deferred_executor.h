// Host values, processed the way a GPU stream processes them: operations are queued and
// run at sync(), in order, and the bytes a compress will write read as garbage until
// then. A debugging mode (CGX_DEBUG_DEFERRED_EXECUTION): an algorithm that touches
// compressed bytes or values before the sync() the executor contract asks for
// (executor.h) gives wrong results on the host too, where tests run without a GPU.
#pragma once

#include <functional>
#include <vector>

#include "compression/executor.h"

namespace cgx::compression {

class DeferredExecutor final : public Executor {
 public:
  void compress(const LayoutCodec& codec, const float* data, int64_t begin, int64_t end,
                uint8_t* dst, uint64_t seed) override;
  void decompress(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                  float* data) override;
  void decompress_add(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                      float* data) override;
  void add_error(const LayoutCodec& codec, const uint8_t* src, int64_t begin, int64_t end,
                 const float* values, float* residual) override;
  void sync() override;

 private:
  // The codec must outlive the operation, as it does a phase (phases end synced).
  std::vector<std::function<void()>> queue_;
};

}  // namespace cgx::compression
