// Before a compressed collective moves data, ranks compare what they were asked to do.
// A mismatch (different sizes, dtypes, settings, or ranks out of step) then fails on
// every rank with the same message instead of hanging or reducing garbage.
#pragma once

#include <cstdint>
#include <stdexcept>

#include "collectives/allreduce.h"
#include "transport/transport.h"

namespace cgx::collectives {

struct CallSignature {
  uint64_t sequence = 0;   // per-group count of compressed calls
  int64_t numel = 0;
  int64_t bucket_size = 0;
  uint64_t layout = 0;     // hash of the tensors' shapes and dtypes
  int32_t bits = 0;
  int32_t flags = 0;       // settings that must agree (algorithm, rounding, ...)
  char dtype[16] = {};     // name, for the message
  char op[8] = {};
};

static_assert(sizeof(CallSignature) == 64, "sent as raw bytes: no padding");

// Ranks were given different calls. Only signatures moved: the transport stays usable.
class CallMismatchError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Sends our signature to every peer and reads theirs (into `scratch`, which outlives a
// failed exchange). Throws CallMismatchError naming the first field that differs and the
// ranks involved; all ranks see all signatures, so all of them throw.
void check_same_on_all_ranks(transport::Transport& transport, int rank, int size,
                             const CallSignature& mine, transport::Clock::time_point deadline,
                             Scratch& scratch);

}  // namespace cgx::collectives
