// Compression only where it pays (CGX_COMPRESSION_AUTO): per group and per size class,
// whether a compressed call beats the same call sent exactly, learnt from the group's
// own timings, and each call sent the faster way, the same way on every rank.
//
// Each rank times its own calls of a class on both paths (the median of its last few,
// from issue to completion). A compressed call's signature carries this rank's two
// estimates for the call's class; once the signatures are exchanged, every rank holds the
// slowest rank's estimate of each path (a collective ends when its slowest rank does).
// That agreement, made at the class's n-th call, is used from its (n + kLag)-th call on:
// the choice of a call is a function of agreements every rank has made and of the
// class's calls so far, the same on every rank however differently their clocks ran. A
// caller that would need an agreement not made yet waits for it (only when kLag calls of
// one class are queued). The slower path is tried again now and then, more rarely the
// more it loses, so that a link that gets busier changes the answer.
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <vector>

#include "collectives/call_signature.h"

namespace cgx::collectives {

enum class Path { kCompressed, kExact };

// Calls are classed by the float32 bytes they reduce: class c holds [2^c, 2^(c+1)) bytes.
constexpr int kSizeClasses = 64;
int size_class(int64_t numel);

class PathChooser {
 public:
  // Calls of a class between an agreement and its use.
  static constexpr uint64_t kLag = 8;
  // A rank's estimate of a path is the median of its last kSamples durations, once it has
  // kMinSamples.
  static constexpr int kSamples = 5;
  static constexpr int kMinSamples = 3;
  // The losing path is tried again after this many calls of the class times how much
  // slower it was, within [kProbeEvery, kProbeEveryMax]: about 1/kProbeEvery of the
  // class's time goes to re-checking.
  static constexpr int kProbeEvery = 32;
  static constexpr int kProbeEveryMax = 4096;

  // The path of a call of class `size_class`, chosen where the call is issued (calls are
  // issued in the same order on every rank); `index` numbers the class's calls. A
  // compressed call must then be agreed (agreed()), or abandoned (agreed(..., nullptr)).
  struct Choice {
    Path path;
    uint64_t index;
  };
  Choice choose(int size_class);
  // This rank's estimates for the class (microseconds, 0: not measured), for a compressed
  // call's signature.
  void sign(int size_class, CallSignature& signature) const;
  // Every rank's signature of the class's compressed call `index` (`all[0, size)`), or
  // null when the call failed before its signatures were checked.
  void agreed(int size_class, uint64_t index, const CallSignature* all, int size);
  // Records how long this rank's call of the class took on `path`, issue to completion.
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
  struct Agreement {
    uint64_t from;        // the first call index it applies to
    float slowest[2];     // per Path; 0: some rank had none
  };
  struct Class {
    Estimate local[2];              // this rank's, per Path
    // The same on every rank:
    uint64_t issued = 0;            // calls chosen so far
    std::deque<uint64_t> pending;   // compressed calls not agreed yet, in order
    std::deque<Agreement> agreements;  // made, not applied yet, in order
    float slowest[2] = {0, 0};      // per Path, as applied
    Path path = Path::kCompressed;  // the last choice
    int64_t since_probe = 0;
    uint64_t calls[2] = {0, 0};
  };

  mutable std::mutex mutex_;
  std::condition_variable agreed_;
  std::array<Class, kSizeClasses> classes_;
};

// A compressed call a PathChooser chose, from its issue to its end: agrees it, or
// abandons it when destroyed unagreed (a call that failed or never ran), so that no later
// choice waits for it; records its duration.
class ChosenCall {
 public:
  ChosenCall(std::shared_ptr<PathChooser> chooser, int size_class, uint64_t index)
      : size_class(size_class), chooser_(std::move(chooser)), index_(index) {}
  ~ChosenCall() {
    if (!agreed_) chooser_->agreed(size_class, index_, nullptr, 0);
  }
  ChosenCall(const ChosenCall&) = delete;
  ChosenCall& operator=(const ChosenCall&) = delete;

  void agreed(const CallSignature* all, int size) {
    chooser_->agreed(size_class, index_, all, size);
    agreed_ = true;
  }
  // The call completed: records the time since it was issued.
  void finished() {
    const std::chrono::duration<double, std::micro> took = std::chrono::steady_clock::now() - issued_;
    chooser_->record(size_class, Path::kCompressed, took.count());
  }

  const int size_class;

 private:
  std::shared_ptr<PathChooser> chooser_;
  uint64_t index_;
  bool agreed_ = false;
  std::chrono::steady_clock::time_point issued_ = std::chrono::steady_clock::now();
};

}  // namespace cgx::collectives
