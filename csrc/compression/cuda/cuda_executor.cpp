#include "compression/cuda/cuda_executor.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "compression/cuda/quantizer_cuda.h"

namespace cgx::compression::cuda {

namespace {

void check(cudaError_t code, const char* what) {
  if (code != cudaSuccess)
    throw std::runtime_error(std::string("cgx CUDA executor: ") + what + ": " +
                             cudaGetErrorString(code));
}

size_t total_bytes(const std::vector<LayoutCodec::Piece>& pieces) {
  size_t bytes = 0;
  for (const auto& piece : pieces) bytes += piece.bytes;
  return bytes;
}

void* allocate_pinned(size_t bytes) {
  void* p = nullptr;
  return cudaHostAlloc(&p, bytes, cudaHostAllocPortable) == cudaSuccess ? p : nullptr;
}
void release_pinned(void* p) {
  if (p) cudaFreeHost(p);
}

}  // namespace

CudaExecutor::CudaExecutor(int device, cudaStream_t stream) : device_(device), stream_(stream) {}

CudaExecutor::~CudaExecutor() {
  if (staging_) cudaFreeAsync(staging_, stream_);
}

void CudaExecutor::bind_thread() {
  int current = -1;
  check(cudaGetDevice(&current), "cudaGetDevice");
  if (current != device_) check(cudaSetDevice(device_), "cudaSetDevice");
}

uint8_t* CudaExecutor::staging(size_t bytes) {
  if (bytes <= staging_bytes_) return staging_;
  // Stream-ordered: the old buffer is released after the work already queued on it.
  if (staging_) check(cudaFreeAsync(staging_, stream_), "cudaFreeAsync");
  staging_ = nullptr;
  staging_bytes_ = 0;
  void* p = nullptr;
  check(cudaMallocAsync(&p, bytes, stream_), "cudaMallocAsync");
  staging_ = static_cast<uint8_t*>(p);
  staging_bytes_ = bytes;
  return staging_;
}

uint8_t* CudaExecutor::upload(const uint8_t* src, size_t bytes, size_t extra) {
  uint8_t* out = staging(bytes + extra);
  check(cudaMemcpyAsync(out, src, bytes, cudaMemcpyHostToDevice, stream_), "copy to device");
  return out;
}

void CudaExecutor::compress(const LayoutCodec& codec, const float* data, int64_t begin,
                            int64_t end, uint8_t* dst, uint64_t seed) {
  const auto pieces = codec.pieces(begin, end);
  const size_t bytes = total_bytes(pieces);
  if (bytes == 0) return;
  bind_thread();
  uint8_t* out = staging(bytes);
  for (const auto& piece : pieces) {
    const Segment& segment = codec.segments()[piece.segment];
    size_t used = 0;
    if (segment.raw) {
      copy_floats(data + piece.begin, piece.numel, reinterpret_cast<float*>(out), false, stream_);
      used = piece.numel * sizeof(float);
    } else {
      cuda::compress(segment.params, data + piece.begin, DType::Float32, piece.numel, out,
                     LayoutCodec::segment_seed(seed, piece.segment),
                     piece.begin - segment.offset, stream_);
      used = compressed_bytes(segment.params, piece.numel);
    }
    // The padding to 16 bytes is zero, as the CPU codec writes it.
    if (piece.bytes > used)
      check(cudaMemsetAsync(out + used, 0, piece.bytes - used, stream_), "cudaMemsetAsync");
    out += piece.bytes;
  }
  check(cudaMemcpyAsync(dst, staging_, bytes, cudaMemcpyDeviceToHost, stream_), "copy to host");
}

void CudaExecutor::decode(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                          int64_t end, float* data, bool add) {
  const auto pieces = codec.pieces(begin, end);
  const size_t bytes = total_bytes(pieces);
  if (bytes == 0) return;
  bind_thread();
  const uint8_t* in = upload(src, bytes);
  for (const auto& piece : pieces) {
    const Segment& segment = codec.segments()[piece.segment];
    if (segment.raw)
      copy_floats(reinterpret_cast<const float*>(in), piece.numel, data + piece.begin, add,
                  stream_);
    else
      cuda::decompress(segment.params, in, piece.numel, data + piece.begin, DType::Float32, add,
                       stream_);
    in += piece.bytes;
  }
}

void CudaExecutor::decompress(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                              int64_t end, float* data) {
  decode(codec, src, begin, end, data, /*add=*/false);
}

void CudaExecutor::decompress_add(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                                  int64_t end, float* data) {
  decode(codec, src, begin, end, data, /*add=*/true);
}

void CudaExecutor::add_error(const LayoutCodec& codec, const uint8_t* src, int64_t begin,
                             int64_t end, const float* values, float* residual) {
  const auto pieces = codec.pieces(begin, end);
  const size_t bytes = total_bytes(pieces);
  if (bytes == 0) return;
  bind_thread();
  // Staging holds the bytes, then (16-byte aligned: pieces are padded so) room for the
  // largest piece decoded.
  int64_t largest = 0;
  for (const auto& piece : pieces) largest = std::max(largest, piece.numel);
  uint8_t* in = upload(src, bytes, static_cast<size_t>(largest) * sizeof(float));
  auto* decoded = reinterpret_cast<float*>(in + bytes);
  for (const auto& piece : pieces) {
    const Segment& segment = codec.segments()[piece.segment];
    if (!segment.raw) {  // raw values travel exactly: nothing dropped
      cuda::decompress(segment.params, in, piece.numel, decoded, DType::Float32, /*add=*/false,
                       stream_);
      add_error_floats(values + piece.begin, decoded, piece.numel, residual + piece.begin,
                       stream_);
    }
    in += piece.bytes;
  }
}

void CudaExecutor::sync() { check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize"); }

HostMemory pinned_memory() { return {allocate_pinned, release_pinned}; }

}  // namespace cgx::compression::cuda
