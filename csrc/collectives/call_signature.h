// Before a compressed collective sums data, ranks compare what they were asked to do.
// A mismatch (different sizes, dtypes, settings, or ranks out of step) then fails on
// every rank with the same message instead of hanging or reducing garbage.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "compression/layout_codec.h"

namespace cgx::collectives {

struct CallSignature {
  CallSignature() = default;  // to receive a peer's into
  // A call of the group numbered `sequence`: `shapes` are its tensors' sizes, `numel`
  // the values it moves, `codec` its compression layout, `dtype` and `op` names for the
  // message; `bits` and `bucket_size` group settings that must agree, named in the
  // message; `settings` a digest of every group setting that must agree (the backend's
  // signed_settings_digest), those two included.
  CallSignature(uint64_t sequence, const std::vector<std::vector<int64_t>>& shapes, int64_t numel,
                const compression::LayoutCodec& codec, const std::string& dtype,
                const std::string& op, int32_t bits, int64_t bucket_size, uint64_t settings,
                double scale = 1.0);

  uint64_t sequence = 0;   // per-group count of calls, exact ones included
  int64_t numel = 0;
  int64_t bucket_size = 0;
  uint64_t shapes = 0;     // hash of the tensors' count and shapes
  uint64_t plan = 0;       // hash of the compression layout (segments, bits, bucket sizes)
  uint64_t settings = 0;   // digest of the settings that must agree (algorithm, rounding, ...)
  int32_t bits = 0;
  char dtype[12] = {};     // name, for the message (the codec's dtypes: "BFloat16" the longest)
  char op[8] = {};
  double scale = 1.0;      // what the reduced sum is multiplied by (PREMUL_SUM's factor)
  // For the message, cut to fit (set_text): the tensors' shapes, "[100, 4], [10]", and
  // the layout's segments, "4096:4b/512 128:raw".
  char shapes_text[40] = {};
  char plan_text[40] = {};
  // Not compared: this rank's timing estimates for the call's class (path_choice.h),
  // microseconds, 0 where unknown or unused.
  float compressed_us = 0;
  float exact_us = 0;
};

static_assert(sizeof(CallSignature) == 168, "sent as raw bytes: no padding");

// Copies `text` into a signature's text field, cut with "..." where it does not fit.
template <size_t N>
void set_text(char (&field)[N], const std::string& text) {
  std::string fitted = text.size() < N ? text : text.substr(0, N - 4) + "...";
  fitted.copy(field, N - 1);
  field[fitted.size()] = '\0';
}

// Ranks were given different calls. Only signatures moved: the transport stays usable.
// `out_of_step`: they are at different calls of the group (one took a path the others
// did not, earlier), not merely given different arguments for the same one.
class CallMismatchError : public std::runtime_error {
 public:
  CallMismatchError(const std::string& message, bool out_of_step)
      : std::runtime_error(message), out_of_step(out_of_step) {}
  const bool out_of_step;
};

// Throws CallMismatchError naming the first field in which a rank's signature differs from
// rank 0's, and the ranks involved (the first rank at another call of the group, if any:
// the error is then out_of_step): given every rank's signatures, [0, size), every rank
// throws the same. The exchange that brings them is AgreedCall's (call_agreement.h).
void check_same(const CallSignature* all, int size);

}  // namespace cgx::collectives
