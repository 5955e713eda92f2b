// A phase as a sequence of steps, each one exchange, run so that the wire stays busy:
// step n is on the wire while step n + 1 is encoded and step n - 1 decoded.
//
//   encode n | post n | wait n-1 | decode n-1 | encode n+1 | post n+1 | wait n | decode n ...
//
// "Encode" is the codec work that makes a step's sends (compressing a piece), "decode"
// the work on what it received (decompressing, adding). Gloo and MPI move a posted step
// in their own threads meanwhile; shared memory moves what its rings hold at post and the
// rest in wait (transport.h). The steps, and so the results, are the same as one after
// the other: only when the work is issued changes.
#pragma once

#include <functional>
#include <vector>

#include "compression/executor.h"
#include "transport/transport.h"

namespace cgx::collectives {

struct StepExchange {
  std::vector<transport::Send> sends;
  std::vector<transport::Recv> recvs;
};

struct Steps {
  int count = 0;
  // Issues step n's codec work (on the executor) and says what it sends and receives.
  // The send buffers must not be written again, nor the receive buffers read, until the
  // step is decoded.
  std::function<StepExchange(int n)> encode;
  // Issues the codec work on what step n received.
  std::function<void(int n)> decode;
  // Step n + 1's encode needs step n received or decoded (a ring whose chunks travel in
  // one piece): each step is finished before the next is encoded.
  bool serial = false;
};

// Runs the steps on `transport`; returns with the executor's work complete. On failure,
// every posted step is settled before the error is rethrown (TimeoutError at `deadline`).
void run_steps(transport::Transport& transport, compression::Executor& executor,
               transport::Clock::time_point deadline, const Steps& steps);

// Runs two phases as one pipeline, where step n of `second` needs step n of `first`
// decoded (the allgather of a piece after its reduction): second n goes on the wire as
// soon as first n is decoded, beside first n + 1, instead of after the whole of `first`.
// The same steps, so the same results, as running `first` and then `second`; both have
// first.count steps, and neither is serial.
void run_chained_steps(transport::Transport& transport, compression::Executor& executor,
                       transport::Clock::time_point deadline, const Steps& first,
                       const Steps& second);

}  // namespace cgx::collectives
