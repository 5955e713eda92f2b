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

float PathChooser::Estimate::median() const {
  if (count < kMinSamples) return 0;  // not an estimate yet
  // The sample with as many below it as above (the upper one of an even count).
  for (int i = 0; i < count; ++i) {
    int below = 0, equal = 0;
    for (int j = 0; j < count; ++j) {
      below += samples[j] < samples[i];
      equal += samples[j] == samples[i];
    }
    if (below <= count / 2 && count / 2 < below + equal) return samples[i];
  }
  return 0;  // no samples
}

Path PathChooser::choose(int size_class, const CallSignature* all, int size) {
  std::lock_guard<std::mutex> lock(mutex_);
  Class& c = classes_[size_class];
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
  Path path;
  if (!(c.slowest[kC] > 0)) {
    path = Path::kCompressed;  // what the user asked for, measured first
  } else if (!(c.slowest[kE] > 0)) {
    // Every other call, until every rank has exact timings.
    path = c.since_probe % 2 == 0 ? Path::kExact : Path::kCompressed;
    ++c.since_probe;
  } else {
    const Path faster = c.slowest[kE] < c.slowest[kC] ? Path::kExact : Path::kCompressed;
    const Path slower = faster == Path::kExact ? Path::kCompressed : Path::kExact;
    const double ratio = static_cast<double>(c.slowest[static_cast<int>(slower)]) /
                         c.slowest[static_cast<int>(faster)];
    const double every = std::clamp(kProbeEvery * ratio, double{kProbeEvery}, double{kProbeEveryMax});
    if (++c.since_probe >= static_cast<int64_t>(every)) {
      c.since_probe = 0;
      path = slower;
    } else {
      path = faster;
    }
  }
  c.path = path;
  ++c.calls[static_cast<int>(path)];
  return path;
}

void PathChooser::sign(int size_class, CallSignature& signature) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const Class& c = classes_[size_class];
  signature.compressed_us = c.local[kC].median();
  signature.exact_us = c.local[kE].median();
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
