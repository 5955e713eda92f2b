// ProcessGroupCGX: the torch.distributed backend "cgx" — the only code that knows c10d.
//
// Compressed path: allreduce / allreduce_coalesced of float32, float16 and bfloat16 CPU
// or CUDA tensors with SUM or AVG and more than `minimal_size` elements in all, when
// bits < 32; allreduce_layout; and allgather_layout / reduce_scatter_layout (cgx.qsdp's
// FSDP2 traffic). An allreduce's route (route_of: exact, compressed, or compressed with
// auto's choice) is chosen once, at its entry, from what every rank must agree on (dtype,
// op, total size), never from how a rank's list is split, so ranks given different calls
// all reach the call signature check before any data moves. Argument checks:
// argument_checks.h.
// It runs on the group's worker thread (csrc/collectives over csrc/transport): flat on
// one host or with one rank per host, hierarchical otherwise. With CGX_COMPRESSION_AUTO a
// CPU call's way (compressed, or every value raw) is chosen there once the call is
// agreed, so both ways keep the compressed path's checks. CUDA tensors are compressed
// on the GPU, on the group's own streams (cuda_lane.h).
// Exact path: everything else goes to a wrapped backend, called from the caller's thread
// so that it sees its collectives in program order on every rank: Gloo, or for CUDA
// tensors the CUDA exact backend when there is one (NCCL). Sparse tensors, and the
// allreduces a thread issues while it asks for exact calls (cgx.exact()), go there too.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>

#include <array>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include "backend/cgx_work.h"
#include "backend/completion_order.h"
#include "backend/connect.h"
#include "backend/cuda_lane.h"
#include "backend/errors.h"
#include "backend/exact_work.h"
#include "backend/settings.h"
#include "backend/worker.h"
#include "collectives/allreduce.h"
#include "collectives/call_signature.h"
#include "collectives/path_choice.h"

namespace cgx::backend {

class ProcessGroupCGX final : public c10d::Backend {
 public:
  // `exact`: a Gloo backend for this group, created on its own prefix of `store`.
  // `exact_cuda`: the backend for CUDA tensors on the exact path (NCCL), or null for Gloo,
  // which stages them through host memory.
  ProcessGroupCGX(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                  std::chrono::milliseconds timeout, c10::intrusive_ptr<c10d::Backend> exact,
                  c10::intrusive_ptr<c10d::Backend> exact_cuda, Settings settings);
  ~ProcessGroupCGX() override;

  const std::string getBackendName() const override { return "cgx"; }
  const Settings& settings() const { return settings_; }
  // The backend CUDA tensors take on the exact path ("gloo" or "nccl").
  std::string cuda_exact_backend() const { return exact_for_no_tensor(), exact_cuda_->getBackendName(); }
  int num_hosts() const { return connection_.hosts.num_hosts(); }
  // Whether compressed allreduces take the hierarchical path.
  bool hierarchical() const;
  void shutdown() override;
  // While set, the allreduces this thread issues on any cgx group take the exact path
  // (cgx.exact(): a metric averaged on a compressing group); allreduce_layout keeps the
  // plan it is given. Returns the previous value.
  static bool set_exact_on_this_thread(bool exact);
  // Gloo's: TORCH_DISTRIBUTED_DEBUG=DETAIL checks them to catch desynchronized ranks.
  void setSequenceNumberForGroup() override { exact_for_no_tensor().setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return exact_for_no_tensor().getSequenceNumberForGroup(); }

