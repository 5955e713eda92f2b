// Compression only where it pays (CGX_COMPRESSION_AUTO): per group and per size class,
// whether a compressed call beats the same call sent unquantized, learnt from the group's
// own timings, and each call sent the faster way, the same way on every rank.
//
// Each rank times its own calls of a class on both paths and estimates each path by a low
// quantile of its last few: a stall in some calls (an idle connection waking, a busy
// core) does not move it. Every auto call's signature carries this rank's two estimates
// for the call's class; once a call is agreed (its signatures exchanged and found equal,
// collectives/call_agreement.h) every rank's estimates (the slowest rank's: a collective
// ends when its slowest rank does) and the class's agreed calls so far set the path of
// the class's next call: the same on every rank however differently their clocks ran,
// and known before that call moves anything, so that it carries its agreement in its own
// first exchange. A call the ranks disagree on changes nothing: every rank's choices stay
// as they were.
//
// A path is always tried in a run of consecutive calls, so that what its first call after
// the other path pays stays within the quantile's margin. The slower path is tried again
// now and then (more rarely the more it loses), and at once when the chosen one gets
// slower than it was when chosen: estimates that a stall spoiled, or a link that got
// busier, change the answer at the next try.
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
  // A rank's estimate of a path: the (n/4)-th smallest of its last n durations, n at most
  // kSamples, once it has kMinSamples (the second smallest of 4 to 7, the third of 8), so
  // that up to a quarter of them can be stalled without moving it (the class's first
  // estimates: kFirstSamples).
  static constexpr int kSamples = 8;
  static constexpr int kMinSamples = 4;
  // A re-try of the slower path is a run of this many calls. It first drops the rank's
  // samples of that path, so that the run's own timings replace those it had. One more
  // call than an estimate needs: a call's own timing reaches the other ranks with the
  // class's next call's signature.
  static constexpr int kTrialCalls = kMinSamples + 1;
  // The class's first calls are shorter runs (compressed, then exact), estimated from
  // kFirstSamples each, so that its fourth call's agreement starts the exact run and its
  // seventh call goes the faster way. A stall in them is what the first re-try is for.
  static constexpr int kFirstSamples = 2;
  static constexpr int kFirstTrialCalls = kFirstSamples + 1;
  // The slower path is re-tried once a run of it takes at most kRetryShare of the time
  // since the last: after kTrialCalls x (its estimate / the faster one's) / kRetryShare
  // calls on the faster one, at most kRetryEveryMax. The first re-try comes after
  // kFirstRetry calls whatever the ratio: the first trials are the likeliest to have met
  // a stall (a class's first calls, connections still cold, estimates of two calls), and
  // a ratio a stall inflated would delay its own correction.
  static constexpr double kRetryShare = 0.01;
  static constexpr int kFirstRetry = 64;
  static constexpr int kRetryEveryMax = 1 << 16;
  // ... and at once when the chosen path's estimate has grown past kDrift x what it was
  // when it was chosen (or confirmed by the last re-try). A re-try that finds its path
  // over kDrift x slower than its run before did (a stall in the run, or a real change)
  // is followed by another kFirstRetry calls later, not after the spacing its own ratio
  // gives: one stalled run cannot keep the class from a way that became faster.
  static constexpr float kDrift = 1.5f;

  // The path of the class's next call.
  Path next(int size_class) const;
  // This rank's estimates for the class (microseconds, 0: not measured), into a call's
  // signature before it is exchanged.
  void sign(int size_class, CallSignature& signature) const;
  // A call of class `size_class` was agreed, with every rank's signature of it
  // (`all[0, size)`), and went the way next() said: sets the class's next path. Called
  // once per agreed call, in the group's call order.
  void agreed(int size_class, const CallSignature* all, int size);
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
    float low_quantile(int min_samples) const;
  };
  struct Class {
    Estimate local[2];              // this rank's, per Path
    // The same on every rank:
    float slowest[2] = {0, 0};      // per Path, the latest every rank had an estimate of
    Path path = Path::kCompressed;  // the last call's
    Path next = Path::kCompressed;  // the next call's
    Path chosen = Path::kCompressed;
    float chosen_us = 0;            // slowest[chosen] when it was chosen or confirmed
    float retried_before_us = 0;    // slowest[retried] when its last run began
    bool second_look = false;       // that run found it over kDrift x slower
    bool confirm = true;            // a comparison is due (first, or after a re-try)
    int64_t since_retry = 0;        // calls on the chosen path since it was confirmed
    bool retried_once = false;      // the first re-try has begun
    Path retried = Path::kExact;    // the path of the run in progress
    int retry_left = 0;             // its calls still to come
    uint64_t calls[2] = {0, 0};
  };
  // The path of the class's next call, its slowest[] just updated.
  static Path next_path(Class& c);

  // The worker chooses and records; stats() reads from the caller's thread.
  mutable std::mutex mutex_;
  std::array<Class, kSizeClasses> classes_;
};

}  // namespace cgx::collectives
