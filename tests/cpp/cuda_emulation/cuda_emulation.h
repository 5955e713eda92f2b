// A CPU emulation of the CUDA execution model, just enough to run cgx's CUDA codec
// (csrc/compression/cuda/quantizer_cuda.cu) and executor as host C++ in the core tests.
// Test-only; docs/cuda.md says what running them here proves and what only a GPU shows.
//
// - A launch (cudaLaunchKernelEx) runs when it is issued: block after block, and in a
//   block warp after warp. A warp's 32 lanes are fibers (ucontext). Each lane runs until
//   it reaches a warp intrinsic (__shfl_xor_sync, __shfl_sync, __all_sync, __syncwarp)
//   or exits; once no lane can go on, every lane named in a waiting lane's mask must wait
//   in the same intrinsic with the same mask, the exchange is made, and the lanes go on. A mask that leaves out its
//   caller or names a lane that is not there (exited, or elsewhere) is undefined
//   behaviour on a GPU: here it throws WarpError out of the launch.
// - Launch configurations are checked as the driver checks them (block of 1..1024
//   threads, grid within its limits).
// - Device memory is host memory that cudaMallocAsync handed out, and it is kept apart:
//   a kernel's pointer arguments must point into such an allocation and be aligned for
//   their type, and cudaMemcpyAsync's direction must match its pointers
//   (cudaErrorIllegalAddress / cudaErrorInvalidValue otherwise, where a GPU would fault
//   or copy garbage). Reads and writes past an allocation are not caught here; the tests
//   put guard bytes after their outputs.
// - A stream runs each operation when it is issued (issue order is all a stream
//   promises); the device number is only remembered.
// - __syncwarp is a meeting of the lanes like the intrinsics above: a lane that reads
//   what another wrote without one sees the writes of whichever lanes happened to run
//   first, so a missing one shows as wrong bytes (as a race would on a GPU, only always).
// - Only what the kernels use is here: no shared memory, no __syncthreads (a kernel that
//   needs them does not compile against this header).
//
// The forwarding headers beside this one (cuda_runtime.h, cuda_fp16.h, ...) make the
// CUDA sources' own #include lines resolve to it.
#pragma once

#include <math.h>  // isfinite, isnan, INFINITY in the global namespace, as device code has them

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <type_traits>
#include <utility>

// ---- qualifiers -------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline

// ---- vector types and built-in indices ---------------------------------------------------
struct uint3 {
  unsigned x, y, z;
};
struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned vx = 1, unsigned vy = 1, unsigned vz = 1) : x(vx), y(vy), z(vz) {}
};
struct alignas(8) float2 {
  float x, y;
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline float2 make_float2(float x, float y) { return {x, y}; }

// threadIdx, blockIdx, blockDim, gridDim: objects (not macros, which would also rename
// cudaLaunchConfig_t's members) whose x, y and z read the running thread's values.
namespace cuda_emulation {
enum class Builtin { kThreadIdx, kBlockIdx, kBlockDim, kGridDim };
// Throws std::logic_error outside a kernel.
unsigned builtin(Builtin which, int axis);
template <Builtin Which, int Axis>
struct Coordinate {
  operator unsigned() const { return builtin(Which, Axis); }
};
template <Builtin Which>
struct BuiltinVariable {
  Coordinate<Which, 0> x;
  Coordinate<Which, 1> y;
  Coordinate<Which, 2> z;
};
}  // namespace cuda_emulation

inline constexpr cuda_emulation::BuiltinVariable<cuda_emulation::Builtin::kThreadIdx> threadIdx{};
inline constexpr cuda_emulation::BuiltinVariable<cuda_emulation::Builtin::kBlockIdx> blockIdx{};
inline constexpr cuda_emulation::BuiltinVariable<cuda_emulation::Builtin::kBlockDim> blockDim{};
inline constexpr cuda_emulation::BuiltinVariable<cuda_emulation::Builtin::kGridDim> gridDim{};

// ---- arithmetic intrinsics (the tests build with -ffp-contract=off: no FMA) -----------
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
// PTX cvt.rzi.s32.f32: toward zero, saturating; NaN gives 0.
inline int __float2int_rz(float v) {
  if (isnan(v)) return 0;
  if (v >= 2147483648.0f) return 2147483647;
  if (v <= -2147483648.0f) return -2147483647 - 1;
  return static_cast<int>(v);
}
inline float __int_as_float(int v) { return std::bit_cast<float>(v); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline float __double2float_rn(double v) { return static_cast<float>(v); }
template <typename T>
constexpr T min(T a, T b) {
  return b < a ? b : a;
}

// ---- 16-bit floating-point types -----------------------------------------------------
// Storage only, as the kernels use them: converted to float32 on load, from it on store.
struct __half {
  uint16_t bits;
};
struct __nv_bfloat16 {
  uint16_t bits;
};
// Widening is exact. Narrowing rounds to nearest, ties to even, as PTX cvt.rn does; a NaN
// becomes the canonical 0x7fff, as the device writes it.
float __half2float(__half h);
__half __float2half_rn(float v);
float __bfloat162float(__nv_bfloat16 h);
__nv_bfloat16 __float2bfloat16_rn(float v);

// ---- warp intrinsics ------------------------------------------------------------------
namespace cuda_emulation {
enum class WarpOp { kShuffleXor, kShuffle, kAll, kSync };
// The calling lane waits until its warp exchanges (header comment); returns its result.
uint64_t warp_exchange(WarpOp op, unsigned mask, uint64_t payload, int lane_mask, int width);

// A warp intrinsic used against the rules (the header comment); thrown by the launch.
struct WarpError : std::logic_error {
  using std::logic_error::logic_error;
};
}  // namespace cuda_emulation

template <typename T>
T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t));
  uint64_t payload = 0;
  std::memcpy(&payload, &value, sizeof(T));
  payload = cuda_emulation::warp_exchange(cuda_emulation::WarpOp::kShuffleXor, mask, payload,
                                          lane_mask, width);
  std::memcpy(&value, &payload, sizeof(T));
  return value;
}
// The value of lane `source_lane` (modulo 32) for every lane.
template <typename T>
T __shfl_sync(unsigned mask, T value, int source_lane, int width = 32) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t));
  uint64_t payload = 0;
  std::memcpy(&payload, &value, sizeof(T));
  payload = cuda_emulation::warp_exchange(cuda_emulation::WarpOp::kShuffle, mask, payload,
                                          source_lane, width);
  std::memcpy(&value, &payload, sizeof(T));
  return value;
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  cuda_emulation::warp_exchange(cuda_emulation::WarpOp::kSync, mask, 0, 0, 32);
}
inline int __all_sync(unsigned mask, int predicate) {
  return static_cast<int>(cuda_emulation::warp_exchange(cuda_emulation::WarpOp::kAll, mask,
                                                        predicate != 0, 0, 32));
}

