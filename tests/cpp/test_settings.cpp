// The settings table (backend/settings.h, torch-free): the digest every compressed call's
// signature carries follows the table's third column, field by field, so a new setting
// marked kSigned is checked on every call with no other edit.
#include <string>
#include <type_traits>

#include "backend/settings.h"
#include "check.h"

namespace cgx::test {
namespace {

using backend::kNotSigned;  // the table names its column bare
using backend::kSigned;
using backend::Settings;

// A value other than `v`, of its type.
template <typename T>
T other_than(const T& v) {
  if constexpr (std::is_same_v<T, bool>)
    return !v;
  else if constexpr (std::is_enum_v<T>)
    return static_cast<T>(static_cast<std::underlying_type_t<T>>(v) + 1);
  else if constexpr (std::is_same_v<T, std::string>)
    return v + "x";
  else
    return v + 1;
}

CGX_TEST(settings_digest_changes_with_each_signed_field_and_no_other) {
  const Settings base;
  const uint64_t digest = backend::signed_settings_digest(base);
  CHECK_EQ(backend::signed_settings_digest(base), digest);  // a function of the values alone
  int fields = 0;
#define CGX_CHECK_SETTING(type, name, is_signed)                                      \
  {                                                                                   \
    Settings changed = base;                                                          \
    changed.name = other_than(changed.name);                                          \
    if ((backend::signed_settings_digest(changed) != digest) != (is_signed))          \
      fail(__FILE__, __LINE__, std::string(#name) + ": the digest does not follow the column"); \
    ++fields;                                                                         \
  }
  CGX_SETTINGS_FIELDS(CGX_CHECK_SETTING)
#undef CGX_CHECK_SETTING
  CHECK(fields > 0);
}

CGX_TEST(settings_digest_tells_apart_equal_values_in_different_fields) {
  Settings a;
  Settings b;
  a.stochastic_rounding = true;
  b.skip_incomplete_buckets = true;
  CHECK(backend::signed_settings_digest(a) != backend::signed_settings_digest(b));
}

}  // namespace
}  // namespace cgx::test
