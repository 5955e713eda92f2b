// Before a compressed collective moves data, ranks compare what they were asked to do.
// A mismatch (different sizes, dtypes, settings, or ranks out of step) then fails on
// every rank with the same message instead of hanging or reducing garbage.
#pragma once

#include <cstdint>

#include "transport/transport.h"

namespace cgx::collectives {

struct CallSignature {
  uint64_t sequence = 0;   // per-group count of compressed calls
  int64_t numel = 0;
  int64_t bucket_size = 0;
  int32_t bits = 0;
  int32_t flags = 0;       // settings that must agree (algorithm, rounding, ...)
  char dtype[16] = {};     // name, for the message
  char op[8] = {};
};

// Sends our signature to every peer and reads theirs. Throws std::runtime_error naming
// the first field that differs and the ranks involved; all ranks see all signatures, so
// all of them throw. The transport stays usable after such an error.
void check_same_on_all_ranks(transport::Transport& transport, int rank, int size,
                             const CallSignature& mine, transport::Clock::time_point deadline);

}  // namespace cgx::collectives
