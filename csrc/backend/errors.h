// The failures a collective reports, by what happened. Each is the c10 error whose Python
// type torch already has (DistNetworkError, DistBackendError), so code that catches
// RuntimeError or torch's types keeps working; the bindings raise cgx's Python subclass of
// it (cgx/errors.py) wherever the error crosses into Python.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <mutex>
#include <string>

namespace cgx::backend {

enum class Failure {
  kPeer,      // a peer died or the link to it failed
  kTimeout,   // a wait passed the group's timeout
  kMismatch,  // ranks were given different calls
  kOther,     // anything else that left the group unusable
};

class PeerError : public c10::DistNetworkError {
 public:
  explicit PeerError(const std::string& message);
};

class CollectiveTimeoutError : public c10::DistBackendError {
 public:
  explicit CollectiveTimeoutError(const std::string& message);
};

class CallMismatchError : public c10::DistBackendError {
 public:
  explicit CallMismatchError(const std::string& message);
};

// The kind of `error` (kOther for errors that are not the core's failures).
Failure failure_of(const std::exception_ptr& error);

// `error` as the backend reports it: the core's TimeoutError, TransportError and
// CallMismatchError become the types above with the same message; any other error stays.
std::exception_ptr reported(const std::exception_ptr& error);

// A group's first failure, once it has one: every later call raises its type (check()).
// Shared with the Works that can meet a failure after their call returned (ExactWork).
class GroupFailure {
 public:
  void fail(Failure kind, const std::string& cause);  // the first one stays
  void check() const;  // throws "the process group is unusable after an earlier failure: ..."

 private:
  mutable std::mutex mutex_;
  std::string cause_;
  Failure kind_ = Failure::kOther;
};

// `error` of the exact backend (Gloo) as the backend reports failures: Gloo's lost
// connections (its words name the socket: "Connection closed by peer", "Connection reset",
// a read or write error) become PeerError, its own timeouts (a transfer's, and the pair
// it then closes) CollectiveTimeoutError, with the same message, and `group` fails with
// them; anything else (a refused argument, a caller's own shorter wait) stays as it was.
std::exception_ptr exact_failure(const std::exception_ptr& error, GroupFailure& group);

// What `error` says, without the C++ backtrace a c10::Error carries: for messages that
// reach users inside other errors.
std::string message_of(const std::exception& error);

// Throws the type of `kind` (kOther: c10::DistBackendError).
[[noreturn]] void throw_failure(Failure kind, const std::string& message);

}  // namespace cgx::backend
