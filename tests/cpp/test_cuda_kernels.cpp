// The CUDA codec's kernels and executor (csrc/compression/cuda), run on the CPU through the
// emulation in cuda_emulation/, against the CPU codec: the same bytes and the same decoded
// bits. The launches are the codec's own (its blocks_for and kThreads); ScopedGridResize
// shrinks or grows their grids to make the grid-stride loops wrap or threads idle.
//
// NaN compares as a class (both NaN), not by its bits: a GPU's float and half arithmetic
// writes the canonical NaN where x86 keeps an operand's, so NaN payloads differ between
// CPU and GPU runs by design. The compressed bytes, NaN buckets included, compare exactly.
#include <bit>
#include <cmath>
#include <limits>
#include <random>
#include <string>
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

// Values stored in a dtype: `stored` for the kernels, `exact` (float32, exact) for the CPU
// codec, as the CPU path widens before it compresses.
struct Values {
  DType dtype;
  std::vector<float> f32;
  std::vector<uint16_t> f16;
  std::vector<float> exact;
  const void* stored() const {
    return dtype == DType::Float32 ? static_cast<const void*>(f32.data()) : f16.data();
  }
};

Values store(const std::vector<float>& values, DType dtype) {
  Values out{dtype, {}, {}, {}};
  if (dtype == DType::Float32) {
    out.f32 = out.exact = values;
    return out;
  }
  for (float v : values) {
    out.f16.push_back(narrowed(v, dtype));
    out.exact.push_back(widened(out.f16.back(), dtype));
  }
  return out;
}

// Normal values, with -0, a constant run, and the largest finite values of the dtype at
// `special` positions when asked.
std::vector<float> test_values(int64_t n, uint32_t seed) {
  std::vector<float> v = random_values(n, seed);
  if (n > 3) v[3] = -0.0f;
  for (int64_t i = n / 3; i < n / 3 + n / 8; ++i) v[i] = 0.25f;
  return v;
}

std::string describe(const QuantizerParams& p, int64_t n, DType dtype) {
  return std::string(name_of(dtype)) + " n=" + std::to_string(n) + " bits=" +
         std::to_string(p.bits) + " bucket=" + std::to_string(p.bucket_size) +
         (p.skip_incomplete_buckets ? " skip-incomplete" : "") +
         (p.stochastic ? " stochastic" : "");
}

// The emulated compress writes the CPU codec's bytes, and nothing past them.
std::vector<uint8_t> check_compress(const QuantizerParams& params, const Values& x,
                                    uint64_t seed, uint64_t offset, const std::string& what) {
  const int64_t n = static_cast<int64_t>(x.exact.size());
  const size_t bytes = compression::compressed_bytes(params, n);
  std::vector<uint8_t> cpu(bytes);
  compression::compress(params, x.exact.data(), n, cpu.data(), seed, offset);
  std::vector<uint8_t> gpu(bytes + kGuard, kGuardByte);  // every byte must be written
  compression::cuda::compress(params, x.stored(), x.dtype, n, gpu.data(), seed, offset, nullptr);
  for (size_t i = 0; i < bytes; ++i)
    if (gpu[i] != cpu[i])
      fail(__FILE__, __LINE__,
           what + ": byte " + std::to_string(i) + " of " + std::to_string(bytes) + " is " +
               std::to_string(gpu[i]) + ", the CPU codec wrote " + std::to_string(cpu[i]));
  for (size_t i = bytes; i < gpu.size(); ++i)
    if (gpu[i] != kGuardByte) fail(__FILE__, __LINE__, what + ": wrote past the buffer");
  return cpu;
}

