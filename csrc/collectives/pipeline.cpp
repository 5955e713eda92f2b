#include "collectives/pipeline.h"

#include <memory>
#include <utility>

namespace cgx::collectives {

void run_steps(transport::Transport& transport, compression::Executor& executor,
               transport::Clock::time_point deadline, const Steps& steps) {
  std::unique_ptr<transport::Pending> on_wire;  // the step before the current one
  int on_wire_step = -1;
  // Waits for the step on the wire and issues its decode. A failed wait has settled
  // every op of the step (transport.h), so nothing is left to abandon.
  auto finish = [&] {
    const auto pending = std::move(on_wire);
    transport.wait(*pending, deadline);
    steps.decode(on_wire_step);
  };
  try {
    for (int n = 0; n < steps.count; ++n) {
      if (steps.serial && on_wire) finish();
      const StepExchange exchange = steps.encode(n);
      executor.sync();  // step n's bytes are complete before the transport reads them
      auto posted = transport.post(exchange.sends, exchange.recvs);
      if (on_wire) {
        try {
          finish();
        } catch (...) {
          transport.abandon(*posted, deadline);
          throw;
        }
      }
      on_wire = std::move(posted);
      on_wire_step = n;
    }
    if (on_wire) finish();
    executor.sync();
  } catch (...) {
    if (on_wire) transport.abandon(*on_wire, deadline);
    throw;
  }
}

}  // namespace cgx::collectives
