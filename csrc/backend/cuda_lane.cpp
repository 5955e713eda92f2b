#include "backend/cuda_lane.h"

#include <c10/util/Exception.h>

#ifdef CGX_WITH_CUDA
#include <c10/core/Event.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <map>

#include "compression/cuda/cuda_executor.h"
#endif

namespace cgx::backend {

#ifdef CGX_WITH_CUDA

struct CudaTicket {
  c10::Event ready{c10::DeviceType::CUDA};
};

namespace {

// Streams of cgx's own, reused by later groups and never destroyed: the caching
// allocator records events on a stream whenever a tensor used there is freed, which may
// be long after the group is gone. (One of torch's pool would do too, but other code
// shares those, and sync() would wait for its work.)
class StreamCache {
 public:
  static cudaStream_t acquire(c10::Device device) {
    {
      std::lock_guard<std::mutex> lock(mutex());
      auto& free = streams()[device.index()];
      if (!free.empty()) {
        cudaStream_t s = free.back();
        free.pop_back();
        return s;
      }
    }
    const c10::cuda::CUDAGuard guard(device);
    cudaStream_t s = nullptr;
    // Non-blocking: ordered with the callers' streams by events only.
    C10_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return s;
  }
  static void release(c10::Device device, cudaStream_t s) {
    std::lock_guard<std::mutex> lock(mutex());
    streams()[device.index()].push_back(s);
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static std::map<c10::DeviceIndex, std::vector<cudaStream_t>>& streams() {
    static auto* free = new std::map<c10::DeviceIndex, std::vector<cudaStream_t>>();  // never freed
    return *free;
  }
};

// A stream from the cache for the lifetime of a group.
class OwnedStream {
 public:
  explicit OwnedStream(c10::Device device) : device_(device), raw_(StreamCache::acquire(device)) {}
  ~OwnedStream() {
    cudaStreamSynchronize(raw_);
    StreamCache::release(device_, raw_);
  }
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  cudaStream_t raw() const { return raw_; }

 private:
  c10::Device device_;
  cudaStream_t raw_;
};

}  // namespace

// Members are destroyed in reverse: the scratch and executors, then the streams.
struct CudaLane::State {
  explicit State(c10::Device d)
      : device(d),
        own_stream(d),
        own_cross_stream(d),
        stream(c10::cuda::getStreamFromExternal(own_stream.raw(), d.index())),
        cross_stream(c10::cuda::getStreamFromExternal(own_cross_stream.raw(), d.index())),
        executor(d.index(), stream.stream()),
        cross_executor(d.index(), cross_stream.stream()),
        scratch(compression::cuda::pinned_memory()),
        cross_scratch(compression::cuda::pinned_memory()) {}

  c10::Device device;
  OwnedStream own_stream;
  OwnedStream own_cross_stream;
  c10::cuda::CUDAStream stream;
  c10::cuda::CUDAStream cross_stream;
  compression::cuda::CudaExecutor executor;
  compression::cuda::CudaExecutor cross_executor;
  collectives::Scratch scratch;
  collectives::Scratch cross_scratch;
};

CudaLane::CudaLane() = default;

CudaLane::~CudaLane() {
  if (!state_) return;
  // The group may be destroyed on any thread: free on the group's device.
  const c10::cuda::CUDAGuard guard(state_->device);
  state_.reset();
}

std::shared_ptr<CudaTicket> CudaLane::admit(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(!tensors.empty(), "cgx: a CUDA call needs tensors");
  const c10::Device device = tensors[0].device();
  for (const auto& t : tensors)
    TORCH_CHECK(t.device() == device, "cgx: the tensors of one call must be on one device, got ",
                device, " and ", t.device());
  std::lock_guard<std::mutex> lock(mutex_);
  if (!state_) state_ = std::make_unique<State>(device);
  TORCH_CHECK(state_->device == device, "cgx: a group uses one CUDA device per rank: its first ",
              "CUDA call was on ", state_->device, ", this one is on ", device,
              " (make a group per device, or move the tensors)");
  auto ticket = std::make_shared<CudaTicket>();
  ticket->ready.record(c10::cuda::getCurrentCUDAStream(device.index()));
  for (const auto& t : tensors)
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), state_->stream);
  return ticket;
}

void CudaLane::run(CudaTicket& ticket, const std::function<void(const Lane&)>& fn) {
  State& s = *state_;  // set by the admit() that made the ticket
  const c10::cuda::CUDAGuard device_guard(s.device);
  const c10::cuda::CUDAStreamGuard stream_guard(s.stream);
  ticket.ready.block(s.stream);
  fn(Lane{&s.executor, &s.cross_executor, &s.scratch, &s.cross_scratch});
}

c10::Stream CudaLane::finished() {
  State& s = *state_;
  c10::Event done(c10::DeviceType::CUDA);
  done.record(s.stream);
  c10::cuda::CUDAStream settle = c10::cuda::getStreamFromPool(false, s.device.index());
  done.block(settle);
  return settle.unwrap();
}

#else  // a build without CUDA: CUDA tensors are refused with the reason

struct CudaTicket {};
struct CudaLane::State {};

CudaLane::CudaLane() = default;
CudaLane::~CudaLane() = default;

std::shared_ptr<CudaTicket> CudaLane::admit(const std::vector<at::Tensor>& tensors) {
  TORCH_CHECK(false, "cgx: got a tensor on ", tensors.at(0).device(),
              " but cgx was built without CUDA (a CPU torch, or no nvcc at build time); ",
              "reinstall cgx with a CUDA torch and nvcc present");
}

void CudaLane::run(CudaTicket&, const std::function<void(const Lane&)>&) {
  TORCH_INTERNAL_ASSERT(false, "cgx: CudaLane::run in a build without CUDA");
}

c10::Stream CudaLane::finished() {
  TORCH_INTERNAL_ASSERT(false, "cgx: CudaLane::finished in a build without CUDA");
}

#endif

}  // namespace cgx::backend
