#include "collectives/call_signature.h"

#include <cstring>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace cgx::collectives {

namespace {

// The first field in which `a` and `b` differ, printed for each, or "" when equal.
std::pair<std::string, std::string> first_difference(const CallSignature& a,
                                                     const CallSignature& b) {
  auto str = [](auto v) {
    std::ostringstream s;
    s << v;
    return s.str();
  };
  // Texts cut to fit can read alike where the hashes differ: say so.
  auto text = [](const char* what, const char* a_text, const char* b_text) {
    const std::string note = std::strcmp(a_text, b_text) == 0 ? " (differing past the shown part)" : "";
    return std::make_pair(std::string(what) + a_text + note, std::string(what) + b_text + note);
  };
  if (a.sequence != b.sequence)
    return {"call #" + str(a.sequence) + " of the group", "call #" + str(b.sequence) + " of the group"};
  if (a.numel != b.numel) return {str(a.numel) + " elements", str(b.numel) + " elements"};
  if (std::strncmp(a.dtype, b.dtype, sizeof a.dtype) != 0)
    return {std::string("dtype ") + a.dtype, std::string("dtype ") + b.dtype};
  if (a.shapes != b.shapes) return text("tensors of shapes ", a.shapes_text, b.shapes_text);
  if (a.plan != b.plan) return text("the per-layer plan ", a.plan_text, b.plan_text);
  if (std::strncmp(a.op, b.op, sizeof a.op) != 0)
    return {std::string("op ") + a.op, std::string("op ") + b.op};
  // Compared as bits: a NaN factor must not read as equal to itself.
  if (std::memcmp(&a.scale, &b.scale, sizeof a.scale) != 0)
    return {"scale " + str(a.scale), "scale " + str(b.scale)};
  if (a.bits != b.bits) return {str(a.bits) + " bits", str(b.bits) + " bits"};
  if (a.bucket_size != b.bucket_size)
    return {"bucket size " + str(a.bucket_size), "bucket size " + str(b.bucket_size)};
  if (a.flags != b.flags) return {"settings " + str(a.flags), "settings " + str(b.flags)};
  return {};
}

}  // namespace

void check_same_on_all_ranks(transport::Transport& transport, int rank, int size,
                             const CallSignature& mine, transport::Clock::time_point deadline,
                             Scratch& scratch) {
  auto* theirs = reinterpret_cast<CallSignature*>(
      scratch.buffers({size * sizeof(CallSignature)}).front());
  theirs[rank] = mine;
  std::vector<transport::Send> sends;
  std::vector<transport::Recv> recvs;
  for (int p = 0; p < size; ++p) {
    if (p == rank) continue;
    sends.push_back({p, &theirs[rank], sizeof(CallSignature)});
    recvs.push_back({p, &theirs[p], sizeof(CallSignature)});
  }
  transport.exchange(sends, recvs, deadline);
  // Compare everyone against rank 0 so that every rank reports the same mismatch.
  for (int p = 1; p < size; ++p) {
    auto [zero, other] = first_difference(theirs[0], theirs[p]);
    if (!zero.empty())
      throw CallMismatchError("cgx: ranks were given different calls: rank 0 has " +
                                  zero + ", rank " + std::to_string(p) + " has " + other,
                              theirs[0].sequence != theirs[p].sequence);
  }
}

}  // namespace cgx::collectives
