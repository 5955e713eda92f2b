// The CUDA emulation's launches, warps, conversions and runtime calls (cuda_emulation.h).
#include "cuda_emulation.h"

#include <ucontext.h>

#include <algorithm>
#include <bit>
#include <cstdlib>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace cuda_emulation {

namespace {

constexpr int kWarpSize = 32;
constexpr unsigned kMaxBlockThreads = 1024;
// Kernel frames are small; this leaves room for the test runner's checks in a lane too.
constexpr size_t kLaneStackBytes = 256 * 1024;

// What a running thread sees as its built-in variables.
struct ThreadIndices {
  uint3 thread_idx;
  uint3 block_idx;
  dim3 block_dim;
  dim3 grid_dim;
};

enum class LaneState { kRunnable, kWaiting, kExited };

struct Lane {
  ucontext_t context;
  ThreadIndices indices;
  LaneState state = LaneState::kExited;
  // The intrinsic it waits in, and what it brought.
  WarpOp op = WarpOp::kAll;
  unsigned mask = 0;
  uint64_t payload = 0;
  int lane_mask = 0;
  int width = 0;
  uint64_t result = 0;
  std::exception_ptr error;
};

struct Warp {
  Lane lanes[kWarpSize];
  int size = 0;  // lanes present (a block's last warp may be short)
  ucontext_t scheduler;
  const std::function<void()>* thread = nullptr;
};

struct LaneStacks {
  std::unique_ptr<char[]> memory{new char[kWarpSize * kLaneStackBytes]};
  char* of(int lane) { return memory.get() + static_cast<size_t>(lane) * kLaneStackBytes; }
};

thread_local Warp* current_warp = nullptr;
thread_local Lane* current_lane = nullptr;
thread_local std::function<unsigned(unsigned)> grid_resize;
thread_local cudaError_t last_error = cudaSuccess;

// Device allocations: start -> size (any thread may allocate, as with a real device).
std::mutex allocations_mutex;
std::map<uintptr_t, size_t> allocations;

bool on_device(const void* pointer) {
  const auto address = reinterpret_cast<uintptr_t>(pointer);
  const std::lock_guard<std::mutex> lock(allocations_mutex);
  auto it = allocations.upper_bound(address);
  if (it == allocations.begin()) return false;
  --it;
  return address <= it->first + it->second;  // one past the end is still a pointer into it
}

void lane_main() {
  Lane& lane = *current_lane;
  try {
    (*current_warp->thread)();
  } catch (...) {
    lane.error = std::current_exception();
  }
  lane.state = LaneState::kExited;
  // Returning resumes the scheduler (uc_link).
}

std::string lane_list(unsigned lanes) {
  std::string out;
  for (int i = 0; i < kWarpSize; ++i)
    if (lanes >> i & 1u) out += (out.empty() ? "" : ",") + std::to_string(i);
  return out;
}

const char* op_name(WarpOp op) {
  switch (op) {
    case WarpOp::kShuffleXor: return "__shfl_xor_sync";
    case WarpOp::kShuffle: return "__shfl_sync";
    case WarpOp::kAll: return "__all_sync";
    case WarpOp::kSync: return "__syncwarp";
  }
  return "?";
}

// Every lane of `warp` is waiting or has exited: checks the masks, makes the exchanges,
// and marks the waiting lanes runnable with their results.
void exchange(Warp& warp) {
  unsigned waiting = 0;
  for (int i = 0; i < warp.size; ++i)
    if (warp.lanes[i].state == LaneState::kWaiting) waiting |= 1u << i;
  for (int i = 0; i < warp.size; ++i) {
    const Lane& lane = warp.lanes[i];
    if (lane.state != LaneState::kWaiting) continue;
    const auto where = [&] {
      return std::string(op_name(lane.op)) + " in lane " + std::to_string(i) + " of warp (block " +
             std::to_string(lane.indices.block_idx.x) + ", first thread " +
             std::to_string(lane.indices.thread_idx.x - i) + ")";
    };
    if (!(lane.mask >> i & 1u))
      throw WarpError(where() + ": its mask leaves the calling lane out");
    const unsigned missing = lane.mask & ~waiting;
    if (missing)
      throw WarpError(where() + ": mask names lanes " + lane_list(missing) +
                      " that are not waiting in a warp intrinsic (exited, or absent)");
    for (int j = 0; j < warp.size; ++j) {
      const Lane& other = warp.lanes[j];
      if ((lane.mask >> j & 1u) && (other.op != lane.op || other.mask != lane.mask))
        throw WarpError(where() + ": lane " + std::to_string(j) + " waits in " +
                        op_name(other.op) + " with mask " + std::to_string(other.mask) +
                        ", not the same intrinsic and mask");
    }
    if ((lane.op == WarpOp::kShuffleXor || lane.op == WarpOp::kShuffle) && lane.width != kWarpSize)
      throw WarpError(where() + ": widths other than 32 are not emulated");
  }
  for (int i = 0; i < warp.size; ++i) {
    Lane& lane = warp.lanes[i];
    if (lane.state != LaneState::kWaiting) continue;
    if (lane.op == WarpOp::kShuffleXor) {
      const int source = i ^ lane.lane_mask;
      if (source < 0 || source >= kWarpSize) {  // past the warp: CUDA gives the caller's own
        lane.result = lane.payload;
        continue;
      }
      if (!(lane.mask >> source & 1u))
        throw WarpError("__shfl_xor_sync in lane " + std::to_string(i) +
                        ": reads lane " + std::to_string(source) + ", outside its mask");
      lane.result = warp.lanes[source].payload;
    } else if (lane.op == WarpOp::kShuffle) {
      const int source = lane.lane_mask & (kWarpSize - 1);
      if (!(lane.mask >> source & 1u))
        throw WarpError("__shfl_sync in lane " + std::to_string(i) + ": reads lane " +
                        std::to_string(source) + ", outside its mask");
      lane.result = warp.lanes[source].payload;
    } else if (lane.op == WarpOp::kAll) {
      uint64_t all = 1;
      for (int j = 0; j < warp.size; ++j)
        if (lane.mask >> j & 1u) all &= warp.lanes[j].payload;
      lane.result = all;
    }
  }
  for (int i = 0; i < warp.size; ++i)
    if (warp.lanes[i].state == LaneState::kWaiting) warp.lanes[i].state = LaneState::kRunnable;
}

// Runs the `size` lanes of one warp, whose first thread is `first` of the block.
void run_warp(Warp& warp, LaneStacks& stacks, const ThreadIndices& block, unsigned first,
              int size) {
  warp.size = size;
  for (int i = 0; i < size; ++i) {
    Lane& lane = warp.lanes[i];
    lane = Lane{};
    lane.indices = block;
    const unsigned t = first + static_cast<unsigned>(i);
    lane.indices.thread_idx = {t % block.block_dim.x, t / block.block_dim.x % block.block_dim.y,
                               t / (block.block_dim.x * block.block_dim.y)};
    lane.state = LaneState::kRunnable;
    getcontext(&lane.context);
    lane.context.uc_stack.ss_sp = stacks.of(i);
    lane.context.uc_stack.ss_size = kLaneStackBytes;
    lane.context.uc_link = &warp.scheduler;
    makecontext(&lane.context, lane_main, 0);
  }
  current_warp = &warp;
  struct Leave {  // also when a lane's error or a WarpError leaves the warp
    ~Leave() { current_warp = nullptr, current_lane = nullptr; }
  } leave;
  for (;;) {
    bool ran = false;
    for (int i = 0; i < size; ++i) {
      Lane& lane = warp.lanes[i];
      if (lane.state != LaneState::kRunnable) continue;
      ran = true;
      current_lane = &lane;
      swapcontext(&warp.scheduler, &lane.context);
      if (lane.error) std::rethrow_exception(lane.error);
    }
    if (!ran) return;  // every lane has exited
    exchange(warp);
  }
}

cudaError_t check_config(const dim3& grid, const dim3& block) {
  const uint64_t threads = uint64_t{block.x} * block.y * block.z;
  if (threads == 0 || threads > kMaxBlockThreads || block.z > 64) return cudaErrorInvalidConfiguration;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
      grid.z > 65535)
    return cudaErrorInvalidConfiguration;
  return cudaSuccess;
}

}  // namespace