// ---- runtime API ----------------------------------------------------------------------
enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorMemoryAllocation = 2,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorIllegalAddress = 700,
};
const char* cudaGetErrorString(cudaError_t code);
// The last error a call returned on this thread, which it then forgets (as the runtime).
cudaError_t cudaGetLastError();

struct CUstream_st;
using cudaStream_t = CUstream_st*;

enum cudaMemcpyKind {
  cudaMemcpyHostToHost = 0,
  cudaMemcpyHostToDevice = 1,
  cudaMemcpyDeviceToHost = 2,
  cudaMemcpyDeviceToDevice = 3,
  cudaMemcpyDefault = 4,
};
constexpr unsigned cudaHostAllocPortable = 1;

cudaError_t cudaMemsetAsync(void* dst, int value, size_t bytes, cudaStream_t stream);
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMallocAsync(void** pointer, size_t bytes, cudaStream_t stream);
cudaError_t cudaFreeAsync(void* pointer, cudaStream_t stream);
cudaError_t cudaHostAlloc(void** pointer, size_t bytes, unsigned flags);
cudaError_t cudaFreeHost(void* pointer);
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);

struct cudaLaunchConfig_t {
  dim3 gridDim;
  dim3 blockDim;
  size_t dynamicSmemBytes = 0;
  cudaStream_t stream = nullptr;
};

namespace cuda_emulation {
// Runs `thread` once for every thread of the grid (the header comment).
cudaError_t launch(const cudaLaunchConfig_t& config, const std::function<void()>& thread);
// Whether `pointer` lies in device memory (cudaMallocAsync) and is `alignment`-aligned.
bool is_device_pointer(const void* pointer, size_t alignment);
// Records `code` as this thread's last error and returns it.
cudaError_t fail(cudaError_t code);

// Test hook: while one lives, every launch's grid.x is `resize(grid.x)` (a grid smaller
// than the work makes the grid-stride loops wrap; a larger one leaves threads idle).
class ScopedGridResize {
 public:
  explicit ScopedGridResize(std::function<unsigned(unsigned)> resize);
  ~ScopedGridResize();
  ScopedGridResize(const ScopedGridResize&) = delete;
  ScopedGridResize& operator=(const ScopedGridResize&) = delete;
};
}  // namespace cuda_emulation

// The runtime's variadic form: the arguments are converted to the kernel's parameter
// types once, as CUDA copies them to the device, pointers among them checked, and every
// thread calls the kernel.
template <typename... Params, typename... Args>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(Params...),
                               Args&&... args) {
  return [&](Params... converted) {
    const auto on_device = [](const auto& argument) {
      using Argument = std::decay_t<decltype(argument)>;
      if constexpr (std::is_pointer_v<Argument>)
        return cuda_emulation::is_device_pointer(argument,
                                                 alignof(std::remove_pointer_t<Argument>));
      return true;
    };
    if (!(on_device(converted) && ...)) return cuda_emulation::fail(cudaErrorIllegalAddress);
    return cuda_emulation::launch(*config, [&] { kernel(converted...); });
  }(std::forward<Args>(args)...);
}
