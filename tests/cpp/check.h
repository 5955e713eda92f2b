// A minimal test runner for the torch-free core (no third-party framework).
//
//   CGX_TEST(name) { ...; CHECK(cond); CHECK_EQ(a, b); CHECK_THROWS(expr, Type); }
//
// A failed check throws CheckFailure with file:line and, for CHECK_EQ, both values; the
// runner (main.cpp) reports it and goes on with the next test. Exit status 0 when every
// test passes. `cgx_core_tests NAME...` runs only the tests whose names contain a NAME.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace cgx::test {

struct CheckFailure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct TestCase {
  const char* name;
  void (*body)();
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> tests;
  return tests;
}

struct Register {
  Register(const char* name, void (*body)()) { registry().push_back({name, body}); }
};

[[noreturn]] inline void fail(const char* file, int line, const std::string& what) {
  throw CheckFailure(std::string(file) + ":" + std::to_string(line) + ": " + what);
}

template <typename A, typename B>
void check_eq(const A& a, const B& b, const char* a_text, const char* b_text, const char* file,
              int line) {
  if (a == b) return;
  std::ostringstream message;
  message << "CHECK_EQ(" << a_text << ", " << b_text << ") failed: " << a << " != " << b;
  fail(file, line, message.str());
}

}  // namespace cgx::test

#define CGX_TEST(name)                                                        \
  static void cgx_test_##name();                                              \
  static const ::cgx::test::Register cgx_register_##name(#name, cgx_test_##name); \
  static void cgx_test_##name()

#define CHECK(cond)                                                              \
  do {                                                                           \
    if (!(cond)) ::cgx::test::fail(__FILE__, __LINE__, "CHECK(" #cond ") failed"); \
  } while (0)

#define CHECK_EQ(a, b) ::cgx::test::check_eq((a), (b), #a, #b, __FILE__, __LINE__)

// `expr` must throw `Type` (or a subclass); anything else, or nothing, fails.
#define CHECK_THROWS(expr, Type)                                                        \
  do {                                                                                  \
    bool cgx_thrown = false;                                                            \
    try {                                                                               \
      (void)(expr);                                                                     \
    } catch (const ::cgx::test::CheckFailure&) {                                        \
      throw;                                                                            \
    } catch (const Type&) {                                                             \
      cgx_thrown = true;                                                                \
    } catch (const std::exception& e) {                                                 \
      ::cgx::test::fail(__FILE__, __LINE__,                                             \
                        "CHECK_THROWS(" #expr ", " #Type ") threw another type: " +     \
                            std::string(e.what()));                                     \
    }                                                                                   \
    if (!cgx_thrown)                                                                    \
      ::cgx::test::fail(__FILE__, __LINE__, "CHECK_THROWS(" #expr ", " #Type ") did not throw"); \
  } while (0)
