#include "backend/process_group_cgx.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <algorithm>
#include <cstdio>
#include <optional>
#include <utility>

#include "backend/argument_checks.h"
#include "backend/cgx_work.h"
#include "backend/connect.h"
#include "collectives/call_agreement.h"
#include "collectives/call_signature.h"
#include "collectives/hierarchical_allreduce.h"
#include "collectives/sharded.h"
#include "compression/deferred_executor.h"

namespace cgx::backend {

namespace {

// Read where a call is issued, on the caller's thread, so a request covers exactly the
// calls made inside the caller's `with cgx.exact():` block.
thread_local bool exact_on_this_thread = false;

const char* op_name(c10d::ReduceOp::RedOpType op) {
  return op == c10d::ReduceOp::AVG ? "AVG" : "SUM";
}

// now + timeout, saturating (a timeout of years must not wrap into the past).
transport::Clock::time_point deadline_after(std::chrono::milliseconds timeout) {
  const auto now = transport::Clock::now();
  const auto room = std::chrono::duration_cast<std::chrono::milliseconds>(
      transport::Clock::time_point::max() - now);
  return timeout < room ? now + timeout : transport::Clock::time_point::max();
}

std::unique_ptr<compression::Executor> make_host_executor(const Settings& settings) {
  if (settings.deferred_execution) return std::make_unique<compression::DeferredExecutor>();
  return std::make_unique<compression::HostExecutor>(settings.codec_threads);
}

// The GPU of a call's tensors, for a Work whose future must order streams.
std::vector<c10::Device> gpu_of(const std::vector<at::Tensor>& tensors) {
  if (!tensors.empty() && tensors[0].is_cuda()) return {tensors[0].device()};
  return {};
}

}  // namespace

ProcessGroupCGX::ProcessGroupCGX(const c10::intrusive_ptr<c10d::Store>& store, int rank,
                                 int size, std::chrono::milliseconds timeout,
                                 c10::intrusive_ptr<c10d::Backend> exact,
                                 c10::intrusive_ptr<c10d::Backend> exact_cuda, Settings settings)
    : c10d::Backend(rank, size),
      settings_((validate(settings), std::move(settings))),
      settings_digest_(signed_settings_digest(settings_)),
      timeout_(timeout),
      exact_(checked_exact(std::move(exact), rank, size)),
      exact_cuda_(exact_cuda ? checked_exact(std::move(exact_cuda), rank, size) : exact_),
      connection_(connect(store, rank, size, exact_, settings_)),
      executor_(make_host_executor(settings_)),
      cross_executor_(make_host_executor(settings_)) {}

bool ProcessGroupCGX::hierarchical() const {
  return collectives::is_hierarchical(connection_.hosts);
}

ProcessGroupCGX::~ProcessGroupCGX() { shutdown(); }

bool ProcessGroupCGX::set_exact_on_this_thread(bool exact) {
  return std::exchange(exact_on_this_thread, exact);
}

void ProcessGroupCGX::shutdown() {
  if (shut_down_.exchange(true)) return;
  worker_.stop();  // runs the calls already queued, as Gloo drains its queue
  cross_worker_.stop();
  fail(Failure::kOther, "it was shut down on this rank (shutdown(), destroy_process_group())");
  // NCCL's communicators are released by its shutdown (torch warns when they are not).
  if (exact_cuda_ != exact_) exact_cuda_->shutdown();
  // Gloo has no shutdown of its own: its connections close with its last reference. Drop
  // ours (the transports hold the group too), so that a peer waiting on this rank learns
  // at once that it left (a PeerError) rather than at its timeout.
  connection_.transport.reset();
  exact_cuda_.reset();
  exact_.reset();
}

void ProcessGroupCGX::count(Counters Stats::*counters, const collectives::Traffic& traffic,
                            double bytes_per_value) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  Counters& c = stats_.*counters;
  c.calls += 1;
  c.bytes_sent += traffic.bytes;
  c.uncompressed_bytes += static_cast<uint64_t>(traffic.values * bytes_per_value);
}

