#include "compression/schemes.h"

#include <stdexcept>

namespace cgx::compression {

Scheme scheme_from_name(const std::string& name) {
  std::string known;
  for (int i = 0; i < kSchemeCount; ++i) {
    if (name == kSchemeNames[i]) return static_cast<Scheme>(i);
    known += (i ? " or '" : "'") + std::string(kSchemeNames[i]) + "'";
  }
  throw std::invalid_argument("scheme must be " + known + ", got '" + name + "'");
}

std::string scheme_problem(Scheme scheme, int bits, int64_t bucket_size) {
  if (!valid_scheme(scheme))
    return "unknown quantizer scheme " + std::to_string(static_cast<int>(scheme));
  const SchemeRule rule = rule_of(scheme);
  const std::string which = std::string("the ") + rule.name + " scheme";
  if (bits > rule.max_bits)
    return which + " quantizes to 1.." + std::to_string(rule.max_bits) + " bits, got " +
           std::to_string(bits);
  const bool in_range = bucket_size >= rule.min_bucket && bucket_size <= rule.max_bucket;
  const bool shaped = !rule.power_of_two_buckets || (bucket_size & (bucket_size - 1)) == 0;
  if (!in_range || !shaped)
    return which + " needs a bucket_size that is " + (rule.power_of_two_buckets ? "a power of two " : "") +
           "in " + std::to_string(rule.min_bucket) + ".." + std::to_string(rule.max_bucket) + ", got " +
           std::to_string(bucket_size);
  return "";
}

}  // namespace cgx::compression
