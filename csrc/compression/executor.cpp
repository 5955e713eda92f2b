#include "compression/executor.h"

#include <algorithm>
#include <cstdlib>

namespace cgx::compression {

void HostExecutor::zero(float* data, int64_t begin, int64_t end) {
  std::fill(data + begin, data + end, 0.0f);
}

HostExecutor& host_executor() {
  static HostExecutor executor;
  return executor;
}

HostMemory plain_memory() { return {std::malloc, std::free}; }

}  // namespace cgx::compression