// The emulated decode (into `out_dtype`, added to `base` or not) gives the CPU codec's
// decoded values, the sum made in float32 and rounded once to the output dtype.
void check_decompress(const QuantizerParams& params, const std::vector<uint8_t>& bytes,
                      int64_t n, DType out_dtype, bool add, const std::string& what) {
  std::vector<float> decoded(static_cast<size_t>(n));
  compression::decompress(params, bytes.data(), n, decoded.data());
  const Values base = store(random_values(n, 99), out_dtype);
  const std::string where = what + " into " + name_of(out_dtype) + (add ? ", added" : "");
  if (out_dtype == DType::Float32) {
    std::vector<float> dst(base.f32);
    dst.resize(n + kGuard, 7.0f);
    compression::cuda::decompress(params, bytes.data(), n, dst.data(), out_dtype, add, nullptr);
    for (int64_t i = 0; i < n; ++i) {
      const float expected = add ? base.f32[i] + decoded[i] : decoded[i];
      if (!(bits_of(dst[i]) == bits_of(expected) || (std::isnan(dst[i]) && std::isnan(expected))))
        fail(__FILE__, __LINE__, where + ": value " + std::to_string(i) + " is " +
                                     std::to_string(dst[i]) + ", expected " + std::to_string(expected));
    }
    for (int64_t i = n; i < n + static_cast<int64_t>(kGuard); ++i)
      if (bits_of(dst[i]) != bits_of(7.0f)) fail(__FILE__, __LINE__, where + ": wrote past the values");
    return;
  }
  std::vector<uint16_t> dst(base.f16);
  dst.resize(n + kGuard, 0x1234);
  compression::cuda::decompress(params, bytes.data(), n, dst.data(), out_dtype, add, nullptr);
  for (int64_t i = 0; i < n; ++i) {
    const uint16_t expected =
        narrowed(add ? base.exact[i] + decoded[i] : decoded[i], out_dtype);
    if (!(dst[i] == expected || (is_nan16(dst[i], out_dtype) && is_nan16(expected, out_dtype))))
      fail(__FILE__, __LINE__, where + ": value " + std::to_string(i) + " has bits " +
                                   std::to_string(dst[i]) + ", expected " + std::to_string(expected));
  }
  for (int64_t i = n; i < n + static_cast<int64_t>(kGuard); ++i)
    if (dst[i] != 0x1234) fail(__FILE__, __LINE__, where + ": wrote past the values");
}

QuantizerParams params_of(int bits, int64_t bucket, bool skip, bool stochastic) {
  QuantizerParams p;
  p.bits = bits;
  p.bucket_size = bucket;
  p.skip_incomplete_buckets = skip;
  p.stochastic = stochastic;
  return p;
}

// Sizes and bucket sizes: buckets of 1, 7, a warp (32) and one more, 512 and 513, and
// buckets a warp's lanes cross many times (2000, 4099); counts that are multiples of
// nothing, shorter than a bucket, a group of 8, a warp.
struct Shape {
  int64_t n;
  int64_t bucket;
};
const Shape kShapes[] = {{1, 1},      {7, 7},       {9, 7},       {100, 1},   {33, 32},
                         {95, 33},    {1000, 512},  {1029, 513},  {5001, 2000}, {9001, 4099},
                         {4, 512},    {2049, 32}};

}  // namespace

CGX_TEST(cuda_emulation_runs_warps_in_lockstep_and_refuses_bad_masks) {
  using cuda_emulation::WarpError;
  // A butterfly sum: every lane ends with the sum of its warp's lane numbers.
  std::vector<int> sums(96, -1);
  const auto butterfly = +[](int* out, unsigned mask) {
    int v = static_cast<int>(threadIdx.x % 32);
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(mask, v, offset);
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
  };
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(3);
  config.blockDim = dim3(32);
  CHECK_EQ(cudaLaunchKernelEx(&config, butterfly, sums.data(), 0xffffffffu), cudaSuccess);
  for (int s : sums) CHECK_EQ(s, 496);
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
  // __all_sync over half a warp, the other half never calling it: defined, and emulated.
  const auto half_warp = +[](int* out) {
    if (threadIdx.x < 16) out[threadIdx.x] = __all_sync(0x0000ffffu, threadIdx.x != 3);
  };
  CHECK_EQ(cudaLaunchKernelEx(&config, half_warp, sums.data()), cudaSuccess);
  CHECK_EQ(sums[0], 0);
  // Configurations the driver refuses.
  config.blockDim = dim3(1025);
  CHECK_EQ(cudaLaunchKernelEx(&config, half_warp, sums.data()), cudaErrorInvalidConfiguration);
  config.blockDim = dim3(32);
  config.gridDim = dim3(0);
  CHECK_EQ(cudaLaunchKernelEx(&config, half_warp, sums.data()), cudaErrorInvalidConfiguration);
}