collectives::ReductionAlgorithm ProcessGroupCGX::flat_algorithm() const {
  return num_hosts() == 1 ? settings_.inner_reduction : settings_.cross_reduction;
}

ProcessGroupCGX::Stats ProcessGroupCGX::stats() const {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  Stats s = stats_;
  s.cross_host_bytes = connection_.transport ? connection_.transport->cross_host_bytes() : 0;
  s.paths = paths_.stats();
  return s;
}

const char* ProcessGroupCGX::exact_reason_name(ExactReason reason) {
  switch (reason) {
    case ExactReason::kAuto: return "auto";
    case ExactReason::kAsked: return "cgx.exact";
    case ExactReason::kBits: return "bits";
    case ExactReason::kOp: return "op";
    case ExactReason::kDtype: return "dtype";
    case ExactReason::kMinimalSize: return "minimal_size";
    case ExactReason::kTensorList: return "tensor_list";
    case ExactReason::kCount: break;
  }
  return "?";
}

void ProcessGroupCGX::count_exact(ExactReason why, uint64_t bytes) {
  std::lock_guard<std::mutex> lock(stats_mutex_);
  ExactCounters& c = stats_.exact[static_cast<size_t>(why)];
  c.calls += 1;
  c.bytes += bytes;
}

std::optional<ProcessGroupCGX::ExactReason> ProcessGroupCGX::why_exact(const std::vector<at::Tensor>& tensors,
                                                                       const c10d::ReduceOp& op) const {
  if (exact_on_this_thread) return ExactReason::kAsked;
  if (settings_.bits == kRawBits) return ExactReason::kBits;
  if (!(op == c10d::ReduceOp::SUM || op == c10d::ReduceOp::AVG)) return ExactReason::kOp;
  if (tensors.empty() || !is_compressible_dtype(tensors[0].scalar_type())) return ExactReason::kDtype;
  int64_t numel = 0;
  for (const auto& t : tensors) {
    // torch.distributed hands a complex tensor over as its view_as_real: float values,
    // but not a float tensor the caller asked to compress.
    if (t.is_sparse() || (t.is_view() && t._base().is_complex())) return ExactReason::kDtype;
    numel += t.numel();
  }
  if (numel <= settings_.minimal_size) return ExactReason::kMinimalSize;
  return std::nullopt;
}

bool ProcessGroupCGX::travels_raw(const at::Tensor& tensor) const {
  return tensor.numel() <= settings_.minimal_size;
}

ProcessGroupCGX::Route ProcessGroupCGX::route_of(const std::vector<at::Tensor>& tensors,
                                                 const c10d::ReduceOp& op,
                                                 const compression::LayoutCodec* plan, ExactReason* why) const {
  // A caller's plan is followed whatever the group's bits, the sizes or cgx.exact() say.
  if (!plan) {
    if (const auto reason = why_exact(tensors, op)) {
      if (why) *why = *reason;
      return Route::kExact;
    }
  }
  // Auto times CPU calls only: a GPU call completes on streams that its timings do not
  // follow. And only calls that quantize something: an all-raw plan stays on the
  // compressed route, whose agreement it needs (ranks do not agree on a plan's being all
  // raw before their signatures meet). Without a plan, the group's codec quantizes the
  // tensors above minimal_size (per_tensor_codec).
  const bool quantizes =
      plan ? !plan->all_raw()
           : std::any_of(tensors.begin(), tensors.end(), [&](const at::Tensor& t) { return !travels_raw(t); });
  if (settings_.compression_auto && !tensors[0].is_cuda() && quantizes) return Route::kAuto;
  return Route::kCompressed;
}

void ProcessGroupCGX::check_usable() const { failure_->check(); }

uint64_t ProcessGroupCGX::begin_call() {
  check_usable();
  return ++sequence_;
}

void ProcessGroupCGX::fail(Failure kind, const std::string& cause) { failure_->fail(kind, cause); }

