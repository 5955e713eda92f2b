// The CUDA codec's kernels and executor (csrc/compression/cuda), run on the CPU through the
// emulation in cuda_emulation/, against the CPU codec: the same bytes and the same decoded
// bits. The launches are the codec's own (its blocks_for and kThreads); ScopedGridResize
// shrinks or grows their grids to make the grid-stride loops wrap or threads idle. What
// the kernels read and write is emulated device memory, filled and read back by copies,
// so a host pointer handed to a kernel, or a copy the wrong way, fails.
//
// NaN compares as a class (both NaN), not by its bits: a GPU's float and half arithmetic
// writes the canonical NaN where x86 keeps an operand's, so NaN payloads differ between
// CPU and GPU runs by design. The compressed bytes, NaN buckets included, compare exactly.
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "check.h"
#include "compression/cuda/cuda_executor.h"
#include "compression/cuda/quantizer_cuda.h"
#include "compression/executor.h"
#include "compression/quantizer.h"
#include "cuda_emulation.h"
#include "fixtures.h"

namespace cgx::test {
namespace {

using compression::QuantizerParams;
using compression::cuda::DType;

constexpr float kMax = std::numeric_limits<float>::max();
constexpr float kInf = std::numeric_limits<float>::infinity();
const float kNaN = std::numeric_limits<float>::quiet_NaN();
// Bytes past every output, which no thread may write.
constexpr size_t kGuard = 64;
constexpr uint8_t kGuardByte = 0xa5;

uint32_t bits_of(float v) { return std::bit_cast<uint32_t>(v); }
float float_of(uint32_t u) { return std::bit_cast<float>(u); }

// ---- reference conversions, written apart from the emulation's -------------------------

// The compiler's IEEE binary16 (round to nearest even).
uint16_t half_reference(float v) { return std::bit_cast<uint16_t>(static_cast<_Float16>(v)); }
float half_widened(uint16_t bits) { return static_cast<float>(std::bit_cast<_Float16>(bits)); }
// bfloat16 by definition: of the two neighbours that keep the top 16 bits, the nearer;
// on a tie the even one. The neighbour above the largest finite one is Inf, which counts
// as 2^128 for the distance (IEEE overflow).
uint16_t bfloat16_reference(float v) {
  if (std::isnan(v)) return 0x7fff;
  const uint32_t u = bits_of(v);
  const uint32_t low = u & 0xffff0000u;
  const uint32_t high = low + 0x10000u;
  const double magnitude = std::fabs(static_cast<double>(v));
  const double low_value = std::fabs(static_cast<double>(float_of(low)));
  const double high_value = (high & 0x7f800000u) == 0x7f800000u
                                ? std::ldexp(1.0, 128)
                                : std::fabs(static_cast<double>(float_of(high)));
  if (std::isinf(v)) return static_cast<uint16_t>(u >> 16);
  const double below = magnitude - low_value, above = high_value - magnitude;
  const bool up = above < below || (above == below && (low >> 16 & 1u));
  return static_cast<uint16_t>((up ? high : low) >> 16);
}
float bfloat16_widened(uint16_t bits) { return float_of(uint32_t{bits} << 16); }

bool is_nan16(uint16_t bits, DType dtype) {
  return dtype == DType::Float16 ? (bits & 0x7c00u) == 0x7c00u && (bits & 0x3ffu)
                                 : (bits & 0x7f80u) == 0x7f80u && (bits & 0x7fu);
}
uint16_t narrowed(float v, DType dtype) {
  return dtype == DType::Float16 ? half_reference(v) : bfloat16_reference(v);
}
float widened(uint16_t bits, DType dtype) {
  return dtype == DType::Float16 ? half_widened(bits) : bfloat16_widened(bits);
}
const char* name_of(DType dtype) {
  return dtype == DType::Float32 ? "float32" : dtype == DType::Float16 ? "float16" : "bfloat16";
}

// Values stored in a dtype (`f32`, or the float16 or bfloat16 bits in `narrow`) for the
// kernels, and `exact` (float32, exact) for the CPU codec, as the CPU path widens before
// it compresses.
struct Values {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> narrow;
  std::vector<float> exact;
  size_t element_bytes() const { return dtype == DType::Float32 ? 4 : 2; }
  const void* stored() const {
    return dtype == DType::Float32 ? static_cast<const void*>(f32.data()) : narrow.data();
  }
};

Values store(const std::vector<float>& values, DType dtype) {
  Values out{dtype, {}, {}, {}};
  if (dtype == DType::Float32) {
    out.f32 = out.exact = values;
    return out;
  }
  for (float v : values) {
    out.narrow.push_back(narrowed(v, dtype));
    out.exact.push_back(widened(out.narrow.back(), dtype));
  }
  return out;
}

// Normal values, with a -0 and a constant run.
std::vector<float> test_values(int64_t n, uint32_t seed) {
  std::vector<float> v = random_values(n, seed);
  if (n > 3) v[3] = -0.0f;
  for (int64_t i = n / 3; i < n / 3 + n / 8; ++i) v[i] = 0.25f;
  return v;
}

std::string describe(const QuantizerParams& p, int64_t n, DType dtype) {
  return std::string(name_of(dtype)) + " " + compression::scheme_name(p.scheme) + " n=" + std::to_string(n) + " bits=" +
         std::to_string(p.bits) + " bucket=" + std::to_string(p.bucket_size) +
         (p.skip_incomplete_buckets ? " skip-incomplete" : "") +
         (p.stochastic ? " stochastic" : "");
}

// An allocation on the emulated device, filled from the host and read back by copies.
template <typename T>
class DeviceArray {
 public:
  explicit DeviceArray(const std::vector<T>& host) : size_(host.size()) {
    void* p = nullptr;
    CHECK_EQ(cudaMallocAsync(&p, allocated_bytes(), nullptr), cudaSuccess);
    data_ = static_cast<T*>(p);
    CHECK_EQ(cudaMemcpyAsync(data_, host.data(), size_ * sizeof(T), cudaMemcpyHostToDevice, nullptr),
             cudaSuccess);
  }
  ~DeviceArray() { cudaFreeAsync(data_, nullptr); }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  T* data() { return data_; }
  std::vector<T> host() const {
    std::vector<T> out(size_);
    CHECK_EQ(cudaMemcpyAsync(out.data(), data_, size_ * sizeof(T), cudaMemcpyDeviceToHost, nullptr),
             cudaSuccess);
    return out;
  }