  // Totals over this rank's compressed calls of one collective (read from any thread).
  struct Counters {
    uint64_t calls = 0;
    uint64_t bytes_sent = 0;          // payload this rank put on the wire
    uint64_t uncompressed_bytes = 0;  // what the same algorithm sends without compression
  };
  // Why an allreduce went the exact way (stats' "exact_why": exact_reason_name).
  enum class ExactReason {
    kAuto,          // CGX_COMPRESSION_AUTO timed the exact way faster for its size
    kAsked,         // issued inside cgx.exact()
    kBits,          // the group does not quantize (CGX_COMPRESSION_QUANTIZATION_BITS=32)
    kOp,            // a reduce op other than SUM and AVG
    kDtype,         // not a floating dtype, or a complex or sparse tensor
    kMinimalSize,   // at most CGX_COMPRESSION_MINIMAL_SIZE values
    kTensorList,    // allreduce of several tensors (allreduce_coalesced compresses lists)
    kCount,
  };
  static const char* exact_reason_name(ExactReason reason);
  struct ExactCounters {
    uint64_t calls = 0;
    uint64_t bytes = 0;  // the calls' tensors, in their dtype
  };
  struct Stats {
    Counters allreduce;
    std::array<ExactCounters, static_cast<size_t>(ExactReason::kCount)> exact;  // allreduces, by reason
    Counters allgather;
    Counters reduce_scatter;
    uint64_t cross_host_bytes = 0;    // all bytes this rank sent to other hosts
    std::vector<collectives::PathChooser::ClassStats> paths;  // CGX_COMPRESSION_AUTO's choices
  };
  Stats stats() const;

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;

  // Allreduce of one float tensor compressed segment by segment as `layout` says (the
  // per-layer plan of a DDP bucket); raw segments travel unquantized (float32). The
  // layout is part of the call, compared across ranks like its size.
  // `residual` (float32, the tensor's size, on its device): error feedback. It is added to
  // the input first, then holds what this rank's quantizations dropped, both stages
  // (docs/error-feedback.md).
  c10::intrusive_ptr<c10d::Work> allreduce_layout(at::Tensor tensor,
                                                  std::vector<compression::Segment> layout,
                                                  bool average,
                                                  std::optional<at::Tensor> residual = std::nullopt);

  // All-gather of equal shards (FSDP2's weights), compressed segment by segment as
  // `shard_layout` says (one shard's plan; every shard has it): `input` is this rank's
  // shard (it may be `output`'s own slice), `output` the size shards end to end. Every rank
  // ends with bit-identical outputs, its own shard included. `seed`: stochastic rounding's
  // stream for this rank's shard, where the layout asks for it.
  c10::intrusive_ptr<c10d::Work> allgather_layout(at::Tensor output, at::Tensor input,
                                                  std::vector<compression::Segment> shard_layout,
                                                  uint64_t seed);
  // Reduce-scatter (FSDP2's gradients): `input` is size shards, shard r this rank's
  // contribution to rank r; `output` becomes the sum of every rank's contribution to this
  // one, each quantized once as `shard_layout` says. op: SUM, AVG, or PREMUL_SUM with
  // `factor` (applied to the sum). `residual` (float32, input's size), when given, is this
  // rank's error feedback: added to the input before quantization, and left holding what
  // quantization lost.
  c10::intrusive_ptr<c10d::Work> reduce_scatter_layout(at::Tensor output, at::Tensor input,
                                                       std::vector<compression::Segment> shard_layout,
                                                       c10d::ReduceOp::RedOpType op, double factor,
                                                       std::optional<at::Tensor> residual);

  // Exact path: forwarded to Gloo.
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