CGX_TEST(cuda_emulation_converts_half_types_as_ieee_rounding) {
  // Every half widens as the compiler's binary16 does.
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float mine = __half2float(__half{static_cast<uint16_t>(h)});
    const float reference = half_widened(static_cast<uint16_t>(h));
    CHECK(bits_of(mine) == bits_of(reference) || (std::isnan(mine) && std::isnan(reference)));
  }
  // Narrowing: edges (ties at the subnormal, normal and overflow boundaries) and random
  // bit patterns, against both references.
  std::vector<float> probes = {0.0f, -0.0f, 65504.0f, 65519.99f, 65520.0f, -65520.0f, kMax,
                               kInf, -kInf, kNaN, 0x1p-14f, 0x1p-24f, 0x1p-25f, 0x1.8p-24f,
                               0x1p-26f, 1.0f + 0x1p-11f, 1.0f + 0x1p-8f, 0x1.fffep127f};
  std::mt19937 generator(5);
  for (int i = 0; i < 200000; ++i) probes.push_back(float_of(generator()));
  for (float v : probes) {
    const uint16_t h = __float2half_rn(v).bits, b = __float2bfloat16_rn(v).bits;
    CHECK(h == half_reference(v) || (std::isnan(v) && is_nan16(h, DType::Float16)));
    CHECK_EQ(b, bfloat16_reference(v));
  }
}

CGX_TEST(cuda_kernels_compress_and_decode_as_the_cpu_codec) {
  // Every width, rounding, dtype and shape; stochastic with a stream offset, one near
  // 2^32 (the index wraps as the CPU codec's does).
  int cases = 0;
  for (DType dtype : {DType::Float32, DType::Float16, DType::BFloat16})
    for (int bits = 1; bits <= compression::kMaxBits; ++bits)
      for (bool stochastic : {false, true})
        for (const Shape& shape : kShapes)
          for (bool skip : {false, true}) {
            const QuantizerParams p = params_of(bits, shape.bucket, skip, stochastic);
            const Values x = store(test_values(shape.n, bits * 31 + shape.n), dtype);
            const uint64_t seed = 0x1234567890abcdefull + bits;
            const uint64_t offset = shape.n % 2 ? 0xfffffff0ull : 77;
            const std::string what = describe(p, shape.n, dtype);
            const auto bytes = check_compress(p, x, seed, offset, what);
            // Decoding is the same for every input dtype: once per shape and width.
            if (dtype == DType::Float32 && !skip)
              for (DType out : {DType::Float32, DType::Float16, DType::BFloat16})
                for (bool add : {false, true}) check_decompress(p, bytes, shape.n, out, add, what);
            ++cases;
          }
  CHECK_EQ(cases, 3 * 8 * 2 * static_cast<int>(std::size(kShapes)) * 2);
}

