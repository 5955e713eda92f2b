// The /dev/shm names this process created and still owns, removed on the way out when a
// termination signal ends it: a rank that torchrun (SIGTERM) or a closed terminal (SIGHUP)
// stops during set-up, before every peer has opened its segment, leaves nothing behind.
// SIGKILL cannot be caught: survivors remove a dead peer's names instead (shm_transport).
#pragma once

#include <string>

namespace cgx::transport {

// Holds one name in the registry from construction to release() or destruction. While
// any name is held, SIGTERM and SIGHUP, where their action is the default (ending the
// process), unlink every held name first; then the process ends as it would have. A
// signal ignored or handled by someone else is left alone: the process may go on.
class OwnedShmName {
 public:
  OwnedShmName() = default;
  explicit OwnedShmName(const std::string& name);  // as given to shm_open: "/cgx-..."
  ~OwnedShmName() { release(); }
  OwnedShmName(OwnedShmName&& other) noexcept : slot_(other.slot_) { other.slot_ = -1; }
  OwnedShmName& operator=(OwnedShmName&& other) noexcept;
  OwnedShmName(const OwnedShmName&) = delete;
  OwnedShmName& operator=(const OwnedShmName&) = delete;

  // Leaves the registry (the name was unlinked, or handed over).
  void release();

 private:
  int slot_ = -1;
};

}  // namespace cgx::transport
