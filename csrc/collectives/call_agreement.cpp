#include "collectives/call_agreement.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace cgx::collectives {

using transport::Clock;
using transport::Pending;
using transport::Recv;
using transport::Send;

// What starts every first message.
struct AgreedCall::Header {
  uint64_t length = 0;  // of the whole message, this header included (Recv::up_to)
  // The whole of the first send to the receiver whose first bytes follow (kNone: the
  // first exchange sent it nothing).
  uint64_t first_bytes = kNone;
  uint64_t way = 0;
  CallSignature signature;
  static constexpr uint64_t kNone = ~uint64_t{0};
};

struct AgreedCall::First {
  std::unique_ptr<Pending> pending;  // the first messages
  std::vector<uint8_t*> out, in;     // per peer (null for this rank)
  // The first exchange past what the first messages carry, posted once agreed.
  std::vector<Send> rest_sends;
  std::vector<Recv> held_recvs;
  std::unique_ptr<Pending> rest;
  // Per peer, what its first message carried for this rank's first receive from it
  // (which may come in a later exchange: the ranks of a hierarchical allreduce start
  // with different phases).
  struct Carried {
    size_t bytes = 0;
    uint64_t whole = 0;
    bool undelivered = false;
  };
  std::vector<Carried> carried;
};

namespace {
// What post() returns for the first exchange: waiting for it waits for the agreement and
// for the rest of that exchange.
struct FirstExchange final : Pending {};

const char* way_name(uint64_t way) { return way == 0 ? "compressed" : "exactly"; }
}  // namespace

AgreedCall::AgreedCall(transport::Transport& base, int rank, int size, const CallSignature& mine,
                       uint32_t way, Clock::time_point deadline, Scratch& scratch)
    : base_(base), rank_(rank), size_(size), way_(way), deadline_(deadline), scratch_(scratch),
      carried_(size > 1 ? std::min(kCarriedBytes, kCarriedTotal / (size - 1)) / 64 * 64 : 0),
      mine_(mine) {
  static_assert(sizeof(Header) == kHeaderBytes, "sent as raw bytes: no padding");
}

AgreedCall::~AgreedCall() {
  // The collective failed with a first exchange it never waited for: settle it before
  // its buffers go.
  if (!first_) return;
  if (first_->pending) base_.abandon(*first_->pending, deadline_);
  if (first_->rest) base_.abandon(*first_->rest, deadline_);
}

std::unique_ptr<Pending> AgreedCall::post(const std::vector<Send>& sends, const std::vector<Recv>& recvs) {
  if (state_.load() == State::kAgreed && undelivered_.load() == 0) return base_.post(sends, recvs);
  std::lock_guard<std::mutex> lock(mutex_);
  switch (state_.load()) {
    case State::kFresh:
      post_first(sends, recvs);
      return std::make_unique<FirstExchange>();
    case State::kPosted:
      resolve();  // a second exchange before the first was waited for
      break;
    case State::kFailed:
      std::rethrow_exception(error_);
    case State::kAgreed:
      break;
  }
  return base_.post(sends, deliver(recvs));
}

void AgreedCall::wait(Pending& pending, Clock::time_point deadline) {
  if (dynamic_cast<FirstExchange*>(&pending) == nullptr) return base_.wait(pending, deadline);
  std::unique_ptr<Pending> rest;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (state_.load() == State::kPosted) resolve();
    if (state_.load() == State::kFailed) std::rethrow_exception(error_);
    rest = std::move(first_->rest);
  }
  if (rest) base_.wait(*rest, deadline);
}

const CallSignature* AgreedCall::agree() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (state_.load() == State::kFresh) post_first({}, {});
  if (state_.load() == State::kPosted) resolve();
  if (state_.load() == State::kFailed) std::rethrow_exception(error_);
  if (undelivered_.load() != 0)
    throw std::logic_error("cgx: a peer sent this rank bytes its collective never received (an internal error)");
  return signatures_;
}