 private:
  size_t allocated_bytes() const { return std::max<size_t>(size_, 1) * sizeof(T); }
  T* data_ = nullptr;
  size_t size_;
};

// x's stored values on the device, `shift` elements after the allocation's start (a
// shift of 1 leaves every group of 8 unaligned for the kernels' 16-byte loads).
DeviceArray<uint8_t> on_device(const Values& x, size_t shift) {
  std::vector<uint8_t> bytes(shift * x.element_bytes());
  const auto* stored = static_cast<const uint8_t*>(x.stored());
  bytes.insert(bytes.end(), stored, stored + x.exact.size() * x.element_bytes());
  return DeviceArray<uint8_t>(bytes);
}

// The emulated compress (of x stored `shift` elements into its allocation) writes the CPU
// codec's bytes, and nothing past them.
std::vector<uint8_t> check_compress(const QuantizerParams& params, const Values& x,
                                    uint64_t seed, uint64_t offset, const std::string& what,
                                    size_t shift = 0) {
  const int64_t n = static_cast<int64_t>(x.exact.size());
  const size_t bytes = compression::compressed_bytes(params, n);
  std::vector<uint8_t> cpu(bytes);
  compression::compress(params, x.exact.data(), n, cpu.data(), seed, offset);
  DeviceArray<uint8_t> src = on_device(x, shift);
  // Every byte must be written: none may keep the guard's value by chance of the test.
  DeviceArray<uint8_t> dst(std::vector<uint8_t>(bytes + kGuard, kGuardByte));
  compression::cuda::compress(params, src.data() + shift * x.element_bytes(), x.dtype, n,
                              dst.data(), seed, offset, nullptr);
  const std::vector<uint8_t> gpu = dst.host();
  for (size_t i = 0; i < bytes; ++i)
    if (gpu[i] != cpu[i])
      fail(__FILE__, __LINE__,
           what + ": byte " + std::to_string(i) + " of " + std::to_string(bytes) + " is " +
               std::to_string(gpu[i]) + ", the CPU codec wrote " + std::to_string(cpu[i]));
  for (size_t i = bytes; i < gpu.size(); ++i)
    if (gpu[i] != kGuardByte) fail(__FILE__, __LINE__, what + ": wrote past the buffer");
  return cpu;
}

// Whether a decoded output equals `expected` made in float32 and stored once in the
// output's dtype (NaN as a class).
bool same_value(float got, float expected, DType) {
  return bits_of(got) == bits_of(expected) || (std::isnan(got) && std::isnan(expected));
}
bool same_value(uint16_t got, float expected, DType dtype) {
  const uint16_t want = narrowed(expected, dtype);
  return got == want || (is_nan16(got, dtype) && is_nan16(want, dtype));
}
uint32_t stored_bits(float v) { return bits_of(v); }
uint32_t stored_bits(uint16_t v) { return v; }

// The emulated decode (into `out_dtype`, stored as Stored `shift` elements into its
// allocation; added to `base` or not) gives the CPU codec's decoded values, the sum made in
// float32 and rounded once to the output dtype, and leaves the `guard` values before and
// after them alone.
template <typename Stored>
void check_decode_into(const QuantizerParams& params, DeviceArray<uint8_t>& src, int64_t n,
                       const Values& base, const std::vector<Stored>& base_stored,
                       const std::vector<float>& decoded, bool add, Stored guard, size_t shift,
                       const std::string& where) {
  std::vector<Stored> initial(shift, guard);
  initial.insert(initial.end(), base_stored.begin(), base_stored.end());
  initial.resize(shift + n + kGuard, guard);
  DeviceArray<Stored> on_gpu(initial);
  compression::cuda::decompress(params, src.data(), n, on_gpu.data() + shift, base.dtype, add,
                                nullptr);
  const std::vector<Stored> all = on_gpu.host();
  for (size_t i = 0; i < shift; ++i)
    if (stored_bits(all[i]) != stored_bits(guard)) fail(__FILE__, __LINE__, where + ": wrote before the values");
  const Stored* dst = all.data() + shift;
  for (int64_t i = 0; i < n; ++i)
    if (!same_value(dst[i], add ? base.exact[i] + decoded[i] : decoded[i], base.dtype))
      fail(__FILE__, __LINE__, where + ": value " + std::to_string(i) + " has bits " +
                                   std::to_string(stored_bits(dst[i])));
  for (int64_t i = n; i < n + static_cast<int64_t>(kGuard); ++i)
    if (stored_bits(dst[i]) != stored_bits(guard)) fail(__FILE__, __LINE__, where + ": wrote past the values");
}

// `shift`: as check_compress's (1 leaves every group unaligned for the 16-byte stores).
void check_decompress(const QuantizerParams& params, const std::vector<uint8_t>& bytes,
                      int64_t n, DType out_dtype, bool add, const std::string& what,
                      size_t shift = 0) {
  std::vector<float> decoded(static_cast<size_t>(n));
  compression::decompress(params, bytes.data(), n, decoded.data());
  const Values base = store(random_values(n, 99), out_dtype);
  const std::string where = what + " into " + name_of(out_dtype) + (add ? ", added" : "") +
                            (shift ? ", unaligned" : "");
  DeviceArray<uint8_t> src(bytes);
  if (out_dtype == DType::Float32)
    check_decode_into(params, src, n, base, base.f32, decoded, add, 7.0f, shift, where);
  else
    check_decode_into(params, src, n, base, base.narrow, decoded, add, uint16_t{0x1234}, shift, where);
}

QuantizerParams params_of(int bits, int64_t bucket, bool skip, bool stochastic,
                          compression::Scheme scheme = compression::Scheme::kMaxMin) {
  QuantizerParams p;
  p.bits = bits;
  p.bucket_size = bucket;
  p.skip_incomplete_buckets = skip;
  p.stochastic = stochastic;
  p.scheme = scheme;
  return p;
}
QuantizerParams hadamard_of(int bits, int64_t bucket, bool skip, bool stochastic) {
  return params_of(bits, bucket, skip, stochastic, compression::Scheme::kHadamard);
}

// Sizes and bucket sizes: buckets of 1, 7, a warp (32) and one more, 512 and 513, and
// buckets a warp's lanes cross many times (2000, 4099); counts that are multiples of
// nothing, shorter than a bucket, a group of 8, a warp, and none at all. Whole buckets of
// 256, 512 and 1024 are encoded in registers in one pass (the last three shapes: several
// of them, then a shorter last bucket or none); other sizes by bucket_meta and
// quantize_pack.
struct Shape {
  int64_t n;
  int64_t bucket;
};
const Shape kShapes[] = {{1, 1},      {7, 7},       {9, 7},       {100, 1},   {33, 32},
                         {95, 33},    {1000, 512},  {1029, 513},  {5001, 2000}, {9001, 4099},
                         {4, 512},    {2049, 32},   {0, 7},       {5 * 256 + 3, 256},
                         {3 * 1024, 1024}, {9 * 512 + 100, 512}};

// The hadamard scheme's shapes (buckets are powers of two, 8..65536): whole buckets only,
// a shorter last bucket (maxmin inside the buffer, its pair at an odd float offset after 1
// or 3 rms), fewer values than a bucket, a bucket smaller than a warp's 32 lanes, buckets a
// warp's lanes cross many times, the largest bucket, and no values. 256, 512 and 1024 are
// the sizes rotated in registers (8, 16 and 32 values a lane), the others in scratch.
const Shape kHadamardShapes[] = {{1024, 512},       {1500, 512}, {3 * 64 + 5, 64}, {100, 512},
                                 {8, 8},            {77, 16},    {9000, 4096},    {65536 + 9, 65536},
                                 {0, 8},            {5 * 256 + 13, 256}, {3 * 1024 + 8, 1024},
                                 {2 * 128 + 3, 128}, {2048, 2048}};

}  // namespace

CGX_TEST(cuda_emulation_meets_lanes_at_warp_intrinsics_and_refuses_what_a_gpu_would) {
  using cuda_emulation::WarpError;
  // A butterfly sum: every lane ends with the sum of its warp's lane numbers.
  DeviceArray<int> sums(std::vector<int>(96, -1));
  const auto butterfly = +[](int* out, unsigned mask) {
    int v = static_cast<int>(threadIdx.x % 32);
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(mask, v, offset);
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
  };
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(3);
  config.blockDim = dim3(32);
  CHECK_EQ(cudaLaunchKernelEx(&config, butterfly, sums.data(), 0xffffffffu), cudaSuccess);
  for (int s : sums.host()) CHECK_EQ(s, 496);
  // A mask without the caller, one naming lanes that exited, and a lane in another
  // intrinsic: WarpError, not a hang.
  CHECK_THROWS(cudaLaunchKernelEx(&config, butterfly, sums.data(), 0x0000ffffu), WarpError);
  const auto early_exit = +[](int* out) {
    if (threadIdx.x == 5) return;
    out[threadIdx.x] = __all_sync(0xffffffffu, 1);
  };
  CHECK_THROWS(cudaLaunchKernelEx(&config, early_exit, sums.data()), WarpError);
  const auto mixed = +[](int* out) {
    out[threadIdx.x] = threadIdx.x % 2 ? __all_sync(0xffffffffu, 1)
                                       : __shfl_xor_sync(0xffffffffu, 1, 1);
  };
  CHECK_THROWS(cudaLaunchKernelEx(&config, mixed, sums.data()), WarpError);
  // __shfl_sync: every lane reads lane `source` (modulo 32); a source outside the mask
  // is refused.
  const auto broadcast = +[](int* out, int source, unsigned mask) {
    if (mask >> (threadIdx.x % 32) & 1u)
      out[blockIdx.x * blockDim.x + threadIdx.x] = __shfl_sync(mask, static_cast<int>(threadIdx.x) * 3, source);
  };
  CHECK_EQ(cudaLaunchKernelEx(&config, broadcast, sums.data(), 32 + 7, 0xffffffffu), cudaSuccess);
  for (int s : sums.host()) CHECK_EQ(s, 21);
  CHECK_THROWS(cudaLaunchKernelEx(&config, broadcast, sums.data(), 20, 0x0000ffffu), WarpError);
  // __syncwarp orders a warp's lanes: each reads, after it, what its neighbour wrote
  // before. Without it the lanes run one after another here, and lane 0 reads its
  // neighbour's old value (a race on a GPU, certain here).
  const auto rotate = +[](int* out, bool sync) {
    const unsigned me = blockIdx.x * blockDim.x + threadIdx.x, lane = me % 32;
    out[me] = static_cast<int>(lane) + 100;
    if (sync) __syncwarp();
    const int neighbour = out[me - lane + (lane + 1) % 32];
    if (sync) __syncwarp();
    out[me] = neighbour;
  };
  CHECK_EQ(cudaLaunchKernelEx(&config, rotate, sums.data(), true), cudaSuccess);
  for (int i = 0; i < 96; ++i) CHECK_EQ(sums.host()[i], (i % 32 + 1) % 32 + 100);
  CHECK_EQ(cudaLaunchKernelEx(&config, rotate, sums.data(), false), cudaSuccess);
  CHECK(sums.host()[0] != 101);
  const auto sync_or_all = +[](int* out) {
    if (threadIdx.x % 2) __syncwarp(); else out[threadIdx.x] = __all_sync(0xffffffffu, 1);
  };
  CHECK_THROWS(cudaLaunchKernelEx(&config, sync_or_all, sums.data()), WarpError);
  // __all_sync over half a warp, the other half never calling it: defined, and emulated.
  const auto half_warp = +[](int* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __all_sync(0x0000ffffu, threadIdx.x != 3);
  };
  CHECK_EQ(cudaLaunchKernelEx(&config, half_warp, sums.data()), cudaSuccess);
  CHECK_EQ(sums.host()[0], 0);
  // Host memory or a misaligned pointer handed to a kernel, and copies the wrong way,
  // fail and are the last error once.
  std::vector<int> host(96);
  CHECK_EQ(cudaLaunchKernelEx(&config, half_warp, host.data()), cudaErrorIllegalAddress);
  CHECK_EQ(cudaGetLastError(), cudaErrorIllegalAddress);
  CHECK_EQ(cudaGetLastError(), cudaSuccess);
  const auto read_pairs = +[](const float2* in, float* out) { out[threadIdx.x] = in[0].x; };
  DeviceArray<float> floats(std::vector<float>(64, 1.0f));
  CHECK_EQ(cudaLaunchKernelEx(&config, read_pairs,
                              reinterpret_cast<const float2*>(floats.data() + 1), floats.data()),
           cudaErrorIllegalAddress);
  CHECK_EQ(cudaMemcpyAsync(host.data(), sums.data(), 4, cudaMemcpyHostToDevice, nullptr),
           cudaErrorInvalidValue);
  CHECK_EQ(cudaMemsetAsync(host.data(), 0, 4, nullptr), cudaErrorInvalidValue);
  // Configurations the driver refuses.
  config.blockDim = dim3(1025);
  CHECK_EQ(cudaLaunchKernelEx(&config, half_warp, sums.data()), cudaErrorInvalidConfiguration);
  config.blockDim = dim3(32);
  config.gridDim = dim3(0);
  CHECK_EQ(cudaLaunchKernelEx(&config, half_warp, sums.data()), cudaErrorInvalidConfiguration);
  (void)cudaGetLastError();
}

CGX_TEST(cuda_emulation_converts_half_types_as_ieee_rounding) {
  // Every half widens as the compiler's binary16 does.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float mine = __half2float(__half{static_cast<uint16_t>(h)});
    const float reference = half_widened(static_cast<uint16_t>(h));
    CHECK(bits_of(mine) == bits_of(reference) || (std::isnan(mine) && std::isnan(reference)));
  }
  // Narrowing: edges (ties at the subnormal, normal and overflow boundaries) and random
  // bit patterns, against both references; NaN gives the device's canonical 0x7fff.
  std::vector<float> probes = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, kMax,
                               kInf, -kInf, kNaN, 0x1p-14f, 0x1p-24f, 0x1p-25f, 0x1.8p-24f,
                               0x1p-26f, 1.0f + 0x1p-11f, 1.0f + 0x1p-8f, 0x1.fffep127f};
  std::mt19937 generator(5);
  for (int i = 0; i < 200000; ++i) probes.push_back(float_of(generator()));
  for (float v : probes) {
    const uint16_t h = __float2half_rn(v).bits, b = __float2bfloat16_rn(v).bits;
    CHECK_EQ(h, std::isnan(v) ? 0x7fff : half_reference(v));
    CHECK_EQ(b, bfloat16_reference(v));
  }
}