compression::LayoutCodec ProcessGroupCGX::per_tensor_codec(
    const std::vector<at::Tensor>& tensors) const {
  std::vector<compression::Segment> segments;
  int64_t offset = 0;
  for (const auto& t : tensors) {
    compression::Segment segment;
    segment.offset = offset;
    segment.numel = t.numel();
    segment.raw = travels_raw(t);
    segment.params = quantizer_of(settings_);
    segments.push_back(segment);
    offset += t.numel();
  }
  return compression::LayoutCodec(std::move(segments), offset);
}

c10d::Backend& ProcessGroupCGX::exact_for(const at::Tensor& tensor) const {
  check_usable();  // a shut-down group holds no exact backend
  return tensor.is_cuda() ? *exact_cuda_ : *exact_;
}

c10d::Backend& ProcessGroupCGX::exact_for(const std::vector<at::Tensor>& tensors) const {
  return tensors.empty() ? exact_for_no_tensor() : exact_for(tensors[0]);
}

c10d::Backend& ProcessGroupCGX::exact_for_no_tensor() const {
  check_usable();
  return *exact_;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::allreduce(std::vector<at::Tensor>& tensors,
                                                          const c10d::AllreduceOptions& opts) {
  check_tensors(tensors, "allreduce", /*sparse_ok=*/true);
  // Lists of several tensors are compressed through allreduce_coalesced only.
  ExactReason why = ExactReason::kTensorList;
  const Route route = tensors.size() == 1 ? route_of(tensors, opts.reduceOp, nullptr, &why) : Route::kExact;
  if (route == Route::kExact) return exact_allreduce(tensors, opts.reduceOp, /*coalesced=*/false, why);
  return compressed_allreduce(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE, route, nullptr);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::allreduce_coalesced(
    std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  check_tensors(tensors, "allreduce_coalesced", /*sparse_ok=*/true);
  check_one_device_and_dtype(tensors, "allreduce_coalesced");
  // The whole call takes one route: were its small tensors split off to Gloo, ranks whose
  // lists differ would leave Gloo calls pending that a later call pairs with.
  ExactReason why = ExactReason::kDtype;
  const Route route = route_of(tensors, opts.reduceOp, nullptr, &why);
  if (route == Route::kExact) return exact_allreduce(tensors, opts.reduceOp, /*coalesced=*/true, why);
  return compressed_allreduce(tensors, opts.reduceOp, c10d::OpType::ALLREDUCE_COALESCED, route,
                              std::make_shared<compression::LayoutCodec>(per_tensor_codec(tensors)));
}

namespace {
// Adds the residual to the float32 values about to be reduced and clears it for the
// collective to fill (Phase::residual); null without one.
float* fold_residual(at::Tensor& flat, const std::optional<at::Tensor>& residual) {
  if (!residual) return nullptr;
  at::Tensor r = residual->detach().view(-1);
  flat.add_(r);
  r.zero_();
  return r.data_ptr<float>();
}
}  // namespace

template <typename CollectiveOptions, typename Run>
const collectives::CallSignature* ProcessGroupCGX::agree_and_run(
    CollectiveOptions& options, uint64_t seed, const Lane& lane, const collectives::CallSignature& signature,
    uint32_t way, at::Tensor& flat, const std::optional<at::Tensor>& residual, Counters Stats::*counters,
    double bytes_per_value, Run run) {
  collectives::CallOptions& call = options;
  call.seed = seed;
  call.deadline = deadline_after(timeout_);
  call.executor = lane.executor;
  call.scratch = lane.scratch;
  call.piece_values = settings_.piece_values;
  collectives::AgreedCall transport(*connection_.transport, getRank(), getSize(), signature, way, call.deadline,
                                    *lane.scratch);
  // With a residual the agreement goes first, alone: the collective's first pieces fold
  // it in and rewrite it, and a call the ranks disagree on must leave it as it was (qsdp
  // keeps its residuals in the tensors it passes). A round trip, where keeping a copy
  // would cost a pass over the buffer every call.
  if (residual) transport.agree();
  call.residual = fold_residual(flat, residual);
  const collectives::Traffic traffic = run(options, transport);
  const collectives::CallSignature* all = transport.agree();
  count(counters, traffic, bytes_per_value);
  return all;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::allreduce_layout(
    at::Tensor tensor, std::vector<compression::Segment> layout, bool average,
    std::optional<at::Tensor> residual) {
  std::vector<at::Tensor> tensors{tensor};
  check_tensors(tensors, "allreduce_layout", /*sparse_ok=*/false);
  check_compressible_dtype(tensor.scalar_type(), "allreduce_layout");
  check_residual(residual, tensor, "allreduce_layout");
  auto codec = checked_layout(std::move(layout), tensor.numel(), "allreduce_layout");
  const auto op = average ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
  const Route route = route_of(tensors, op, codec.get());
  return compressed_allreduce(tensors, op, c10d::OpType::ALLREDUCE, route, std::move(codec),
                              std::move(residual));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::allgather_layout(
    at::Tensor output, at::Tensor input, std::vector<compression::Segment> shard_layout,
    uint64_t seed) {
  auto codec = checked_shard_call("allgather_layout", output, input, getSize(), std::move(shard_layout));
  auto body = [this, output, input, codec, seed](uint64_t sequence, const Lane& lane, CGXWork&) {
    at::NoGradGuard no_grad;
    const int64_t shard = input.numel();
    // Decoded in place where the output is float32; else through a float32 buffer.
    const bool in_place = output.scalar_type() == at::kFloat;
    at::Tensor flat = in_place ? output.detach().view(-1)
                               : at::empty({output.numel()}, output.options().dtype(at::kFloat));
    at::Tensor own = flat.narrow(0, getRank() * shard, shard);
    if (own.data_ptr() != input.data_ptr()) own.copy_(input.detach().view(-1));
    collectives::AllgatherOptions options;
    options.shard = codec.get();
    options.algorithm = flat_algorithm();
    agree_and_run(options, seed, lane, signature_of(sequence, {input}, flat.numel(), *codec, "gather"), 0,
                  flat, std::nullopt, &Stats::allgather, input.element_size(),
                  [&](const auto& o, collectives::AgreedCall& transport) {
                    return collectives::compressed_allgather(transport, getRank(), getSize(), flat.data_ptr<float>(), o);
                  });
    if (!in_place) output.detach().view(-1).copy_(flat);
  };
  return enqueue_compressed({output, input}, {output}, c10d::OpType::_ALLGATHER_BASE, std::move(body));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::reduce_scatter_layout(
    at::Tensor output, at::Tensor input, std::vector<compression::Segment> shard_layout,
    c10d::ReduceOp::RedOpType op, double factor, std::optional<at::Tensor> residual) {
  auto codec = checked_shard_call("reduce_scatter_layout", input, output, getSize(),
                                  std::move(shard_layout));
  check_reduce_scatter_op(op);
  check_residual(residual, input, "reduce_scatter_layout");
  const char* op_text = op == c10d::ReduceOp::SUM ? "rs:SUM" : op == c10d::ReduceOp::AVG ? "rs:AVG" : "rs:PRE";
  auto body = [this, output, input, codec, op, factor, residual, op_text](uint64_t sequence, const Lane& lane,
                                                                          CGXWork&) {
    at::NoGradGuard no_grad;
    const int64_t shard = output.numel();
    // The caller's input stays as it was (c10d's contract): the shards are summed in a copy.
    at::Tensor flat = input.detach().view(-1).to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
    collectives::ReduceScatterOptions options;
    options.shard = codec.get();
    const double scale = op == c10d::ReduceOp::PREMUL_SUM ? factor : 1.0;
    agree_and_run(options, call_seed(sequence), lane,
                  signature_of(sequence, {output}, flat.numel(), *codec, op_text, scale), 0, flat, residual,
                  &Stats::reduce_scatter, input.element_size(), [&](const auto& o, collectives::AgreedCall& transport) {
                    return collectives::compressed_reduce_scatter(transport, getRank(), getSize(),
                                                                  flat.data_ptr<float>(), o);
                  });
    at::Tensor own = flat.narrow(0, getRank() * shard, shard);
    if (op == c10d::ReduceOp::AVG) own.div_(getSize());
    if (op == c10d::ReduceOp::PREMUL_SUM) own.mul_(factor);
    output.detach().view(-1).copy_(own);
  };
  std::vector<at::Tensor> tensors{output, input};
  if (residual) tensors.push_back(*residual);
  return enqueue_compressed(tensors, {output}, c10d::OpType::_REDUCE_SCATTER_BASE, std::move(body));
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::exact_allreduce(std::vector<at::Tensor>& tensors,
                                                                const c10d::ReduceOp& op,
                                                                bool coalesced, ExactReason why) {
  c10d::Backend& exact = exact_for(tensors);
  const bool gloo_average = op == c10d::ReduceOp::AVG && exact.getBackendName() != "nccl";
  if (gloo_average) check_averageable(tensors);  // before the call is numbered
  begin_call();
  uint64_t bytes = 0;
  for (const auto& t : tensors) {
    bytes += t.is_sparse() ? t._indices().nbytes() + t._values().nbytes() : t.nbytes();
  }
  count_exact(why, bytes);
  auto run = [&](std::vector<at::Tensor>& reduced, const c10d::ReduceOp& reduce_op) {
    if (coalesced) {
      c10d::AllreduceCoalescedOptions o;
      o.reduceOp = reduce_op;
      o.timeout = timeout_;
      return exact.allreduce_coalesced(reduced, o);
    }
    c10d::AllreduceOptions o;
    o.reduceOp = reduce_op;
    o.timeout = timeout_;
    return exact.allreduce(reduced, o);
  };
  // NCCL averages itself; Gloo has no AVG.
  if (!gloo_average) return exact_call(exact, [&](c10d::Backend&) { return run(tensors, op); });
  // Gloo sums 16-bit floats in their own precision, so an average whose sum leaves their
  // range would be Inf (two ranks' 40000 in float16): the sum is made in float32, as the
  // compressed path makes it, and the average rounded once.
  std::vector<at::Tensor> summed = tensors;
  const auto dtype = tensors[0].scalar_type();
  const bool widen = tensors[0].layout() == at::kStrided && (dtype == at::kHalf || dtype == at::kBFloat16);
  if (widen) {
    at::NoGradGuard no_grad;
    for (auto& t : summed) t = t.detach().to(at::kFloat);
  }
  auto sum = exact_call(exact, [&](c10d::Backend&) { return run(summed, c10d::ReduceOp::SUM); });
  auto work =
      c10::make_intrusive<CGXWork>(getRank(), c10d::OpType::ALLREDUCE, tensors, gpu_of(tensors));
  const int size = getSize();
  // Runs where Gloo completes its future (on a GPU, with streams current that follow the
  // sum); divides only a sum that really completed.
  sum->getFuture()->addCallback([work, tensors, summed, widen, size](c10::ivalue::Future& done) {
    std::exception_ptr error = done.hasError() ? done.exception_ptr() : nullptr;
    if (!error) {
      try {
        for (size_t i = 0; i < tensors.size(); ++i) {
          summed[i].detach().div_(size);
          if (widen) tensors[i].detach().copy_(summed[i]);
        }
      } catch (...) {
        error = std::current_exception();
      }
    }
    work->settle(error);
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::compressed_allreduce(
    std::vector<at::Tensor> tensors, c10d::ReduceOp::RedOpType op, c10d::OpType op_type, Route route,
    std::shared_ptr<const compression::LayoutCodec> codec, std::optional<at::Tensor> residual) {
  std::vector<at::Tensor> used = tensors;
  if (residual) used.push_back(*residual);
  return enqueue_compressed(used, tensors, op_type,
                            [this, tensors, op, route, codec, residual](uint64_t sequence, const Lane& lane,
                                                                        CGXWork& work) mutable {
                              run_compressed(tensors, op, route, sequence, codec.get(), lane, residual, work);
                            });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::enqueue_compressed(
    const std::vector<at::Tensor>& tensors, std::vector<at::Tensor> outputs,
    c10d::OpType op_type, CompressedBody body) {
  // A call refused here is refused before it is numbered: this rank stays in step.
  std::shared_ptr<CudaTicket> ticket;
  if (tensors[0].is_cuda()) ticket = cuda_.admit(tensors);
  const uint64_t sequence = begin_call();
  auto work = c10::make_intrusive<CGXWork>(getRank(), op_type, outputs, gpu_of(outputs));
  const uint64_t completion = completions_->begin();
  auto task = [this, work, sequence, body = std::move(body), ticket, completion]() mutable {
    std::exception_ptr error;
    std::optional<c10::Stream> done_on;  // a GPU call's results are complete there
    try {
      check_usable();  // a call queued before an earlier one failed
      auto run = [&](const Lane& lane) { body(sequence, lane, *work); };
      if (ticket) {
        cuda_.run(*ticket, run);
        done_on = cuda_.finished();
      } else {
        run(Lane{executor_.get(), cross_executor_.get(), &scratch_, &cross_scratch_});
      }
    } catch (const collectives::CallMismatchError& e) {
      // Only signatures moved. Unless the ranks are at different calls of the group
      // (they took different paths before): then the exact path may be out of step too.
      if (e.out_of_step) fail(Failure::kMismatch, e.what());
      error = reported(std::current_exception());
    } catch (const std::exception& e) {
      // Data may be half delivered, or this rank failed before the call's check (memory,
      // say) while its peers wait in it: the ranks are out of step for good.
      error = reported(std::current_exception());
      fail(failure_of(error), message_of(e));
    } catch (...) {
      fail(Failure::kOther, "an unknown error in a compressed collective");
      error = std::current_exception();
    }
    // The call's tensors released before its caller learns it completed: a caller that
    // then exits must not leave its last reference to a tensor on this thread, whose
    // release takes the GIL, which Python's exit does not give back (std::terminate).
    body = nullptr;
    CGXWork::settle_async(std::move(work), error, done_on,
                          [completions = completions_, completion] { completions->end(completion); });
  };
  try {
    worker_.enqueue(std::move(task));
  } catch (...) {
    completions_->end(completion);
    throw;
  }
  return work;
}

collectives::CallSignature ProcessGroupCGX::signature_of(uint64_t sequence,
                                                         const std::vector<at::Tensor>& tensors,
                                                         int64_t numel,
                                                         const compression::LayoutCodec& codec,
                                                         const char* op, double scale) const {
  std::vector<std::vector<int64_t>> shapes;
  shapes.reserve(tensors.size());
  for (const auto& t : tensors) shapes.emplace_back(t.sizes().begin(), t.sizes().end());
  return collectives::CallSignature(sequence, shapes, numel, codec,
                                    c10::toString(tensors[0].scalar_type()), op, settings_.bits,
                                    settings_.bucket_size, settings_digest_, scale);
}

uint64_t ProcessGroupCGX::call_seed(uint64_t sequence) const {
  return collectives::stream_seed(settings_.seed, 0, 0, 0) ^ sequence;
}

void ProcessGroupCGX::run_compressed(std::vector<at::Tensor>& tensors,
                                     c10d::ReduceOp::RedOpType op, Route route, uint64_t sequence,
                                     const compression::LayoutCodec* codec, const Lane& lane,
                                     const std::optional<at::Tensor>& residual, CGXWork& work) {
  // Communication, not a differentiable op: write through detached views.
  at::NoGradGuard no_grad;
  // One contiguous float32 buffer holding every tensor; in place when the single tensor
  // already is one.
  const bool in_place = tensors.size() == 1 && tensors[0].scalar_type() == at::kFloat &&
                        tensors[0].is_contiguous();
  at::Tensor flat;
  int64_t input_bytes = 0;
  if (in_place) {
    flat = tensors[0].detach();
    input_bytes = flat.nbytes();
  } else {
    std::vector<at::Tensor> parts;
    parts.reserve(tensors.size());
    for (const auto& t : tensors) {
      parts.push_back(t.detach().reshape(-1).to(at::kFloat));
      input_bytes += t.numel() * t.element_size();
    }
    flat = at::cat(parts);
  }

  std::optional<compression::LayoutCodec> uniform;
  if (!codec) codec = &uniform.emplace(compression::LayoutCodec::uniform(quantizer_of(settings_), flat.numel()));

  collectives::AllreduceOptions options;
  options.codec = codec;
  options.inner = settings_.inner_reduction;
  options.cross = settings_.cross_reduction;
  options.leader_form = settings_.intra_broadcast;
  options.intra_compress = settings_.intra_compress;
  options.cross_executor = lane.cross_executor;
  options.cross_scratch = lane.cross_scratch;
  options.run_cross = [this](std::function<void()> job) { cross_worker_.enqueue(std::move(job)); };
  collectives::CallSignature signature = signature_of(sequence, tensors, flat.numel(), *codec, op_name(op));
  const int size_class = collectives::size_class(flat.numel());
  // Auto's way is known before the call moves anything (the agreed calls before it set
  // it, alike on every rank); the signature carries this rank's timings for the next.
  const bool choose_path = route == Route::kAuto;
  const collectives::Path path = choose_path ? paths_.next(size_class) : collectives::Path::kCompressed;
  if (choose_path) paths_.sign(size_class, signature);
  const auto raw = compression::LayoutCodec::raw(flat.numel());
  if (path == collectives::Path::kExact) options.codec = &raw;  // summed in float32, unquantized
  // Counted in the callers' dtypes (2 bytes a value for float16 / bfloat16).
  const auto started = std::chrono::steady_clock::now();
  const collectives::CallSignature* all = agree_and_run(
      options, call_seed(sequence), lane, signature, static_cast<uint32_t>(path), flat, residual, &Stats::allreduce,
      static_cast<double>(input_bytes) / flat.numel(),
      [&](collectives::AllreduceOptions& o, collectives::AgreedCall& transport) {
        return collectives::allreduce(transport, getRank(), connection_.hosts, flat.data_ptr<float>(), o);
      });
  if (choose_path) {
    const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - started;
    paths_.record(size_class, path, took.count());
    paths_.agreed(size_class, all, getSize());
  }
  if (path == collectives::Path::kExact) {
    work.mark_sent_exactly();
    count_exact(ExactReason::kAuto, static_cast<uint64_t>(input_bytes));
  }
  if (op == c10d::ReduceOp::AVG) flat.div_(getSize());
  if (in_place) return;
  int64_t offset = 0;
  for (auto& t : tensors) {
    t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
    offset += t.numel();
  }
}

// ---- Exact path: Gloo (or NCCL for CUDA tensors), called from the caller's thread (program order on every rank).

c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::broadcast(std::vector<at::Tensor>& tensors,
                                                          const c10d::BroadcastOptions& opts) {
  check_writable(tensors, "broadcast");
  begin_call();
  return exact_call(exact_for(tensors), [&](c10d::Backend& b) {
    return b.broadcast(tensors, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::reduce(std::vector<at::Tensor>& tensors,
                                                       const c10d::ReduceOptions& opts) {
  check_writable(tensors, "reduce");
  begin_call();
  return exact_call(exact_for(tensors), [&](c10d::Backend& b) {
    return b.reduce(tensors, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::allgather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  check_writable(outputs, "allgather");
  begin_call();
  return exact_call(exact_for(inputs), [&](c10d::Backend& b) {
    return b.allgather(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::_allgather_base(
    at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  check_writable({output}, "_allgather_base");
  begin_call();
  return exact_call(exact_for(input), [&](c10d::Backend& b) {
    return b._allgather_base(output, input, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::allgather_coalesced(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  check_writable(outputs, "allgather_coalesced");
  begin_call();
  return exact_call(exact_for(inputs), [&](c10d::Backend& b) {
    return b.allgather_coalesced(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::allgather_into_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::AllgatherOptions& opts) {
  check_writable(outputs, "allgather_into_tensor_coalesced");
  begin_call();
  return exact_call(exact_for(inputs), [&](c10d::Backend& b) {
    return b.allgather_into_tensor_coalesced(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::gather(
    std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::GatherOptions& opts) {
  check_writable(outputs, "gather");
  begin_call();
  return exact_call(exact_for(inputs), [&](c10d::Backend& b) {
    return b.gather(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ScatterOptions& opts) {
  check_writable(outputs, "scatter");
  begin_call();
  return exact_call(exact_for(outputs), [&](c10d::Backend& b) {
    return b.scatter(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::reduce_scatter(
    std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  check_writable(outputs, "reduce_scatter");
  begin_call();
  return exact_call(exact_for(outputs), [&](c10d::Backend& b) {
    return b.reduce_scatter(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::_reduce_scatter_base(
    at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) {
  check_writable({output}, "_reduce_scatter_base");
  begin_call();
  return exact_call(exact_for(input), [&](c10d::Backend& b) {
    return b._reduce_scatter_base(output, input, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::reduce_scatter_tensor_coalesced(
    std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
    const c10d::ReduceScatterOptions& opts) {
  check_writable(outputs, "reduce_scatter_tensor_coalesced");
  begin_call();
  return exact_call(exact_for(inputs), [&](c10d::Backend& b) {
    return b.reduce_scatter_tensor_coalesced(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::alltoall_base(
    at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_split_sizes,
    std::vector<int64_t>& input_split_sizes, const c10d::AllToAllOptions& opts) {
  check_writable({output}, "alltoall_base");
  begin_call();
  return exact_call(exact_for(input), [&](c10d::Backend& b) {
    return b.alltoall_base(output, input, output_split_sizes, input_split_sizes, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::alltoall(std::vector<at::Tensor>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllToAllOptions& opts) {
  check_writable(outputs, "alltoall");
  begin_call();
  return exact_call(exact_for(inputs), [&](c10d::Backend& b) {
    return b.alltoall(outputs, inputs, opts);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::send(std::vector<at::Tensor>& tensors,
                                                     int dst_rank, int tag) {
  check_tag(tag);
  check_usable();
  return exact_call(exact_for(tensors), [&](c10d::Backend& b) {
    return b.send(tensors, dst_rank, tag);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::recv(std::vector<at::Tensor>& tensors,
                                                     int src_rank, int tag) {
  check_writable(tensors, "recv");
  check_tag(tag);
  check_usable();
  return exact_call(exact_for(tensors), [&](c10d::Backend& b) {
    return b.recv(tensors, src_rank, tag);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::recvAnysource(std::vector<at::Tensor>& tensors,
                                                              int tag) {
  check_writable(tensors, "recvAnysource");
  check_tag(tag);
  check_usable();
  return exact_call(exact_for(tensors), [&](c10d::Backend& b) {
    return b.recvAnysource(tensors, tag);
  });
}
c10::intrusive_ptr<c10d::Work> ProcessGroupCGX::barrier(const c10d::BarrierOptions& opts) {
  // Gloo's barrier is issued now (Gloo's program order); it completes once Gloo's barrier
  // has and every compressed collective queued before it has completed, as a barrier
  // should.
  begin_call();
  auto gloo_barrier = exact_call(exact_for_no_tensor(), [&](c10d::Backend& b) { return b.barrier(opts); });
  auto work = c10::make_intrusive<CGXWork>(getRank(), c10d::OpType::BARRIER,
                                           std::vector<at::Tensor>{});
  const uint64_t earlier = completions_->mark();
  worker_.enqueue([work, gloo_barrier, completions = completions_, earlier]() {
    std::exception_ptr error;
    try {
      gloo_barrier->wait();
    } catch (...) {
      error = std::current_exception();
    }
    completions->after(earlier, [work, error] { CGXWork::settle_async(work, error); });
  });
  return work;
}

}  // namespace cgx::backend