void AgreedCall::post_first(const std::vector<Send>& sends, const std::vector<Recv>& recvs) {
  first_ = std::make_unique<First>();
  First& first = *first_;
  const size_t message = sizeof(Header) + carried_;
  std::vector<size_t> sizes{size_ * sizeof(CallSignature)};
  for (int p = 0; p < size_; ++p) sizes.push_back(p == rank_ ? 0 : message);  // out
  for (int p = 0; p < size_; ++p) sizes.push_back(p == rank_ ? 0 : message);  // in
  const std::vector<uint8_t*> buffers = scratch_.buffers(sizes, kArena);
  signatures_ = reinterpret_cast<CallSignature*>(buffers[0]);
  first.out.assign(buffers.begin() + 1, buffers.begin() + 1 + size_);
  first.in.assign(buffers.begin() + 1 + size_, buffers.end());
  first.carried.resize(size_);
  first.held_recvs = recvs;  // filled from the first messages once agreed

  // The first send to each peer lends its first bytes to the first message; the rest of
  // it, and everything else, waits for the agreement. (Transports skip empty messages.)
  std::vector<uint64_t> first_bytes(size_, Header::kNone);
  std::vector<size_t> prefix(size_, 0);
  for (const Send& s : sends) {
    if (s.bytes == 0 || first_bytes[s.peer] != Header::kNone) {
      first.rest_sends.push_back(s);
      continue;
    }
    first_bytes[s.peer] = s.bytes;
    prefix[s.peer] = std::min(carried_, s.bytes);
    std::memcpy(first.out[s.peer] + sizeof(Header), s.data, prefix[s.peer]);
    if (s.bytes > prefix[s.peer])
      first.rest_sends.push_back({s.peer, static_cast<const uint8_t*>(s.data) + prefix[s.peer], s.bytes - prefix[s.peer]});
  }

  std::vector<Send> first_sends;
  std::vector<Recv> first_recvs;
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    Header header;
    header.length = sizeof(Header) + prefix[p];
    header.first_bytes = first_bytes[p];
    header.way = way_;
    header.signature = mine_;
    std::memcpy(first.out[p], &header, sizeof header);
    first_sends.push_back({p, first.out[p], header.length});
    first_recvs.push_back({p, first.in[p], message, /*up_to=*/true});
  }
  state_ = State::kPosted;
  if (first_sends.empty()) return;  // alone in the group
  try {
    first.pending = base_.post(first_sends, first_recvs);
  } catch (...) {
    state_ = State::kFailed;
    error_ = std::current_exception();
    throw;
  }
}

void AgreedCall::resolve() {
  First& first = *first_;
  try {
    if (first.pending) {
      auto pending = std::move(first.pending);
      base_.wait(*pending, deadline_);
    }
    std::vector<Header> headers(size_);
    for (int p = 0; p < size_; ++p) {
      if (p == rank_) {
        headers[p].way = way_;
        headers[p].signature = mine_;
      } else {
        std::memcpy(&headers[p], first.in[p], sizeof(Header));
      }
      signatures_[p] = headers[p].signature;
    }
    check(headers.data());
    for (int p = 0; p < size_; ++p) {
      if (p == rank_ || headers[p].first_bytes == Header::kNone) continue;
      first.carried[p] = {headers[p].length - sizeof(Header), headers[p].first_bytes, true};
      ++undelivered_;
    }
    const std::vector<Recv> recvs = deliver(first.held_recvs);
    if (!first.rest_sends.empty() || !recvs.empty()) first.rest = base_.post(first.rest_sends, recvs);
  } catch (...) {
    state_ = State::kFailed;
    error_ = std::current_exception();
    throw;
  }
  state_ = State::kAgreed;
}

std::vector<Recv> AgreedCall::deliver(const std::vector<Recv>& recvs) {
  std::vector<Recv> rest;
  for (const Recv& r : recvs) {
    First::Carried& carried = first_->carried[r.peer];
    if (r.bytes == 0 || !carried.undelivered) {
      rest.push_back(r);
      continue;
    }
    // Equal calls make equal exchanges: a difference is cgx's own fault.
    if (r.bytes != carried.whole)
      throw std::logic_error("cgx: rank " + std::to_string(r.peer) + " sends " + std::to_string(carried.whole) +
                             " bytes first where this rank expects " + std::to_string(r.bytes) +
                             " for the same call (an internal error)");
    std::memcpy(r.data, first_->in[r.peer] + sizeof(Header), carried.bytes);
    carried.undelivered = false;
    --undelivered_;
    if (r.bytes > carried.bytes) rest.push_back({r.peer, static_cast<uint8_t*>(r.data) + carried.bytes, r.bytes - carried.bytes});
  }
  return rest;
}

void AgreedCall::check(const Header* headers) const {
  check_same(signatures_, size_);
  // Equal calls take equal ways; a difference here is cgx's own fault (auto's choices out
  // of step), so the group stops.
  for (int p = 1; p < size_; ++p)
    if (headers[p].way != headers[0].way)
      throw CallMismatchError("cgx: ranks chose different ways for call #" + std::to_string(headers[0].signature.sequence) +
                                  " of the group: rank 0 sends it " + way_name(headers[0].way) + ", rank " +
                                  std::to_string(p) + " " + way_name(headers[p].way),
                              /*out_of_step=*/true);
  for (int p = 0; p < size_; ++p) {
    if (p == rank_) continue;
    const Header& h = headers[p];
    const uint64_t carried = h.first_bytes == Header::kNone ? 0 : std::min<uint64_t>(carried_, h.first_bytes);
    if (h.length != sizeof(Header) + carried)
      throw std::logic_error("cgx: rank " + std::to_string(p) + "'s first message is " + std::to_string(h.length) +
                             " bytes long, not " + std::to_string(sizeof(Header) + carried) + " (an internal error)");
  }
}

}  // namespace cgx::collectives
