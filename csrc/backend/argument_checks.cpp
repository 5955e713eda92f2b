#include "backend/argument_checks.h"

#include <ATen/MemoryOverlap.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <stdexcept>
#include <utility>

#include "backend/c10d_transport.h"

namespace cgx::backend {

void validate(const Settings& o) {
  TORCH_CHECK_VALUE((o.bits >= 1 && o.bits <= kMaxBits) || o.bits == kRawBits,
                    "cgx: bits must be in 1..", kMaxBits, " or ", kRawBits,
                    " (no compression), got ", o.bits);
  TORCH_CHECK_VALUE(o.bucket_size >= 1 && o.bucket_size <= kMaxBucketSize,
                    "cgx: bucket_size must be in 1..", kMaxBucketSize, ", got ", o.bucket_size);
  if (o.bits != kRawBits) {  // what the scheme allows (compression off needs nothing of it)
    try {
      compression::validate(quantizer_of(o));
    } catch (const std::invalid_argument& e) {
      TORCH_CHECK_VALUE(false, "cgx: ", e.what());
    }
  }
  TORCH_CHECK_VALUE(o.minimal_size >= 0 && o.minimal_size <= kMaxMinimalSize,
                    "cgx: minimal_size must be in 0..", kMaxMinimalSize, ", got ", o.minimal_size);
  TORCH_CHECK_VALUE(o.shm_ring_bytes >= kMinShmRingBytes && o.shm_ring_bytes <= kMaxShmRingBytes,
                    "cgx: shm_ring_bytes must be in ", kMinShmRingBytes, "..", kMaxShmRingBytes,
                    ", got ", o.shm_ring_bytes);
  TORCH_CHECK_VALUE(o.piece_values >= 0 && o.piece_values <= kMaxPieceValues,
                    "cgx: piece_values must be in 0..", kMaxPieceValues, ", got ", o.piece_values);
  TORCH_CHECK_VALUE(o.codec_threads >= 1 && o.codec_threads <= kMaxCodecThreads,
                    "cgx: codec_threads must be in 1..", kMaxCodecThreads, ", got ", o.codec_threads);
  TORCH_CHECK_VALUE(!o.hostname.empty(), "cgx: hostname must not be empty");
  const bool tag_ok = o.shm_name_tag.size() <= kMaxShmNameTag &&
                      std::all_of(o.shm_name_tag.begin(), o.shm_name_tag.end(), [](char c) {
                        return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-';
                      });
  TORCH_CHECK_VALUE(tag_ok, "cgx: shm_name_tag must be at most ", kMaxShmNameTag,
                    " of A-Z a-z 0-9 _ -, got '", o.shm_name_tag, "'");
}

c10::intrusive_ptr<c10d::Backend> checked_exact(c10::intrusive_ptr<c10d::Backend> exact, int rank,
                                                int size) {
  TORCH_CHECK(exact, "cgx: the exact (Gloo) backend is missing");
  TORCH_CHECK(exact->getRank() == rank && exact->getSize() == size,
              "cgx: the exact backend has rank ", exact->getRank(), " of ", exact->getSize(),
              ", expected ", rank, " of ", size);
  return exact;
}

bool is_compressible_dtype(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

void check_compressible_dtype(at::ScalarType dtype, const char* what) {
  TORCH_CHECK_TYPE(is_compressible_dtype(dtype), "cgx ", what,
                   ": expected float32, float16 or bfloat16, got ", dtype);
}

void check_tag(int tag) {
  TORCH_CHECK_VALUE(tag >= 0 && tag < kFirstCgxTag, "cgx: send/recv tags must be in 0..",
                    kFirstCgxTag - 1, " (higher tags are cgx's own), got ", tag);
}

void check_writable(const std::vector<at::Tensor>& tensors, const char* what) {
  for (const auto& t : tensors)
    TORCH_CHECK_VALUE(t.layout() != at::kStrided || at::has_internal_overlap(t) != at::MemOverlap::Yes,
                      "cgx ", what, ": a tensor of shape ", t.sizes(), " and strides ", t.strides(),
                      " has elements that share memory (an expanded or stride-0 view) and cannot "
                      "receive a result: pass a tensor of its own (.clone() or .contiguous())");
}

void check_writable(const std::vector<std::vector<at::Tensor>>& lists, const char* what) {
  for (const auto& tensors : lists) check_writable(tensors, what);
}

void check_tensors(const std::vector<at::Tensor>& tensors, const char* what, bool sparse_ok) {
  for (const auto& t : tensors) {
    TORCH_CHECK(t.layout() == at::kStrided || (sparse_ok && t.layout() == at::kSparse), "cgx ",
                what, ": expected strided", sparse_ok ? " or sparse COO" : "",
                " tensors, got layout ", t.layout());
    TORCH_CHECK(t.device().is_cpu() || t.device().is_cuda(), "cgx ", what,
                ": expected CPU or CUDA tensors, got ", t.device());
  }
  check_writable(tensors, what);
}

void check_one_device_and_dtype(const std::vector<at::Tensor>& tensors, const char* what) {
  for (const auto& t : tensors) {
    TORCH_CHECK(t.device() == tensors[0].device(), "cgx ", what,
                ": the tensors must be on one device, got ", tensors[0].device(), " and ", t.device());
    TORCH_CHECK_TYPE(t.scalar_type() == tensors[0].scalar_type(), "cgx ", what,
                     ": the tensors must have one dtype, got ", tensors[0].scalar_type(), " and ",
                     t.scalar_type());
  }
}

void check_averageable(const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors)
    TORCH_CHECK(at::isFloatingType(t.scalar_type()),
                "cgx allreduce: ReduceOp.AVG needs floating-point tensors, got ", t.scalar_type());
}

void check_residual(const std::optional<at::Tensor>& residual, const at::Tensor& input,
                    const char* what) {
  if (!residual) return;
  TORCH_CHECK_VALUE(residual->layout() == at::kStrided && residual->scalar_type() == at::kFloat &&
                        residual->is_contiguous() &&
                        residual->numel() == input.numel() && residual->device() == input.device(),
                    "cgx ", what, ": residual must be a contiguous float32 tensor of ",
                    input.numel(), " elements on ", input.device());
}

std::shared_ptr<const compression::LayoutCodec> checked_layout(std::vector<compression::Segment> layout,
                                                               int64_t numel, const char* what) {
  try {
    return std::make_shared<compression::LayoutCodec>(std::move(layout), numel);
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, "cgx ", what, ": ", e.what());
  }
}

