// Runs the tests registered with CGX_TEST (check.h); arguments select by substring, and
// `--shard=K/N` runs every N-th of the selected tests from the K-th on (0-based), so that
// N processes run them all side by side.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>

#include "check.h"

int main(int argc, char** argv) {
  int shard = 0, shards = 1, patterns = 0;
  for (int i = 1; i < argc; ++i) {
    if (std::sscanf(argv[i], "--shard=%d/%d", &shard, &shards) == 2) {
      if (shards < 1 || shard < 0 || shard >= shards) {
        std::printf("bad %s: expected --shard=K/N with 0 <= K < N\n", argv[i]);
        return 2;
      }
      argv[i] = nullptr;
    } else {
      ++patterns;
    }
  }
  int run = 0, failed = 0, selected_so_far = 0;
  for (const auto& test : cgx::test::registry()) {
    bool selected = patterns == 0;
    for (int i = 1; i < argc; ++i) selected = selected || (argv[i] && std::strstr(test.name, argv[i]));
    if (!selected || selected_so_far++ % shards != shard) continue;
    ++run;
    std::printf("[ RUN  ] %s\n", test.name);
    std::fflush(stdout);
    const auto start = std::chrono::steady_clock::now();
    const char* error = nullptr;
    std::string message;
    try {
      test.body();
    } catch (const std::exception& e) {
      message = e.what();
      error = message.c_str();
    } catch (...) {
      error = "an exception that is not a std::exception";
    }
    const long ms = static_cast<long>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                          std::chrono::steady_clock::now() - start)
                                          .count());
    if (error) {
      ++failed;
      std::printf("%s\n[ FAIL ] %s (%ld ms)\n", error, test.name, ms);
    } else {
      std::printf("[   OK ] %s (%ld ms)\n", test.name, ms);
    }
    std::fflush(stdout);
  }
  std::printf("%d tests, %d failed\n", run, failed);
  if (run == 0) std::printf("no test matches the arguments\n");
  return failed == 0 && run > 0 ? 0 : 1;
}