unsigned builtin(Builtin which, int axis) {
  if (!current_lane) throw std::logic_error("a CUDA built-in variable read outside a kernel");
  const ThreadIndices& t = current_lane->indices;
  const auto pick = [axis](auto v) { return axis == 0 ? v.x : axis == 1 ? v.y : v.z; };
  switch (which) {
    case Builtin::kThreadIdx: return pick(t.thread_idx);
    case Builtin::kBlockIdx: return pick(t.block_idx);
    case Builtin::kBlockDim: return pick(t.block_dim);
    case Builtin::kGridDim: return pick(t.grid_dim);
  }
  return 0;
}

uint64_t warp_exchange(WarpOp op, unsigned mask, uint64_t payload, int lane_mask, int width) {
  if (!current_lane) throw std::logic_error("a warp intrinsic called outside a kernel");
  Lane& lane = *current_lane;
  lane.op = op;
  lane.mask = mask;
  lane.payload = payload;
  lane.lane_mask = lane_mask;
  lane.width = width;
  lane.state = LaneState::kWaiting;
  swapcontext(&lane.context, &current_warp->scheduler);
  return lane.result;
}

cudaError_t fail(cudaError_t code) {
  last_error = code;
  return code;
}

bool is_device_pointer(const void* pointer, size_t alignment) {
  return on_device(pointer) && reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

cudaError_t launch(const cudaLaunchConfig_t& config, const std::function<void()>& thread) {
  dim3 grid = config.gridDim;
  if (grid_resize) grid.x = grid_resize(grid.x);
  const dim3 block = config.blockDim;
  if (const cudaError_t bad = check_config(grid, block); bad != cudaSuccess) return fail(bad);
  if (config.dynamicSmemBytes != 0) return fail(cudaErrorInvalidValue);  // not emulated
  const unsigned block_threads = block.x * block.y * block.z;
  LaneStacks stacks;
  Warp warp;
  warp.thread = &thread;
  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        const ThreadIndices indices{{0, 0, 0}, {x, y, z}, block, grid};
        for (unsigned first = 0; first < block_threads; first += kWarpSize)
          run_warp(warp, stacks, indices, first,
                   static_cast<int>(std::min<unsigned>(kWarpSize, block_threads - first)));
      }
  return cudaSuccess;
}