CGX_TEST(cuda_kernels_compress_and_decode_as_the_cpu_codec) {
  // Every width, rounding, dtype and shape; stochastic with a stream offset, one near
  // 2^32 (the index wraps as the CPU codec's does) and one past it. Odd widths read their
  // input one element into its allocation: the scalar loads instead of the 16-byte ones;
  // half the decodes write one element in (the scalar stores).
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16})
    for (int bits = 1; bits <= compression::kMaxBits; ++bits)
      for (bool stochastic : {false, true})
        for (const Shape& shape : kShapes)
          for (bool skip : {false, true}) {
            const QuantizerParams p = params_of(bits, shape.bucket, skip, stochastic);
            const Values x = store(test_values(shape.n, bits * 31 + shape.n), dtype);
            const uint64_t seed = 0x1234567890abcdefull + bits;
            const uint64_t offset = shape.n % 2 ? 0xfffffff0ull : (uint64_t{1} << 32) + 77;
            const std::string what = describe(p, shape.n, dtype);
            const auto bytes = check_compress(p, x, seed, offset, what, bits % 2);
            // Decoding does not depend on the input's dtype: once per shape and width.
            if (dtype == DType::Float32)
              for (DType out : {DType::Float32, DType::Float16, DType::BFloat16})
                for (bool add : {false, true})
                  check_decompress(p, bytes, shape.n, out, add, what, add == stochastic);
          }
}

