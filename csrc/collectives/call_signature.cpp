#include "collectives/call_signature.h"

#include <cstring>
#include <iomanip>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace cgx::collectives {

namespace {

// FNV-1a over 64-bit values.
class Hash {
 public:
  void mix(int64_t v) {
    for (int i = 0; i < 8; ++i)
      h_ = (h_ ^ ((static_cast<uint64_t>(v) >> (8 * i)) & 0xff)) * 0x100000001b3ULL;
  }
  uint64_t value() const { return h_; }

 private:
  uint64_t h_ = 0xcbf29ce484222325ULL;
};

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
  // A digest cannot say which setting differs; the group's creation check names it
  // (cgx.backend compares every CGX_* variable), so only direct C++ callers meet this.
  if (a.settings != b.settings) {
    auto digest = [](uint64_t v) {
      std::ostringstream s;
      s << "settings digest 0x" << std::hex << std::setw(16) << std::setfill('0') << v;
      return s.str();
    };
    return {digest(a.settings), digest(b.settings)};
  }
  return {};
}

}  // namespace

// The shapes and plan are hashed, and put in words for the message. The words stop where
// the fields would cut them (a DDP bucket has many layers, and this runs on every call).
CallSignature::CallSignature(uint64_t sequence, const std::vector<std::vector<int64_t>>& shapes,
                             int64_t numel, const compression::LayoutCodec& codec,
                             const std::string& dtype, const std::string& op, int32_t bits,
                             int64_t bucket_size, uint64_t settings, double scale)
    : sequence(sequence), numel(numel), bucket_size(bucket_size), settings(settings), bits(bits),
      scale(scale) {
  Hash shape_hash;
  std::string shape_words;
  shape_hash.mix(static_cast<int64_t>(shapes.size()));
  for (const auto& sizes : shapes) {
    shape_hash.mix(static_cast<int64_t>(sizes.size()));
    for (const int64_t size : sizes) shape_hash.mix(size);
    if (shape_words.size() >= sizeof shapes_text) continue;  // the words are full
    shape_words += shape_words.empty() ? "[" : ", [";
    for (size_t d = 0; d < sizes.size(); ++d)
      shape_words += (d ? ", " : "") + std::to_string(sizes[d]);
    shape_words += "]";
  }
  Hash plan_hash;
  std::string plan_words;
  for (const auto& segment : codec.segments()) {
    const auto& p = segment.params;
    plan_hash.mix(segment.numel);
    plan_hash.mix(segment.raw ? compression::kRawBits : p.bits);
    plan_hash.mix(p.bucket_size);
    plan_hash.mix(p.skip_incomplete_buckets + 2 * p.stochastic + 4 * static_cast<int>(p.scheme));
    if (plan_words.size() < sizeof plan_text)
      plan_words += (plan_words.empty() ? "" : " ") + std::to_string(segment.numel) + ":" +
                    (segment.raw ? std::string("raw")
                                 : std::to_string(p.bits) + "b/" + std::to_string(p.bucket_size) +
                                       (p.scheme == compression::Scheme::kMaxMin
                                            ? ""
                                            : std::string("/") + scheme_name(p.scheme)));
  }
  this->shapes = shape_hash.value();
  plan = plan_hash.value();
  set_text(shapes_text, shape_words);
  set_text(plan_text, plan_words);
  set_text(this->dtype, dtype);
  set_text(this->op, op);
}

void check_same(const CallSignature* all, int size) {
  // Everyone against rank 0, so that every rank reports the same mismatch. Ranks at
  // different calls of the group first, whichever rank they are: that one makes the group
  // unusable (its other calls are out of step too), whatever else differs before it.
  int out_of_step = 0;
  for (int p = 1; p < size && !out_of_step; ++p)
    if (all[p].sequence != all[0].sequence) out_of_step = p;
  for (int p = out_of_step ? out_of_step : 1; p < size; ++p) {
    auto [zero, other] = first_difference(all[0], all[p]);
    if (!zero.empty())
      throw CallMismatchError("cgx: ranks were given different calls: rank 0 has " + zero + ", rank " +
                                  std::to_string(p) + " has " + other,
                              out_of_step != 0);
  }
}

}  // namespace cgx::collectives