CGX_TEST(cuda_kernels_handle_nan_inf_and_float_max_as_the_cpu_codec) {
  // Buckets of 8 holding NaN, +Inf, -Inf; -max and max (the range overflows: a NaN
  // bucket); [0, max] and [-max, 0] (the range reaches max: for some widths, 5 and 7
  // bits among them, level * scale rounds past it and the decode caps it); subnormals
  // (1 / scale overflows, or scale underflows to 0); and a raw tail with NaN and Inf
  // (skip_incomplete: they travel exactly). max is the dtype's largest finite value.
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
      for (bool stochastic : {false, true}) {
        const QuantizerParams p = params_of(bits, 8, true, stochastic);
        const std::string what = "special values, " + describe(p, 69, dtype);
        const auto bytes = check_compress(p, x, 11, 0, what);
        for (DType out : {DType::Float32, DType::Float16, DType::BFloat16})
          for (bool add : {false, true}) check_decompress(p, bytes, 69, out, add, what);
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
    for (const Shape& shape : {Shape{20011, 33}, Shape{3001, 1}, Shape{5999, 3000}})
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

CGX_TEST(cuda_executor_equals_the_host_executor_on_a_mixed_layout) {
  // The executor's pieces (raw layers through copy_floats, skip-incomplete tails, padding),
  // its staging and the add_finite_difference kernel, against HostExecutor: compress,
  // decompress, decompress_add, add_error (NaN, Inf and FLT_MAX included: a non-finite
  // difference adds nothing) and compress_and_decode (the host's is fused).
  const compression::LayoutCodec codec = mixed_layout();
  const int64_t total = codec.total();
  std::vector<float> x = random_values(total, 21);
  x[10] = kNaN;       // a 4-bit layer's bucket
  x[1040] = kInf;     // the 8-bit layer
  x[6100] = kMax;     // a 1-bit bucket of 3 whose range overflows
  x[6101] = -kMax;
  x[1005] = kNaN;     // a raw layer: travels exactly
  compression::HostExecutor host;
  compression::cuda::CudaExecutor emulated(0, nullptr);
  const int64_t cut = codec.align_up(total / 3);
  for (auto [begin, end] : {std::pair<int64_t, int64_t>{0, total}, {cut, total}, {0, cut}}) {
    const std::string where = "[" + std::to_string(begin) + ", " + std::to_string(end) + ")";
    const size_t bytes = codec.compressed_bytes(begin, end);
    std::vector<uint8_t> expected(bytes), got(bytes, kGuardByte);
    host.compress(codec, x.data(), begin, end, expected.data(), 42);
    emulated.compress(codec, x.data(), begin, end, got.data(), 42);
    emulated.sync();
    CHECK(got == expected);

    const std::vector<float> base = random_values(total, 22);
    const auto same = [&](const std::vector<float>& a, const std::vector<float>& b) {
      for (int64_t i = 0; i < total; ++i)
        if (!(bits_of(a[i]) == bits_of(b[i]) || (std::isnan(a[i]) && std::isnan(b[i]))))
          fail(__FILE__, __LINE__, where + ": value " + std::to_string(i) + " differs");
    };
    std::vector<float> want = base, have = base;
    host.decompress(codec, expected.data(), begin, end, want.data());
    emulated.decompress(codec, expected.data(), begin, end, have.data());
    same(have, want);
    host.decompress_add(codec, expected.data(), begin, end, want.data());
    emulated.decompress_add(codec, expected.data(), begin, end, have.data());
    same(have, want);
    want = have = base;
    host.add_error(codec, expected.data(), begin, end, x.data(), want.data());
    emulated.add_error(codec, expected.data(), begin, end, x.data(), have.data());
    same(have, want);

    std::vector<float> host_values = x, values = x, host_residual = base, residual = base;
    std::vector<uint8_t> fused(bytes);
    host.compress_and_decode(codec, host_values.data(), begin, end, fused.data(), 43,
                             host_residual.data(), true);
    emulated.compress_and_decode(codec, values.data(), begin, end, got.data(), 43,
                                 residual.data(), true);
    CHECK(got == fused);
    same(values, host_values);
    same(residual, host_residual);
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
  const std::vector<float> start = random_values(n, 33);
  std::vector<float> residual = start;
  residual.resize(n + kGuard, 7.0f);
  compression::cuda::add_error_floats(values.data(), decoded.data(), n, residual.data(), nullptr);
  for (int64_t i = 0; i < n; ++i) {
    const float dropped = values[i] - decoded[i];
    const float expected = std::isfinite(dropped) ? start[i] + dropped : start[i];
    CHECK_EQ(bits_of(residual[i]), bits_of(expected));
  }
  for (int64_t i = n; i < n + static_cast<int64_t>(kGuard); ++i) CHECK_EQ(residual[i], 7.0f);
}

}  // namespace cgx::test
