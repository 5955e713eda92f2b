#include "backend/errors.h"

#include "collectives/call_signature.h"
#include "transport/transport.h"

namespace cgx::backend {
namespace {

c10::SourceLocation here(const char* function) { return {function, __FILE__, __LINE__}; }

}  // namespace

PeerError::PeerError(const std::string& message) : c10::DistNetworkError(here(__func__), message) {}
CollectiveTimeoutError::CollectiveTimeoutError(const std::string& message)
    : c10::DistBackendError(here(__func__), message) {}
CallMismatchError::CallMismatchError(const std::string& message)
    : c10::DistBackendError(here(__func__), message) {}

Failure failure_of(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const transport::TimeoutError&) {  // before TransportError, its base
    return Failure::kTimeout;
  } catch (const CollectiveTimeoutError&) {
    return Failure::kTimeout;
  } catch (const transport::TransportError&) {
    return Failure::kPeer;
  } catch (const c10::DistNetworkError&) {  // PeerError, or Gloo's own (auto's exact way across hosts)
    return Failure::kPeer;
  } catch (const collectives::CallMismatchError&) {
    return Failure::kMismatch;
  } catch (const CallMismatchError&) {
    return Failure::kMismatch;
  } catch (...) {
    return Failure::kOther;
  }
}

std::exception_ptr reported(const std::exception_ptr& error) {
  const Failure kind = failure_of(error);
  if (kind == Failure::kOther) return error;
  try {
    std::rethrow_exception(error);
  } catch (const c10::Error&) {  // already reported
    return error;
  } catch (const std::exception& e) {
    try {
      throw_failure(kind, e.what());
    } catch (...) {
      return std::current_exception();
    }
  }
  return error;
}

void GroupFailure::fail(Failure kind, const std::string& cause) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cause_.empty()) return;
  cause_ = cause;
  kind_ = kind;
}

void GroupFailure::check() const {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cause_.empty())
    throw_failure(kind_, "cgx: the process group is unusable after an earlier failure: " + cause_);
}

namespace {
// Gloo's words for its failures (gloo/transport/tcp): its own timeouts, and a lost
// connection. c10d's "Operation timed out!" (a caller's shorter wait) is not one of them.
Failure gloo_failure(const std::string& message) {
  const auto says = [&](const char* words) { return message.find(words) != std::string::npos; };
  if (says("Timed out waiting") || says("Application timeout caused pair closure") ||
      says("Read timeout") || says("Write timeout") || says("Socket Timeout"))
    return Failure::kTimeout;
  if (says("Connection closed") || says("Connection reset") || says("Broken pipe") ||
      says("Read error") || says("Write error") || says("writev") || says("Socket closed"))
    return Failure::kPeer;
  return Failure::kOther;
}
}  // namespace

std::exception_ptr exact_failure(const std::exception_ptr& error, GroupFailure& group) {
  std::string message;
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    message = message_of(e);
  } catch (...) {
    return error;
  }
  Failure kind = failure_of(error);  // already typed: cgx's, or torch's own network error
  if (kind == Failure::kOther) kind = gloo_failure(message);
  if (kind == Failure::kOther) return error;
  group.fail(kind, message);
  try {
    throw_failure(kind, message);
  } catch (...) {
    return std::current_exception();
  }
}

std::string message_of(const std::exception& error) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&error);
  return c10_error ? c10_error->what_without_backtrace() : error.what();
}

void throw_failure(Failure kind, const std::string& message) {
  switch (kind) {
    case Failure::kPeer:
      throw PeerError(message);
    case Failure::kTimeout:
      throw CollectiveTimeoutError(message);
    case Failure::kMismatch:
      throw CallMismatchError(message);
    case Failure::kOther:
      break;
  }
  throw c10::DistBackendError(here(__func__), message);
}

}  // namespace cgx::backend