ScopedGridResize::ScopedGridResize(std::function<unsigned(unsigned)> resize) {
  grid_resize = std::move(resize);
}
ScopedGridResize::~ScopedGridResize() { grid_resize = nullptr; }

}  // namespace cuda_emulation

// ---- conversions ------------------------------------------------------------------------

float __half2float(__half h) {
  const uint32_t sign = uint32_t{h.bits & 0x8000u} << 16;
  const uint32_t exponent = h.bits >> 10 & 0x1f;
  const uint32_t mantissa = h.bits & 0x3ff;
  if (exponent == 0x1f) return std::bit_cast<float>(sign | 0x7f800000u | mantissa << 13);
  if (exponent != 0) return std::bit_cast<float>(sign | (exponent + 112) << 23 | mantissa << 13);
  // Zero or subnormal: mantissa * 2^-24, exact in float.
  const float magnitude = static_cast<float>(mantissa) * 0x1p-24f;
  return sign ? -magnitude : magnitude;
}

__half __float2half_rn(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  const uint16_t sign = static_cast<uint16_t>(u >> 16 & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return {0x7fff};
  if (a >= 0x477ff000u) return {static_cast<uint16_t>(sign | 0x7c00u)};  // >= 65520: Inf
  if (a < 0x38800000u) {
    // Below half's smallest normal (2^-14): a multiple of 2^-24, rounded to even. The
    // scaling is exact, and the result may carry into the smallest normal (0x400).
    const float units = nearbyintf(std::bit_cast<float>(a) * 0x1p24f);
    return {static_cast<uint16_t>(sign | static_cast<uint16_t>(units))};
  }
  uint32_t h = (a >> 13) - (112u << 10);
  const uint32_t dropped = a & 0x1fffu;
  if (dropped > 0x1000u || (dropped == 0x1000u && (h & 1u))) ++h;  // may carry into Inf
  return {static_cast<uint16_t>(sign | h)};
}

float __bfloat162float(__nv_bfloat16 h) { return std::bit_cast<float>(uint32_t{h.bits} << 16); }

__nv_bfloat16 __float2bfloat16_rn(float v) {
  const uint32_t u = std::bit_cast<uint32_t>(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) return {0x7fff};
  // Round the low 16 bits away, ties to even; a carry moves into the exponent (to Inf).
  return {static_cast<uint16_t>((u + 0x7fffu + (u >> 16 & 1u)) >> 16)};
}

// ---- runtime calls ----------------------------------------------------------------------

const char* cudaGetErrorString(cudaError_t code) {
  switch (code) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorIllegalAddress: return "an illegal memory access was encountered";
  }
  return "unknown error";
}

