// Compression only where it pays (CGX_COMPRESSION_AUTO): per group and per size class,
// whether a compressed call beats the same call sent unquantized, learnt from the group's
// own timings, and each call sent the faster way, the same way on every rank.
//
// Each rank times its own calls of a class on both paths (the median of its last few).
// Every auto call's signature carries this rank's two estimates for the call's class, and
// the path is chosen once the signatures are exchanged and found equal, from every rank's
// estimates (the slowest rank's: a collective ends when its slowest rank does) and the
// class's agreed calls so far: the same on every rank however differently their clocks
// ran. Ranks given different calls fail the agreement before a path is chosen, so a
// mismatch is the same CallMismatchError on every path and leaves every rank's choices as
// they were. The slower path is tried again now and then, more rarely the more it loses,
// so that a link that gets busier changes the answer.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <vector>

#include "collectives/call_signature.h"

namespace cgx::collectives {

// kExact: the values travel unquantized (a layout of raw segments), summed in float32.
enum class Path { kCompressed, kExact };

// Calls are classed by the float32 bytes they reduce: class c holds [2^c, 2^(c+1)) bytes.
constexpr int kSizeClasses = 64;
int size_class(int64_t numel);

class PathChooser {
 public:
  // A rank's estimate of a path is the median of its last kSamples durations, once it has
  // kMinSamples.
  static constexpr int kSamples = 5;
  static constexpr int kMinSamples = 3;
  // The losing path is tried again after this many calls of the class times how much
  // slower it was, within [kProbeEvery, kProbeEveryMax]: about 1/kProbeEvery of the
  // class's time goes to re-checking.
  static constexpr int kProbeEvery = 32;
  static constexpr int kProbeEveryMax = 4096;

  // This rank's estimates for the class (microseconds, 0: not measured), into a call's
  // signature before it is exchanged.
  void sign(int size_class, CallSignature& signature) const;
  // The path of an agreed call of class `size_class`, given every rank's signature of it
  // (`all[0, size)`). Called once per agreed call, in the group's call order.
  Path choose(int size_class, const CallSignature* all, int size);
  // Records how long this rank's call of the class took on `path`.
  void record(int size_class, Path path, double microseconds);

  // Per class that has had a call: the last choice and what it was made from.
  struct ClassStats {
    int size_class;
    Path path;
    double compressed_us;  // the slowest rank's estimates (0: not agreed yet)
    double exact_us;
    uint64_t compressed_calls;
    uint64_t exact_calls;
  };
  std::vector<ClassStats> stats() const;

 private:
  struct Estimate {
    std::array<float, kSamples> samples{};
    int count = 0;  // samples recorded, up to kSamples
    int next = 0;
    float median() const;
  };
  struct Class {
    Estimate local[2];              // this rank's, per Path
    // The same on every rank:
    float slowest[2] = {0, 0};      // per Path, the latest every rank had an estimate of
    Path path = Path::kCompressed;  // the last choice
    int64_t since_probe = 0;
    uint64_t calls[2] = {0, 0};
  };

  // The worker chooses and records; stats() reads from the caller's thread.
  mutable std::mutex mutex_;
  std::array<Class, kSizeClasses> classes_;
};

}  // namespace cgx::collectives