std::shared_ptr<const compression::LayoutCodec> checked_shard_call(
    const char* what, const at::Tensor& full, const at::Tensor& shard, int size,
    std::vector<compression::Segment> layout) {
  check_tensors({full, shard}, what, /*sparse_ok=*/false);
  const auto dtype = full.scalar_type();
  check_compressible_dtype(dtype, what);
  TORCH_CHECK_TYPE(shard.scalar_type() == dtype, "cgx ", what,
                   ": input and output must have one dtype, got ", shard.scalar_type(), " and ",
                   dtype);
  TORCH_CHECK(full.device() == shard.device(), "cgx ", what,
              ": input and output must be on one device, got ", shard.device(), " and ",
              full.device());
  TORCH_CHECK_VALUE(full.is_contiguous() && shard.is_contiguous(), "cgx ", what,
                    ": input and output must be contiguous");
  TORCH_CHECK_VALUE(full.numel() == shard.numel() * size, "cgx ", what, ": the full tensor has ",
                    full.numel(), " elements, expected ", size, " shards of ", shard.numel());
  auto codec = checked_layout(std::move(layout), shard.numel(), what);
  return codec;
}

void check_reduce_scatter_op(c10d::ReduceOp::RedOpType op) {
  TORCH_CHECK_VALUE(op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG ||
                        op == c10d::ReduceOp::PREMUL_SUM,
                    "cgx reduce_scatter_layout: the op must be SUM, AVG or PREMUL_SUM, got ",
                    static_cast<int>(op));
}

}  // namespace cgx::backend