CGX_TEST(cuda_kernels_handle_nan_inf_and_float_max_as_the_cpu_codec) {
  // In buckets of 8: NaN, +Inf, -Inf; -max and max (for float32 and bfloat16 the range
  // overflows: a NaN bucket); [0, max] and [-max, 0] (the range reaches max: for some
  // widths, 5 and 7 bits among them, level * scale rounds past it and the decode caps
  // it); subnormals (1 / scale overflows, or scale underflows to 0); and a raw tail with
  // NaN and Inf (skip_incomplete: they travel exactly). Then the same values in buckets
  // of 40, whose last, partial one holds the NaN. max is the dtype's largest finite value.
  // Then each group of 8 repeated to fill a bucket of 256 (encoded in registers), the same
  // tail after them.
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16}) {
    const float max = dtype == DType::Float32   ? kMax
                      : dtype == DType::Float16 ? 65504.0f
                                                : 0x1.fep127f;
    std::vector<float> v = random_values(8 * 8 + 5, 3);
    v[2] = kNaN;
    v[9] = kInf;
    v[20] = -kInf;
    v[24] = -max;
    v[31] = max;
    const float reaching_up[] = {0.0f, max, max / 2, max / 3, 1.0f, -0.0f, 5.0f, max / 7};
    const float reaching_down[] = {-max, 0.0f, -max / 2, -1.0f, -max / 7, -0.0f, -5.0f, -max / 3};
    const float subnormal[] = {0.0f, 0x1p-149f, 0x1p-148f, 0.0f, 0x1p-149f, -0.0f, 0.0f, 0x1p-147f};
    std::copy(std::begin(reaching_up), std::end(reaching_up), v.begin() + 32);
    std::copy(std::begin(reaching_down), std::end(reaching_down), v.begin() + 40);
    std::copy(std::begin(subnormal), std::end(subnormal), v.begin() + 56);
    v[64] = kNaN;
    v[66] = -kInf;
    const Values x = store(v, dtype);
    for (int bits = 1; bits <= compression::kMaxBits; ++bits)
      for (auto [bucket, skip, stochastic] : {std::tuple{8, true, false}, std::tuple{8, true, true},
                                              std::tuple{40, false, false}, std::tuple{40, false, true}}) {
        const QuantizerParams p = params_of(bits, bucket, skip, stochastic);
        const std::string what = "special values, " + describe(p, 69, dtype);
        const auto bytes = check_compress(p, x, 11, 0, what);
        for (DType out : {DType::Float32, DType::Float16, DType::BFloat16})
          for (bool add : {false, true}) check_decompress(p, bytes, 69, out, add, what);
      }
    std::vector<float> wide(8 * 256 + 5);
    for (size_t i = 0; i < wide.size(); ++i) wide[i] = i < 8 * 256 ? v[i / 256 * 8 + i % 8] : v[64 + i % 256];
    const Values in_registers = store(wide, dtype);
    const int64_t n = static_cast<int64_t>(wide.size());
    for (int bits = 1; bits <= compression::kMaxBits; ++bits)
      for (auto [skip, stochastic] : {std::tuple{true, false}, std::tuple{false, true}}) {
        const QuantizerParams p = params_of(bits, 256, skip, stochastic);
        const std::string what = "special values, " + describe(p, n, dtype);
        const auto bytes = check_compress(p, in_registers, 11, 0, what);
        for (DType out : {DType::Float32, DType::Float16, DType::BFloat16})
          for (bool add : {false, true}) check_decompress(p, bytes, n, out, add, what);
      }
  }
}

