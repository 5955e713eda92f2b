#include "compression/executor.h"

#include <algorithm>
#include <cstdlib>

namespace cgx::compression {

HostExecutor& host_executor() {
  static HostExecutor executor;
  return executor;
}

HostMemory plain_memory() { return {std::malloc, std::free}; }

}  // namespace cgx::compression
