#include "collectives/hierarchical_allreduce.h"

#include <algorithm>
#include <condition_variable>
#include <exception>
#include <mutex>

#include "transport/subset_transport.h"

namespace cgx::collectives {

namespace {
constexpr int kIntraScatterStage = 100;
constexpr int kCrossStage = 101;
// Pieces of the pipeline: at least this many values each (smaller ones cost more in
// per-exchange latency than they overlap), at most kMaxPieces.
constexpr int64_t kMinPieceValues = int64_t{1} << 20;
constexpr int kMaxPieces = 4;

int index_of(const std::vector<int>& ranks, int rank) {
  return static_cast<int>(std::find(ranks.begin(), ranks.end(), rank) - ranks.begin());
}

// Progress shared by the two threads of one call: pieces whose host reduction (A) and
// whose cross phase (B) are done, the first failure of either thread, and whether the
// cross thread's job has returned (it uses this call's stack until then).
class Pipeline {
 public:
  void finished_host_reduction(int piece) { advance(reduced_, piece); }
  void finished_cross_phase(int piece) { advance(crossed_, piece); }
  void wait_host_reduction(int piece) { wait(reduced_, piece); }
  void wait_cross_phase(int piece) { wait(crossed_, piece); }
  void cross_job_returned() {
    std::lock_guard<std::mutex> lock(mutex_);
    returned_ = true;
    changed_.notify_all();
  }
  void wait_cross_job() {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return returned_; });
  }
  void fail(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = error;
    changed_.notify_all();
  }
  std::exception_ptr error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }

 private:
  void advance(int& counter, int piece) {
    std::lock_guard<std::mutex> lock(mutex_);
    counter = piece + 1;
    changed_.notify_all();
  }
  // Throws the other thread's error instead of waiting for a piece that will not come.
  void wait(const int& counter, int piece) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return counter > piece || error_; });
    if (counter <= piece) std::rethrow_exception(error_);
  }

  std::mutex mutex_;
  std::condition_variable changed_;
  int reduced_ = 0;
  int crossed_ = 0;
  bool returned_ = false;
  std::exception_ptr error_;
};

}  // namespace

bool is_hierarchical(const topology::HostMap& hosts) {
  return hosts.num_hosts() > 1 && hosts.num_hosts() < hosts.size();
}