CGX_TEST(cuda_kernels_give_the_same_bits_on_grids_smaller_and_larger_than_the_work) {
  // 1 and 3 blocks make every grid-stride loop wrap (bucket_meta: 8 buckets a block;
  // the others: 256 groups or values a block; 5999 in buckets of 3000, skip_incomplete,
  // has a raw tail of 2999); twice the blocks and one leaves threads idle,
  // which must write nothing (check_* look past the outputs).
  const std::vector<float> values = test_values(20011, 8);
  for (auto resize : {+[](unsigned) { return 1u; }, +[](unsigned) { return 3u; },
                      +[](unsigned blocks) { return 2 * blocks + 1; }}) {
    unsigned largest_real_grid = 0;
    const cuda_emulation::ScopedGridResize scoped([&](unsigned blocks) {
      largest_real_grid = std::max(largest_real_grid, blocks);
      return resize(blocks);
    });
    for (const Shape& shape : {Shape{20011, 33}, Shape{3001, 1}, Shape{5999, 3000}, Shape{20011, 256}})
      for (bool skip : {false, true}) {
        const QuantizerParams p = params_of(3, shape.bucket, skip, /*stochastic=*/true);
        const std::vector<float> x(values.begin(), values.begin() + shape.n);
        const std::string what = "resized grid, " + describe(p, shape.n, DType::Float32);
        const auto bytes = check_compress(p, store(x, DType::Float32), 5, 1000, what);
        check_decompress(p, bytes, shape.n, DType::Float32, /*add=*/true, what);
        check_decompress(p, bytes, shape.n, DType::BFloat16, /*add=*/false, what);
      }
    CHECK(largest_real_grid > 3);  // the real launches had more blocks than the small grids
  }
}

