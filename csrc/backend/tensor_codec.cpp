#include "backend/tensor_codec.h"

#include <c10/util/Exception.h>

#include "backend/argument_checks.h"
#include "backend/settings.h"
#ifdef CGX_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "compression/cuda/quantizer_cuda.h"
#endif

namespace cgx::backend {
namespace {

// A dense tensor on `device` (the input's: CPU, or a GPU in a CUDA build).
void check_tensor(const at::Tensor& t, const char* name, const at::Device& device) {
  TORCH_CHECK(t.layout() == at::kStrided, "cgx: ", name, " must be a dense tensor");
  TORCH_CHECK(t.device() == device, "cgx: ", name, " must be on ", device, ", got ", t.device());
  TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "cgx: ", name,
              " must be a CPU or CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device().is_cpu() || kWithCuda, "cgx: ", name, " is on ", t.device(),
              " but cgx was built without CUDA (a CPU torch, or no nvcc)");
}

#ifdef CGX_WITH_CUDA
compression::cuda::DType cuda_dtype(at::ScalarType dtype) {
  if (dtype == at::kHalf) return compression::cuda::DType::Float16;
  if (dtype == at::kBFloat16) return compression::cuda::DType::BFloat16;
  return compression::cuda::DType::Float32;
}
#endif

}  // namespace

at::Tensor compress_tensor(const at::Tensor& input, const compression::QuantizerParams& p, uint64_t seed,
                           std::optional<at::Tensor> out, int threads) {
  const at::Device device = input.device();
  check_tensor(input, "input", device);
  TORCH_CHECK_TYPE(is_compressible_dtype(input.scalar_type()),
                   "cgx.compress: expected float32, float16 or bfloat16, got ", input.scalar_type());
  // On the GPU the kernels read every dtype; the CPU codec reads float32.
  const at::Tensor values = device.is_cpu() ? input.reshape(-1).to(at::kFloat).contiguous()
                                            : input.reshape(-1).contiguous();
  const auto bytes = static_cast<int64_t>(compression::compressed_bytes(p, values.numel()));
  at::Tensor dst = out ? *out : at::empty({bytes}, values.options().dtype(at::kByte));
  check_tensor(dst, "out", device);
  TORCH_CHECK_VALUE(dst.scalar_type() == at::kByte && dst.dim() == 1 && dst.is_contiguous() &&
                        dst.numel() >= bytes,
                    "cgx.compress: out must be a contiguous 1-D uint8 tensor of at least ", bytes, " bytes");
#ifdef CGX_WITH_CUDA
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    compression::cuda::compress(p, values.data_ptr(), cuda_dtype(values.scalar_type()), values.numel(),
                                dst.data_ptr<uint8_t>(), seed, /*stream_offset=*/0,
                                c10::cuda::getCurrentCUDAStream().stream());
    return dst.narrow(0, 0, bytes);
  }
#endif
  compression::compress(p, values.data_ptr<float>(), values.numel(), dst.data_ptr<uint8_t>(), seed,
                        /*stream_offset=*/0, threads);
  return dst.narrow(0, 0, bytes);
}

at::Tensor decompress_tensor(const at::Tensor& buffer, int64_t numel, const compression::QuantizerParams& p,
                             std::optional<at::Tensor> out, bool add, int threads) {
  const at::Device device = buffer.device();
  check_tensor(buffer, "buffer", device);
  TORCH_CHECK_VALUE(numel >= 0, "cgx.decompress: numel must be >= 0, got ", numel);
  const auto bytes = static_cast<int64_t>(compression::compressed_bytes(p, numel));
  TORCH_CHECK_VALUE(buffer.scalar_type() == at::kByte && buffer.is_contiguous() && buffer.numel() >= bytes,
                    "cgx.decompress: buffer must be a contiguous uint8 tensor of at least ", bytes,
                    " bytes for ", numel, " values");
  TORCH_CHECK_VALUE(out || !add, "cgx.decompress: add=True needs out=");
  at::Tensor dst = out ? *out : at::empty({numel}, buffer.options().dtype(at::kFloat));
  check_tensor(dst, "out", device);
  // On the GPU values are written in any of the codec's dtypes; on the CPU in float32.
  TORCH_CHECK_VALUE((device.is_cpu() ? dst.scalar_type() == at::kFloat : is_compressible_dtype(dst.scalar_type())) &&
                        dst.is_contiguous() && dst.numel() == numel,
                    "cgx.decompress: out must be a contiguous ",
                    device.is_cpu() ? "float32" : "float32, float16 or bfloat16", " tensor of ", numel,
                    " elements");
#ifdef CGX_WITH_CUDA
  if (device.is_cuda()) {
    const c10::cuda::CUDAGuard guard(device);
    compression::cuda::decompress(p, buffer.data_ptr<uint8_t>(), numel, dst.data_ptr(),
                                  cuda_dtype(dst.scalar_type()), add, c10::cuda::getCurrentCUDAStream().stream());
    return dst;
  }
#endif
  if (add)
    compression::decompress_add(p, buffer.data_ptr<uint8_t>(), numel, dst.data_ptr<float>(), threads);
  else
    compression::decompress(p, buffer.data_ptr<uint8_t>(), numel, dst.data_ptr<float>(), threads);
  return dst;
}

}  // namespace cgx::backend