 private:
  // How an allreduce goes, decided once, at its entry, from what every rank must agree on.
  enum class Route {
    kExact,       // the wrapped backend, from the caller's thread
    kCompressed,  // the worker, as the codec says
    kAuto,        // the worker; CGX_COMPRESSION_AUTO picks compressed or exact once agreed
  };
  // The route of an allreduce of `tensors` with `op`; `plan`: the caller's layout
  // (allreduce_layout), or null where the group's settings decide.
  // Where it is kExact, `why` (if given) says why.
  Route route_of(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op,
                 const compression::LayoutCodec* plan, ExactReason* why = nullptr) const;
  // Why the group's settings do not compress an allreduce of `tensors` (route_of, no
  // plan); none where they do.
  std::optional<ExactReason> why_exact(const std::vector<at::Tensor>& tensors, const c10d::ReduceOp& op) const;
  // Counts an allreduce that went the exact way.
  void count_exact(ExactReason why, uint64_t bytes);
  // Whether the group's codec sends `tensor` raw in a coalesced call (minimal_size).
  bool travels_raw(const at::Tensor& tensor) const;
  // The exact backend for tensors on the device of `tensor`.
  c10d::Backend& exact_for(const at::Tensor& tensor) const;
  c10d::Backend& exact_for(const std::vector<at::Tensor>& tensors) const;  // exact_ if none
  c10d::Backend& exact_for_no_tensor() const;  // exact_ (raises once the group failed or shut down)
  // `call` on `backend`, an exact backend: on the Gloo one, its Work as an ExactWork, and
  // an error it raises at once reported as ExactWork reports one at the wait (errors.h,
  // exact_failure). NCCL's Work is handed back as it is.
  template <typename Call>
  c10::intrusive_ptr<c10d::Work> exact_call(c10d::Backend& backend, Call&& call) {
    if (&backend != exact_.get()) return call(backend);
    try {
      return c10::make_intrusive<ExactWork>(call(backend), failure_);
    } catch (...) {
      std::rethrow_exception(exact_failure(std::current_exception(), *failure_));
    }
  }
  // Raises once the group failed (the type of the first failure: errors.h).
  void check_usable() const;
  // Every collective starts here: refused once the group failed; numbered (sequence_).
  uint64_t begin_call();
  // Marks the group unusable with its first cause (later calls raise it).
  void fail(Failure kind, const std::string& cause);
  // The group's settings per tensor of a coalesced call; tensors at or under
  // minimal_size travel unquantized.
  compression::LayoutCodec per_tensor_codec(const std::vector<at::Tensor>& tensors) const;
  // Gloo allreduce, with AVG done as SUM followed by a division (Gloo has no AVG; 16-bit
  // values summed in float32).
  c10::intrusive_ptr<c10d::Work> exact_allreduce(std::vector<at::Tensor>& tensors,
                                                 const c10d::ReduceOp& op, bool coalesced, ExactReason why);
  // Numbers a compressed call now and queues `body` on the worker thread; any failure of
  // it but a same-step signature mismatch marks the group failed. `tensors`: the call's
  // tensors (a CUDA call follows their caller's stream); `outputs`: the work's result.
  using CompressedBody = std::function<void(uint64_t sequence, const Lane& lane, CGXWork& work)>;
  c10::intrusive_ptr<c10d::Work> enqueue_compressed(const std::vector<at::Tensor>& tensors,
                                                    std::vector<at::Tensor> outputs,
                                                    c10d::OpType op_type, CompressedBody body);
  // Queues a compressed allreduce of `tensors` (reduced in place, the work's result).
  // `route`: kCompressed or kAuto (route_of). `codec` null: the group's uniform settings.
  // `residual`: allreduce_layout's.
  c10::intrusive_ptr<c10d::Work> compressed_allreduce(
      std::vector<at::Tensor> tensors, c10d::ReduceOp::RedOpType op, c10d::OpType op_type, Route route,
      std::shared_ptr<const compression::LayoutCodec> codec,
      std::optional<at::Tensor> residual = std::nullopt);
  // The worker's part of compressed_allreduce. With route kAuto, CGX_COMPRESSION_AUTO
  // picks the way (collectives/path_choice.h): compressed, or exact (every value raw, the
  // sum in float32, through the same agreed collective).
  void run_compressed(std::vector<at::Tensor>& tensors, c10d::ReduceOp::RedOpType op, Route route,
                      uint64_t sequence, const compression::LayoutCodec* codec, const Lane& lane,
                      const std::optional<at::Tensor>& residual, CGXWork& work);
  // What every rank must agree on before a compressed call moves data; `op`: the
  // collective and its reduction, as the mismatch message names them; `scale`: what the
  // sum is multiplied by.
  collectives::CallSignature signature_of(uint64_t sequence, const std::vector<at::Tensor>& tensors,
                                          int64_t numel, const compression::LayoutCodec& codec,
                                          const char* op, double scale = 1.0) const;
  // The skeleton of every compressed call's body, once its values are in `flat` (float32):
  // the call options (`seed`, the deadline, the lane's executor and scratch), the residual
  // folded in, `run(options, transport)` (the collective, on a transport that carries
  // `signature` and `way` in its first exchange: collectives/call_agreement.h), its
  // traffic counted in `counters`. Returns every rank's signature. A call the ranks
  // disagree on leaves the residual as it was. The body before it flattens the call's
  // tensors; after it, writes the results back.
  template <typename CollectiveOptions, typename Run>
  const collectives::CallSignature* agree_and_run(CollectiveOptions& options, uint64_t seed, const Lane& lane,
                                                  const collectives::CallSignature& signature, uint32_t way,
                                                  at::Tensor& flat, const std::optional<at::Tensor>& residual,
                                                  Counters Stats::*counters, double bytes_per_value, Run run);
  // Stochastic rounding's seed for the call numbered `sequence`.
  uint64_t call_seed(uint64_t sequence) const;
  // Adds a call's traffic to `counters`; `bytes_per_value`: the caller's element size.
  void count(Counters Stats::*counters, const collectives::Traffic& traffic,
             double bytes_per_value);
  // The flat algorithm (the hierarchical path is for allreduces).
  collectives::ReductionAlgorithm flat_algorithm() const;