CGX_TEST(cuda_hadamard_kernels_compress_and_decode_as_the_cpu_codec) {
  // Every width of the scheme (1..4), both roundings, the three input dtypes and every
  // shape, skip_incomplete or not; stochastic streams at an offset near 2^32 (the index
  // wraps) and past it. Odd widths read their input one element in (scalar loads).
  // Decoded into each dtype, stored or added, half of them one element in (scalar stores).
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16})
    for (int bits = 1; bits <= compression::kMaxHadamardBits; ++bits)
      for (bool stochastic : {false, true})
        for (const Shape& shape : kHadamardShapes)
          for (bool skip : {false, true}) {
            if (shape.bucket >= 4096 && (dtype != DType::Float32 || skip)) continue;  // time
            const QuantizerParams p = hadamard_of(bits, shape.bucket, skip, stochastic);
            const Values x = store(test_values(shape.n, bits * 17 + shape.n), dtype);
            const uint64_t seed = 0xfedcba9876543210ull + bits;
            const uint64_t offset = shape.n % 2 ? 0xffffff00ull : (uint64_t{1} << 32) + 5;
            const std::string what = describe(p, shape.n, dtype);
            const auto bytes = check_compress(p, x, seed, offset, what, bits % 2);
            if (dtype == DType::Float32)
              for (DType out : {DType::Float32, DType::Float16, DType::BFloat16})
                for (bool add : {false, true})
                  check_decompress(p, bytes, shape.n, out, add, what, add == stochastic);
          }
}

