#include "collectives/path_choice.h"

#include <algorithm>

namespace cgx::collectives {

namespace {
constexpr int kC = static_cast<int>(Path::kCompressed);
constexpr int kE = static_cast<int>(Path::kExact);
}  // namespace

int size_class(int64_t numel) {
  const uint64_t bytes = static_cast<uint64_t>(std::max<int64_t>(numel, 1)) * sizeof(float);
  return std::min(63 - __builtin_clzll(bytes), kSizeClasses - 1);
}

float PathChooser::Estimate::low_quantile(int min_samples) const {
  if (count < min_samples) return 0;  // not an estimate yet
  // The sample with count / 4 below it (ties counted with it).
  const int rank = count / 4;
  for (int i = 0; i < count; ++i) {
    int below = 0, equal = 0;
    for (int j = 0; j < count; ++j) {
      below += samples[j] < samples[i];
      equal += samples[j] == samples[i];
    }
    if (below <= rank && rank < below + equal) return samples[i];
  }
  return 0;  // unreachable: some sample has that rank
}

Path PathChooser::next(int size_class) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return classes_[size_class].next;
}

void PathChooser::agreed(int size_class, const CallSignature* all, int size) {
  std::lock_guard<std::mutex> lock(mutex_);
  Class& c = classes_[size_class];
  c.path = c.next;
  ++c.calls[static_cast<int>(c.path)];
  for (int p : {kC, kE}) {
    float slowest = 0;
    bool known = true;
    for (int r = 0; r < size; ++r) {
      const float estimate = p == kC ? all[r].compressed_us : all[r].exact_us;
      known = known && estimate > 0;
      slowest = std::max(slowest, estimate);
    }
    if (known) c.slowest[p] = slowest;
  }
  c.next = next_path(c);
}

Path PathChooser::next_path(Class& c) {
  if (c.retry_left > 0) {
    c.confirm = --c.retry_left == 0;
    return c.retried;
  }
  // The first calls: compressed (what the user asked for) until every rank has timed
  // kFirstSamples of them, then exact until the same: a run of each.
  if (!(c.slowest[kC] > 0)) return Path::kCompressed;
  if (!(c.slowest[kE] > 0)) return Path::kExact;
  const Path faster = c.slowest[kE] < c.slowest[kC] ? Path::kExact : Path::kCompressed;
  const Path slower = faster == Path::kExact ? Path::kCompressed : Path::kExact;
  if (c.confirm || faster != c.chosen) {
    if (c.confirm && c.retried_once)
      c.second_look = c.slowest[static_cast<int>(c.retried)] > kDrift * c.retried_before_us;
    c.chosen = faster;
    c.chosen_us = c.slowest[static_cast<int>(faster)];
    c.confirm = false;
    c.since_retry = 0;
  }
  const double ratio = static_cast<double>(c.slowest[static_cast<int>(slower)]) /
                       c.slowest[static_cast<int>(faster)];
  const double every = c.retried_once && !c.second_look
                           ? std::min(kTrialCalls * ratio / kRetryShare, double{kRetryEveryMax})
                           : double{kFirstRetry};
  const bool drifted = c.slowest[static_cast<int>(faster)] > kDrift * c.chosen_us;
  if (static_cast<double>(c.since_retry) < every && !drifted) {
    ++c.since_retry;
    return faster;
  }
  // A run of the slower path, timed afresh on every rank (the same call everywhere).
  c.local[static_cast<int>(slower)] = Estimate{};
  c.retried_before_us = c.slowest[static_cast<int>(slower)];
  c.retried = slower;
  c.retried_once = true;
  c.retry_left = kTrialCalls - 1;
  return slower;
}

void PathChooser::sign(int size_class, CallSignature& signature) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Class& c = classes_[size_class];
  // The same count on every rank: the agreed state says whether the first comparison is made.
  const int min_samples = c.slowest[kC] > 0 && c.slowest[kE] > 0 ? kMinSamples : kFirstSamples;
  signature.compressed_us = c.local[kC].low_quantile(min_samples);
  signature.exact_us = c.local[kE].low_quantile(min_samples);
}

void PathChooser::record(int size_class, Path path, double microseconds) {
  std::lock_guard<std::mutex> lock(mutex_);
  Estimate& e = classes_[size_class].local[static_cast<int>(path)];
  // A sample of 0 would read as "not measured": the clock's resolution is finer anyway.
  e.samples[e.next] = static_cast<float>(std::max(microseconds, 1e-3));
  e.next = (e.next + 1) % kSamples;
  e.count = std::min(e.count + 1, kSamples);
}

std::vector<PathChooser::ClassStats> PathChooser::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<ClassStats> out;
  for (int s = 0; s < kSizeClasses; ++s) {
    const Class& c = classes_[s];
    if (c.calls[kC] + c.calls[kE] == 0) continue;
    out.push_back({s, c.path, c.slowest[kC], c.slowest[kE], c.calls[kC], c.calls[kE]});
  }
  return out;
}

}  // namespace cgx::collectives
