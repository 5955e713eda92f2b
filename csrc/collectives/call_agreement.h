// The call agreement without a round trip of its own: a transport for one call that
// carries the call's signature in the call's first exchange.
//
// The collective runs on it as on any transport. Its first post becomes one message to
// every peer of the group: a header (this rank's signature, the way the call goes, the
// length of what follows) and the first kCarriedBytes of the collective's first send to
// that peer, received Recv::up_to whatever the peer's call was, so that every first message
// is taken whole even when the ranks disagree. The rest of that exchange is posted once
// every header has arrived and every signature is found equal, and the carried bytes go
// to the collective's first receive from their sender, in whichever exchange it comes; a mismatch throws
// CallMismatchError on every rank (every rank sees every header) with only first messages
// moved, so the transport stays in step. A call whose data fits in the first messages (a
// small call) costs the agreement nothing; a larger one waits for the headers before the
// rest of its first exchange goes out, while its first bytes are on the wire already.
#pragma once

#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <vector>

#include "collectives/call_signature.h"
#include "collectives/phases.h"
#include "transport/transport.h"

namespace cgx::collectives {

class AgreedCall final : public transport::Transport {
 public:
  // Bytes of the first send to a peer that ride in the first message; fewer in large
  // groups, so that a call's first messages stay within kCarriedTotal.
  static constexpr size_t kCarriedBytes = size_t{128} << 10;
  static constexpr size_t kCarriedTotal = size_t{4} << 20;
  // The scratch arena of the first messages (phases use 0, the hierarchical allreduce 1).
  static constexpr int kArena = 2;
  // A first message's header: every rank sends one to every other, each call.
  static constexpr size_t kHeaderBytes = 3 * sizeof(uint64_t) + sizeof(CallSignature);

  // `way`: how this rank sends the call (auto's path), compared like the signature.
  AgreedCall(transport::Transport& base, int rank, int size, const CallSignature& mine, uint32_t way,
             transport::Clock::time_point deadline, Scratch& scratch);
  ~AgreedCall() override;

  std::unique_ptr<transport::Pending> post(const std::vector<transport::Send>& sends,
                                           const std::vector<transport::Recv>& recvs) override;
  void wait(transport::Pending& pending, transport::Clock::time_point deadline) override;
  bool reaches(int peer) const override { return base_.reaches(peer); }

  // Completes the agreement where the collective did not (it moved nothing) and returns
  // every rank's signature, [0, size); throws CallMismatchError as a wait would.
  const CallSignature* agree();

 private:
  struct Header;
  struct First;
  void post_first(const std::vector<transport::Send>& sends, const std::vector<transport::Recv>& recvs);
  void resolve();  // waits for the first messages, checks, posts the rest
  void check(const Header* headers) const;
  // `recvs` less what the first messages carried for them (copied in).
  std::vector<transport::Recv> deliver(const std::vector<transport::Recv>& recvs);

  enum class State { kFresh, kPosted, kAgreed, kFailed };

  transport::Transport& base_;
  const int rank_, size_;
  const uint32_t way_;
  const transport::Clock::time_point deadline_;
  Scratch& scratch_;
  const size_t carried_;  // data bytes a first message carries at most
  const CallSignature mine_;
  CallSignature* signatures_ = nullptr;  // every rank's, once agreed

  std::mutex mutex_;  // the collective's threads (hierarchical) post from two
  std::atomic<State> state_{State::kFresh};
  std::atomic<int> undelivered_{0};  // peers' carried bytes not yet given to a receive
  std::exception_ptr error_;  // why it failed (kFailed)
  std::unique_ptr<First> first_;
};

}  // namespace cgx::collectives