CGX_TEST(cuda_hadamard_kernels_handle_nan_inf_huge_and_zero_buckets_as_the_cpu_codec) {
  // Buckets of 8: NaN, +Inf, -Inf, a magnitude at the scheme's limit 2^100 (the bucket is
  // stored as NaN) and one just below it, the dtype's largest finite values, all zeros
  // (rms 0), subnormals, values whose rms has no finite inverse; then a shorter last bucket
  // with a NaN (maxmin inside), and the same values in one bucket of 64 (a single NaN makes
  // the whole bucket NaN). Then each group of 8 repeated to fill a bucket of 256, which
  // rotates in registers, the same shorter last bucket after them.
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16}) {
    const float max = dtype == DType::Float32   ? kMax
                      : dtype == DType::Float16 ? 65504.0f
                                                : 0x1.fep127f;
    std::vector<float> v = random_values(8 * 9 + 5, 4);
    v[2] = kNaN;
    v[9] = kInf;
    v[20] = -kInf;
    v[26] = dtype == DType::Float16 ? 65504.0f : 0x1p100f;
    v[33] = dtype == DType::Float16 ? -65504.0f : -0x1.fffffep99f;
    v[39] = max;
    for (int i = 40; i < 48; ++i) v[i] = 0.0f;
    const float subnormal[] = {0.0f, 0x1p-149f, -0x1p-148f, 0.0f, 0x1p-149f, -0.0f, 0.0f, 0x1p-147f};
    std::copy(std::begin(subnormal), std::end(subnormal), v.begin() + 48);
    // So small that the rms is nonzero and its inverse overflows (levels then from z = 0).
    const float tiny[] = {0x1p-127f, -0x1p-128f, 0x1p-126f, 0x1p-129f, -0x1p-127f, 0x1p-128f, -0x1p-126f, 0.0f};
    std::copy(std::begin(tiny), std::end(tiny), v.begin() + 56);
    v[74] = kNaN;
    const Values x = store(v, dtype);
    for (int bits = 1; bits <= compression::kMaxHadamardBits; ++bits)
      for (auto [bucket, stochastic] : {std::tuple{8, false}, std::tuple{8, true}, std::tuple{64, false}}) {
        const QuantizerParams p = hadamard_of(bits, bucket, false, stochastic);
        const std::string what = "special values, " + describe(p, 77, dtype);
        const auto bytes = check_compress(p, x, 13, 0, what);
        for (DType out : {DType::Float32, DType::Float16, DType::BFloat16})
          for (bool add : {false, true}) check_decompress(p, bytes, 77, out, add, what);
      }
    std::vector<float> wide(9 * 256 + 5);
    for (size_t i = 0; i < wide.size(); ++i) wide[i] = i < 9 * 256 ? v[i / 256 * 8 + i % 8] : v[72 + i % 256];
    const Values in_registers = store(wide, dtype);
    const int64_t n = static_cast<int64_t>(wide.size());
    for (int bits = 1; bits <= compression::kMaxHadamardBits; ++bits)
      for (bool stochastic : {false, true}) {
        const QuantizerParams p = hadamard_of(bits, 256, false, stochastic);
        const std::string what = "special values, " + describe(p, n, dtype);
        const auto bytes = check_compress(p, in_registers, 13, 0, what);
        for (DType out : {DType::Float32, DType::Float16, DType::BFloat16})
          for (bool add : {false, true}) check_decompress(p, bytes, n, out, add, what);
      }
  }
}

CGX_TEST(cuda_hadamard_kernels_give_the_same_bits_on_grids_smaller_and_larger_than_the_work) {
  // 1 and 3 blocks (8 warps, so 8 buckets, a block) make the bucket loops wrap; twice the
  // blocks and one leaves warps idle, which must write nothing.
  const std::vector<float> values = test_values(20011, 9);
  for (auto resize : {+[](unsigned) { return 1u; }, +[](unsigned) { return 3u; },
                      +[](unsigned blocks) { return 2 * blocks + 1; }}) {
    const cuda_emulation::ScopedGridResize scoped(resize);
    for (const Shape& shape : {Shape{20011, 32}, Shape{5000, 1024}})
      for (bool stochastic : {false, true}) {
        const QuantizerParams p = hadamard_of(2, shape.bucket, false, stochastic);
        const std::vector<float> x(values.begin(), values.begin() + shape.n);
        const std::string what = "resized grid, " + describe(p, shape.n, DType::Float32);
        const auto bytes = check_compress(p, store(x, DType::Float32), 5, 1000, what);
        check_decompress(p, bytes, shape.n, DType::Float32, /*add=*/true, what);
        check_decompress(p, bytes, shape.n, DType::BFloat16, /*add=*/false, what);
      }
  }
}

