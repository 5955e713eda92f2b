// The codec on tensors (cgx.compress / cgx.decompress): the checks of the tensors given,
// then the CPU codec or, in a CUDA build, the CUDA kernels on the current stream. Apart
// from the bindings so that a CPU build with nvcc present compiles its CUDA branch as a
// check without the pybind11 module around it.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

#include "compression/quantizer.h"

namespace cgx::backend {

// `input` (float32, float16 or bfloat16, any shape) compressed with `p`; into `out` where
// given (a contiguous 1-D uint8 tensor large enough), the compressed bytes returned. On
// the CPU over up to `threads` threads (the same bytes for any count).
at::Tensor compress_tensor(const at::Tensor& input, const compression::QuantizerParams& p, uint64_t seed,
                           std::optional<at::Tensor> out, int threads);

// `numel` values decoded from `buffer` with `p`, into `out` where given (added to it with
// `add`), else into a new float32 tensor.
at::Tensor decompress_tensor(const at::Tensor& buffer, int64_t numel, const compression::QuantizerParams& p,
                             std::optional<at::Tensor> out, bool add, int threads);

}  // namespace cgx::backend