cudaError_t cudaGetLastError() { return std::exchange(cuda_emulation::last_error, cudaSuccess); }

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t) {
  if (bytes == 0) return cudaSuccess;
  if (!cuda_emulation::on_device(dst)) return cuda_emulation::fail(cudaErrorInvalidValue);
  std::memset(dst, value, bytes);
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t) {
  if (bytes == 0) return cudaSuccess;
  const bool to_device = cuda_emulation::on_device(dst);
  const bool from_device = cuda_emulation::on_device(src);
  const bool matches = kind == cudaMemcpyDefault ||
                       (kind == cudaMemcpyHostToDevice && to_device && !from_device) ||
                       (kind == cudaMemcpyDeviceToHost && !to_device && from_device) ||
                       (kind == cudaMemcpyDeviceToDevice && to_device && from_device) ||
                       (kind == cudaMemcpyHostToHost && !to_device && !from_device);
  if (!matches) return cuda_emulation::fail(cudaErrorInvalidValue);
  std::memcpy(dst, src, bytes);
  return cudaSuccess;
}
cudaError_t cudaMallocAsync(void** pointer, size_t bytes, cudaStream_t) {
  // 256-byte aligned, as cudaMalloc's memory is.
  *pointer = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  if (!*pointer) return cuda_emulation::fail(cudaErrorMemoryAllocation);
  const std::lock_guard<std::mutex> lock(cuda_emulation::allocations_mutex);
  cuda_emulation::allocations[reinterpret_cast<uintptr_t>(*pointer)] = bytes;
  return cudaSuccess;
}
cudaError_t cudaFreeAsync(void* pointer, cudaStream_t) {
  {
    const std::lock_guard<std::mutex> lock(cuda_emulation::allocations_mutex);
    if (cuda_emulation::allocations.erase(reinterpret_cast<uintptr_t>(pointer)) == 0)
      return cuda_emulation::fail(cudaErrorInvalidValue);
  }
  std::free(pointer);
  return cudaSuccess;
}
// Pinned host memory: host memory, for the copies' host side.
cudaError_t cudaHostAlloc(void** pointer, size_t bytes, unsigned) {
  *pointer = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  return *pointer ? cudaSuccess : cuda_emulation::fail(cudaErrorMemoryAllocation);
}
cudaError_t cudaFreeHost(void* pointer) {
  std::free(pointer);
  return cudaSuccess;
}

namespace {
thread_local int current_device = 0;
}
cudaError_t cudaGetDevice(int* device) {
  *device = current_device;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  if (device < 0) return cuda_emulation::fail(cudaErrorInvalidValue);
  current_device = device;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }
