// The quantizer's schemes, each described once: its name, the widths and bucket sizes it
// takes, and how its codec runs. Code that does something per scheme switches over
// Scheme with a case for each and no default, so that a scheme added here and forgotten
// there fails to build (-Werror=switch), instead of running as another scheme.
//   maxmin   levels evenly spaced between each bucket's min and max (quantizer.cpp)
//   hadamard each bucket rotated (rotation.h), levels placed for a normal distribution
//            (hadamard_codec.cpp)
// Adding one: docs/design.md, "A new scheme".
#pragma once

#include <cstdint>
#include <iterator>
#include <limits>
#include <string>

namespace cgx::compression {

// Widths the codec quantizes to, 1..kMaxBits (every scheme within them). Declared here, at
// the codec, and used by every layer above (backend settings, cgx._C, cgx/config.py,
// cgx/layers.py).
constexpr int kMaxBits = 8;

enum class Scheme : int32_t { kMaxMin = 0, kHadamard = 1 };
constexpr int kSchemeCount = 2;
// The schemes' names, indexed by value: what Python and the docs call them.
constexpr const char* kSchemeNames[] = {"maxmin", "hadamard"};
static_assert(std::size(kSchemeNames) == kSchemeCount, "a name for every scheme");

// The hadamard scheme's limits: its level tables go to 4 bits, and a bucket is a power
// of two no larger than this (which keeps its decode clear of overflow).
constexpr int kMaxHadamardBits = 4;
constexpr int64_t kMaxHadamardBucket = int64_t{1} << 16;

struct SchemeRule {
  const char* name;
  int max_bits;                    // widths 1..max_bits (within the codec's 1..kMaxBits)
  int64_t min_bucket, max_bucket;  // bucket sizes min_bucket..max_bucket
  bool power_of_two_buckets;
  // Whether compress_and_decode (quantizer.h) encodes and decodes in one pass; else a
  // caller compresses, then decompresses.
  bool fused_compress_and_decode;
};

constexpr SchemeRule rule_of(Scheme scheme) {
  switch (scheme) {
    case Scheme::kMaxMin:
      return {"maxmin", kMaxBits, 1, std::numeric_limits<int64_t>::max(), false, true};
    case Scheme::kHadamard:
      return {"hadamard", kMaxHadamardBits, 8, kMaxHadamardBucket, true, false};
  }
  return {"unknown", 0, 0, 0, false, false};  // an out-of-range value: valid_scheme() refuses it
}

inline bool valid_scheme(Scheme scheme) {
  return static_cast<int>(scheme) >= 0 && static_cast<int>(scheme) < kSchemeCount;
}
inline const char* scheme_name(Scheme scheme) { return rule_of(scheme).name; }
// Throws std::invalid_argument naming the known schemes for any other name.
Scheme scheme_from_name(const std::string& name);

// Why `scheme` does not take these bits and bucket size, in the words errors use; "" where
// it does. Bits outside the codec's 1..kMaxBits and buckets below 1 are quantizer.h's
// validate()'s to refuse.
std::string scheme_problem(Scheme scheme, int bits, int64_t bucket_size);
inline bool scheme_fits(Scheme scheme, int bits, int64_t bucket_size) {
  return scheme_problem(scheme, bits, bucket_size).empty();
}
// `scheme` where it takes these bits and bucket size, else maxmin (which takes every
// width and bucket): how a group's or a layer's default scheme holds at every width.
inline Scheme fitted_scheme(Scheme scheme, int bits, int64_t bucket_size) {
  return scheme_fits(scheme, bits, bucket_size) ? scheme : Scheme::kMaxMin;
}

}  // namespace cgx::compression
