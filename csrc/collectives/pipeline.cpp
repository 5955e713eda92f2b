#include "collectives/pipeline.h"

#include <deque>
#include <memory>
#include <stdexcept>
#include <utility>

namespace cgx::collectives {

namespace {

// The exchanges on the wire, oldest first: the transport completes them in posting order.
class OnWire {
 public:
  OnWire(transport::Transport& transport, compression::Executor& executor,
         transport::Clock::time_point deadline)
      : transport_(transport), executor_(executor), deadline_(deadline) {}
  // On failure every exchange still posted is settled before the error goes on.
  ~OnWire() {
    for (Posted& p : posted_) transport_.abandon(*p.pending, deadline_);
  }

  size_t size() const { return posted_.size(); }

  // Encodes step n of `steps` and puts its exchange on the wire.
  void post(const Steps& steps, int n) {
    const StepExchange exchange = steps.encode(n);
    executor_.sync();  // step n's bytes are complete before the transport reads them
    posted_.push_back({transport_.post(exchange.sends, exchange.recvs), &steps, n});
  }

  // Waits for the oldest exchange and issues its decode. A failed wait has settled every
  // op of the exchange (transport.h), so it is not abandoned again.
  void finish_oldest() {
    Posted oldest = std::move(posted_.front());
    posted_.pop_front();
    transport_.wait(*oldest.pending, deadline_);
    oldest.steps->decode(oldest.n);
  }

 private:
  struct Posted {
    std::unique_ptr<transport::Pending> pending;
    const Steps* steps;
    int n;
  };
  transport::Transport& transport_;
  compression::Executor& executor_;
  transport::Clock::time_point deadline_;
  std::deque<Posted> posted_;
};

}  // namespace

void run_steps(transport::Transport& transport, compression::Executor& executor,
               transport::Clock::time_point deadline, const Steps& steps) {
  OnWire wire(transport, executor, deadline);
  for (int n = 0; n < steps.count; ++n) {
    if (steps.serial && wire.size() > 0) wire.finish_oldest();
    wire.post(steps, n);
    if (wire.size() > 1) wire.finish_oldest();
  }
  while (wire.size() > 0) wire.finish_oldest();
  executor.sync();
}

void run_chained_steps(transport::Transport& transport, compression::Executor& executor,
                       transport::Clock::time_point deadline, const Steps& first,
                       const Steps& second) {
  // Posting order, on every rank: first 0, first 1, second 0, first 2, second 1, ...
  // first n is finished (decoded) just before second n is encoded, and at most one exchange
  // of each is on the wire while the codec works.
  if (second.count != first.count || first.serial || second.serial)
    throw std::invalid_argument("run_chained_steps: two unserial phases of equal step counts");
  OnWire wire(transport, executor, deadline);
  for (int n = 0; n <= first.count; ++n) {
    if (n < first.count) wire.post(first, n);
    if (n == 0) continue;
    // first n - 1 is the oldest on the wire: second n - 2 was posted after it.
    wire.finish_oldest();
    wire.post(second, n - 1);
    if (wire.size() > 2) wire.finish_oldest();  // second n - 2
  }
  while (wire.size() > 0) wire.finish_oldest();
  executor.sync();
}

}  // namespace cgx::collectives