  const Settings settings_;
  const uint64_t settings_digest_;  // signed_settings_digest(settings_), in every signature
  const std::chrono::milliseconds timeout_;
  c10::intrusive_ptr<c10d::Backend> exact_;
  c10::intrusive_ptr<c10d::Backend> exact_cuda_;  // exact_ when there is no NCCL
  Connection connection_;  // which ranks share a host, and the transports to reach them
  collectives::Scratch scratch_;        // used by the worker thread only
  collectives::Scratch cross_scratch_;  // the hierarchical cross phases (their own thread)
  // CPU values: the host codec, or with deferred_execution one queue per thread.
  std::unique_ptr<compression::Executor> executor_;
  std::unique_ptr<compression::Executor> cross_executor_;
  CudaLane cuda_;                       // streams, executors and pinned scratch on a GPU
  // CGX_COMPRESSION_AUTO's timings and choices (the worker's; stats() reads them).
  collectives::PathChooser paths_;
  // Collectives issued, exact ones included (callers' threads): a compressed call's
  // number differs between ranks whenever they took different paths before it (a size
  // on either side of minimal_size, a dtype mismatch), and its signature check fails.
  std::atomic<uint64_t> sequence_{0};
  // Set once, when a failure while data moved left the group unusable (peers may be out
  // of step): every later call raises it, exact ones included.
  // The first failure (errors.h); exact calls' Works report theirs into it too.
  std::shared_ptr<GroupFailure> failure_ = std::make_shared<GroupFailure>();
  mutable std::mutex stats_mutex_;
  Stats stats_;
  // Shutdown runs the collectives already queued (as Gloo drains its queue): a rank that
  // dropped them would leave the peers that started them waiting out the timeout.
  std::atomic<bool> shut_down_{false};
  // Compressed collectives' completions, which barriers follow (shared with the settling
  // tasks, which may outlive the group).
  std::shared_ptr<CompletionOrder> completions_ = std::make_shared<CompletionOrder>();
  // The hierarchical allreduce's cross phases, beside the worker's call (persistent, so
  // that no call starts a thread). Stopped after the worker: a call waits for its job.
  Worker cross_worker_;
  Worker worker_;  // last: stopped before the members its tasks use are destroyed
};

}  // namespace cgx::backend