Traffic hierarchical_allreduce(transport::Transport& transport, int rank,
                               const topology::HostMap& hosts, float* data,
                               const AllreduceOptions& options) {
  const compression::LayoutCodec& codec = *options.codec;
  Scratch& scratch = *options.scratch;
  Scratch& cross_scratch = *options.cross_scratch;
  const int64_t total = codec.total();
  if (total == 0) return {};
  // The cross executor may start first (a host with one rank): it must see the values as
  // the caller's executor has them now.
  options.executor->sync();
  const std::vector<int>& local = hosts.ranks_on_host_of(rank);
  const int k = static_cast<int>(local.size());
  const int i = index_of(local, rank);
  const int num_hosts = hosts.num_hosts();
  const int host = hosts.host_of(rank);
  const bool leader_form = options.leader_form || !hosts.balanced();
  const bool crosses = !leader_form || i == 0;

  // Inside a host: the call's codec, or float32 throughout.
  const compression::LayoutCodec raw = compression::LayoutCodec::raw(total);
  const compression::LayoutCodec& intra_codec = options.intra_compress ? codec : raw;
  // The cross phases run on the cross thread's executor and scratch, and move each part
  // in pieces of CallOptions::piece_values like the flat allreduce, so that the link is
  // busy while the next piece is compressed.
  auto cross_phase = [&] {
    Phase phase{options, options.cross};
    phase.executor = options.cross_executor;
    phase.scratch = options.cross_scratch;
    return phase;
  };

  // The buffer is cut into pieces; chunk j of a piece is reduced by local rank j, and cut
  // into one part per host for the cross phase. Every cut is on the call's bucket grid.
  const int num_pieces =
      static_cast<int>(std::clamp<int64_t>(total / kMinPieceValues, 1, kMaxPieces));
  const Chunking pieces(codec, {0, total}, num_pieces);
  std::vector<Chunking> chunks;           // [piece]
  std::vector<std::vector<Chunking>> parts;  // [piece][j]
  std::vector<PieceLayout> part_pieces;   // [piece * k + j]: how the cross phases cut them
  std::vector<size_t> part_bytes;         // [(piece * k + j) * num_hosts + h]
  for (int p = 0; p < num_pieces; ++p) {
    chunks.push_back(leader_form ? Chunking::to_one(pieces.range(p), k, 0)
                                 : Chunking(codec, pieces.range(p), k));
    parts.emplace_back();
    for (int j = 0; j < k; ++j) {
      parts[p].emplace_back(codec, chunks[p].range(j), num_hosts);
      part_pieces.push_back(cross_phase().pieces(codec, parts[p][j]));
      for (size_t bytes : part_pieces.back().chunk_bytes()) part_bytes.push_back(bytes);
    }
  }
  // The compressed parts as the cross phase leaves them, kept to be forwarded (arena 1:
  // the phases use arena 0).
  const std::vector<uint8_t*> kept = scratch.buffers(part_bytes, 1);
  auto slot = [&](int p, int j, int h) { return (p * k + j) * num_hosts + h; };

  std::vector<int> cross_members;
  for (int h = 0; h < num_hosts; ++h)
    cross_members.push_back(hosts.ranks_on_host(h)[leader_form ? 0 : i]);
  transport::SubsetTransport intra(transport, local);
  transport::SubsetTransport cross(transport, cross_members);

  // A: reduce piece p inside the host (inner algorithm).
  auto reduce_on_host = [&](int p) {
    if (k == 1) return Traffic{};
    Phase phase{options, options.inner};
    phase.seed = stream_seed(options.seed, host, kIntraScatterStage, p);
    phase.piece_values = 0;  // the pieces are this function's own (p)
    return reduce_scatter(intra, i, data, intra_codec, chunks[p], phase, scratch);
  };
  // B: allreduce our chunk of piece p across hosts, keeping the final bytes.
  auto allreduce_across_hosts = [&](int p) {
    Phase phase = cross_phase();
    phase.seed = stream_seed(options.seed, i, kCrossStage, p);
    phase.keep_bytes = true;  // share_on_host forwards the allgather's bytes
    std::vector<uint8_t*> ours(kept.begin() + slot(p, i, 0), kept.begin() + slot(p, i, num_hosts));
    return allreduce_chunks(cross, host, data, codec, parts[p][i], phase, cross_scratch, ours);
  };
  // C: forward the bytes of our chunk's parts to the host's other ranks and decode
  // theirs: every rank decodes every part from the bytes its owner made (bit-identical).
  auto share_on_host = [&](int p) {
    Traffic t;
    if (k == 1) return t;
    std::vector<transport::Send> sends;
    std::vector<transport::Recv> recvs;
    for (int j = 0; j < k; ++j) {
      if (j == i) continue;
      for (int h = 0; h < num_hosts; ++h) {
        sends.push_back({j, kept[slot(p, i, h)], part_bytes[slot(p, i, h)]});
        recvs.push_back({j, kept[slot(p, j, h)], part_bytes[slot(p, j, h)]});
        t += {part_bytes[slot(p, i, h)], static_cast<uint64_t>(parts[p][i].length(h))};
      }
    }
    intra.exchange(sends, recvs, options.deadline);
    for (int j = 0; j < k; ++j) {
      if (j == i) continue;
      const PieceLayout& layout = part_pieces[p * k + j];
      for (int h = 0; h < num_hosts; ++h)
        for (int q = 0; q < layout.count(); ++q) {
          const Range piece = layout.range(h, q);
          options.executor->decompress(codec, kept[slot(p, j, h)] + layout.offset(h, q),
                                       piece.begin, piece.end, data);
        }
    }
    options.executor->sync();  // before the cross executor writes `kept` again
    return t;
  };

  if (num_pieces == 1 || !crosses || !options.run_cross) {
    Traffic traffic = reduce_on_host(0);
    for (int p = 0; p < num_pieces; ++p) {
      if (p + 1 < num_pieces) traffic += reduce_on_host(p + 1);
      if (crosses) traffic += allreduce_across_hosts(p);
      traffic += share_on_host(p);
    }
    return traffic;
  }

  // Pipelined: this thread reduces and shares on the host (A0, A1, C0, A2, C1, ...: the
  // same order on every local rank), the cross thread runs the cross phases (B0, B1, ...)
  // as soon as their piece is reduced, so that the link is busy while the host computes.
  // The two use disjoint peers, transports and scratch.
  Pipeline pipeline;
  Traffic cross_traffic;
  options.run_cross([&] {
    try {
      options.cross_executor->bind_thread();
      for (int p = 0; p < num_pieces; ++p) {
        pipeline.wait_host_reduction(p);
        cross_traffic += allreduce_across_hosts(p);
        pipeline.finished_cross_phase(p);
      }
    } catch (...) {
      pipeline.fail(std::current_exception());
    }
    pipeline.cross_job_returned();
  });
  Traffic traffic;
  try {
    traffic += reduce_on_host(0);
    pipeline.finished_host_reduction(0);
    for (int p = 0; p < num_pieces; ++p) {
      if (p + 1 < num_pieces) {
        traffic += reduce_on_host(p + 1);
        pipeline.finished_host_reduction(p + 1);
      }
      pipeline.wait_cross_phase(p);
      traffic += share_on_host(p);
    }
  } catch (...) {
    pipeline.fail(std::current_exception());
  }
  pipeline.wait_cross_job();  // bounded: its waits end at the deadline or on our failure
  if (auto error = pipeline.error()) std::rethrow_exception(error);
  traffic += cross_traffic;
  return traffic;
}

}  // namespace cgx::collectives