CGX_TEST(cuda_executor_equals_the_host_executor_on_a_mixed_layout) {
  // The executor's pieces (raw layers through copy_floats, skip-incomplete tails, padding),
  // its staging, its copies' directions and the add_finite_difference kernel, against
  // HostExecutor: compress, decompress, decompress_add, add_error (NaN, Inf and an
  // overflowing bucket included: a non-finite difference adds nothing) and
  // compress_and_decode (the host's is fused). Values on the device, bytes on the host.
  compression::Segment rotated = quantized(3000, 2, 512);  // 5 whole buckets and a shorter one
  rotated.params.scheme = compression::Scheme::kHadamard;
  compression::Segment rotated_stochastic = quantized(2048, 3, 64, false, /*stochastic=*/true);
  rotated_stochastic.params.scheme = compression::Scheme::kHadamard;
  std::vector<compression::Segment> segments = mixed_layout().segments();  // then hadamard ones
  segments.push_back(rotated);
  segments.push_back(rotated_stochastic);
  const compression::LayoutCodec codec = layout(segments);
  const int64_t total = codec.total();
  std::vector<float> x = random_values(total, 21);
  x[10] = kNaN;       // a 4-bit layer's bucket
  x[1040] = kInf;     // the 8-bit layer
  x[6100] = kMax;     // a 1-bit bucket of 3 whose range overflows
  x[6101] = -kMax;
  x[1005] = kNaN;     // a raw layer: travels exactly
  x[total - 3000 - 2048 + 700] = kInf;  // a hadamard bucket
  const std::vector<float> base = random_values(total, 22);
  compression::HostExecutor host;
  compression::cuda::CudaExecutor emulated(0, nullptr);
  const int64_t cut = codec.align_up(total / 3);
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, total}, {cut, total}, {0, cut}}) {
    const std::string where = "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
    const auto same = [&](const std::vector<float>& a, const std::vector<float>& b) {
      for (int64_t i = 0; i < total; ++i)
        if (!(bits_of(a[i]) == bits_of(b[i]) || (std::isnan(a[i]) && std::isnan(b[i]))))
          fail(__FILE__, __LINE__, where + ": value " + std::to_string(i) + " differs");
    };
    const size_t bytes = codec.compressed_bytes(begin, end);
    DeviceArray<float> x_on_gpu(x);
    std::vector<uint8_t> expected(bytes), got(bytes, kGuardByte);
    host.compress(codec, x.data(), begin, end, expected.data(), 42);
    emulated.compress(codec, x_on_gpu.data(), begin, end, got.data(), 42);
    emulated.sync();
    CHECK(got == expected);

    std::vector<float> want = base;
    DeviceArray<float> have(base);
    host.decompress(codec, expected.data(), begin, end, want.data());
    emulated.decompress(codec, expected.data(), begin, end, have.data());
    same(have.host(), want);
    host.decompress_add(codec, expected.data(), begin, end, want.data());
    emulated.decompress_add(codec, expected.data(), begin, end, have.data());
    same(have.host(), want);
    want = base;
    DeviceArray<float> residual(base);
    host.add_error(codec, expected.data(), begin, end, x.data(), want.data());
    emulated.add_error(codec, expected.data(), begin, end, x_on_gpu.data(), residual.data());
    same(residual.host(), want);

    std::vector<float> host_values = x, host_residual = base;
    std::vector<uint8_t> fused(bytes), fused_on_gpu(bytes, kGuardByte);
    host.compress_and_decode(codec, host_values.data(), begin, end, fused.data(), 43,
                             host_residual.data(), true);
    DeviceArray<float> values(x), residual_of_fused(base);
    emulated.compress_and_decode(codec, values.data(), begin, end, fused_on_gpu.data(), 43,
                                 residual_of_fused.data(), true);
    CHECK(fused_on_gpu == fused);
    same(values.host(), host_values);
    same(residual_of_fused.host(), host_residual);
  }
}

CGX_TEST(cuda_add_finite_difference_adds_what_the_host_adds) {
  // The kernel alone, on differences that overflow or are not finite: residual +=
  // values - decoded only where that difference is finite, as LayoutCodec::add_error.
  const int64_t n = 3001;
  std::vector<float> values = random_values(n, 31), decoded = random_values(n, 32);
  values[0] = kMax, decoded[0] = -kMax;  // overflows: nothing added
  values[1] = kNaN;
  decoded[2] = kInf;
  values[3] = kInf, decoded[3] = kInf;
  std::vector<float> start = random_values(n, 33);
  start.resize(n + kGuard, 7.0f);
  DeviceArray<float> values_on_gpu(values), decoded_on_gpu(decoded), on_gpu(start);
  compression::cuda::add_error_floats(values_on_gpu.data(), decoded_on_gpu.data(), n,
                                      on_gpu.data(), nullptr);
  const std::vector<float> residual = on_gpu.host();
  for (int64_t i = 0; i < n; ++i) {
    const float dropped = values[i] - decoded[i];
    const float expected = std::isfinite(dropped) ? start[i] + dropped : start[i];
    CHECK_EQ(bits_of(residual[i]), bits_of(expected));
  }
  for (int64_t i = n; i < n + static_cast<int64_t>(kGuard); ++i) CHECK_EQ(residual[i], 7.0f);
}

CGX_TEST(cuda_codec_refuses_a_misaligned_compressed_buffer) {
  // Its metadata is read as floats: on a GPU a misaligned buffer would fault.
  const QuantizerParams p = params_of(4, 32, false, false);
  DeviceArray<float> values(random_values(100, 41));
  DeviceArray<uint8_t> bytes(std::vector<uint8_t>(compression::compressed_bytes(p, 100) + 8));
  CHECK_THROWS(compression::cuda::compress(p, values.data(), DType::Float32, 100, bytes.data() + 2,
                                           0, 0, nullptr),
               std::invalid_argument);
  CHECK_THROWS(compression::cuda::decompress(p, bytes.data() + 2, 100, values.data(),
                                             DType::Float32, false, nullptr),
               std::invalid_argument);
}

}  // namespace cgx::test
