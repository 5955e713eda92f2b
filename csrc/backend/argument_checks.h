// The backend's argument checks, each written once (in the spirit of c10d's Utils.hpp
// assert helpers). They run on the caller's thread, before a call is numbered, so a
// refused call leaves this rank in step with its peers and the group usable.
//
// Each raises through torch's checks, so Python sees the type the message implies:
// ValueError (a bad value: sizes, layouts, overlapping memory), TypeError (a dtype),
// RuntimeError (a layout or device torch itself would refuse). Tests match the messages:
// change one only with its test.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <memory>
#include <optional>
#include <vector>

#include "backend/settings.h"
#include "compression/layout_codec.h"

namespace cgx::backend {

// A group's settings against the limits in settings.h. cgx/config.py validates first,
// naming the variable; this guards direct C++ callers.
void validate(const Settings& settings);

// A wrapped backend given to the group: present, and of the group's rank and size.
c10::intrusive_ptr<c10d::Backend> checked_exact(c10::intrusive_ptr<c10d::Backend> exact, int rank,
                                                int size);

// The dtypes the codec reads: float32, float16 and bfloat16.
bool is_compressible_dtype(at::ScalarType dtype);
// TypeError "cgx <what>: expected float32, float16 or bfloat16, got <dtype>" for any other.
void check_compressible_dtype(at::ScalarType dtype, const char* what);

// Tags at and above kFirstCgxTag are cgx's own (C10dTransport).
void check_tag(int tag);

// Tensors a collective writes into: none with elements that share memory (an expanded,
// stride-0 view). Gloo itself crashes on one.
void check_writable(const std::vector<at::Tensor>& tensors, const char* what);
void check_writable(const std::vector<std::vector<at::Tensor>>& lists, const char* what);

// Strided (or sparse COO, where `sparse_ok`: the wrapped backend reduces those exactly),
// CPU or CUDA, and writable.
void check_tensors(const std::vector<at::Tensor>& tensors, const char* what, bool sparse_ok);

// allreduce_coalesced's list: one device and one dtype.
void check_one_device_and_dtype(const std::vector<at::Tensor>& tensors, const char* what);

// An average on a backend without AVG (Gloo: a sum, then a division): floating-point tensors.
void check_averageable(const std::vector<at::Tensor>& tensors);

// An error-feedback buffer matches the values it feeds back into: contiguous float32, as
// many elements as `input`, on its device.
void check_residual(const std::optional<at::Tensor>& residual, const at::Tensor& input,
                    const char* what);

// The codec of `layout` over `numel` values; a layout LayoutCodec refuses raises
// ValueError "cgx <what>: <why>".
std::shared_ptr<const compression::LayoutCodec> checked_layout(std::vector<compression::Segment> layout,
                                                               int64_t numel, const char* what);

// The checks both sharded collectives make: dense contiguous float tensors of one dtype on
// one device, `full` holding `size` shards of `shard`, and a layout that covers one shard
// (returned as its codec).
std::shared_ptr<const compression::LayoutCodec> checked_shard_call(
    const char* what, const at::Tensor& full, const at::Tensor& shard, int size,
    std::vector<compression::Segment> layout);

// reduce_scatter_layout's op: SUM, AVG or PREMUL_SUM.
void check_reduce_scatter_op(c10d::ReduceOp::RedOpType op);

}  // namespace cgx::backend
