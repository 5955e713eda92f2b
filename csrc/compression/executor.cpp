#include "compression/executor.h"

#include <algorithm>

namespace cgx::compression {

void HostExecutor::zero(float* data, int64_t begin, int64_t end) {
  std::fill(data + begin, data + end, 0.0f);
}

HostExecutor& host_executor() {
  static HostExecutor executor;
  return executor;
}

}  // namespace cgx::compression
