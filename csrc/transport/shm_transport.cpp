// Shared-memory transport; the design is described in shm_transport.h.
#include "transport/shm_transport.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <deque>
#include <new>
#include <span>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "transport/shm_names.h"

namespace cgx::transport {
namespace {

// Atomics shared between processes must be address-free, which in practice means
// lock-free; the doorbell is also handed to futex(2) as a plain 32-bit word.
static_assert(std::atomic<uint32_t>::is_always_lock_free);
static_assert(std::atomic<uint64_t>::is_always_lock_free);
static_assert(sizeof(std::atomic<uint32_t>) == sizeof(uint32_t));

constexpr size_t kCacheLine = 64;
// Empty passes before sleeping: enough to catch a peer that is about to publish, few
// enough not to hold an oversubscribed core for long (a pause is ~10-150 cycles).
constexpr int kSpinPasses = 200;
// Most bytes one push() or pull() moves before publishing: the peer starts copying out
// while we copy in (~1.8x the throughput of whole-ring steps), and other peers get a turn.
constexpr uint64_t kMaxStepBytes = 256 << 10;
// Longest single sleep, so that the deadline is checked even if nobody rings.
constexpr std::chrono::milliseconds kMaxSleep{50};

// Why an owner gave up on an exchange (ControlBlock::failed), or that it left the group
// (its transport destroyed, its process alive).
enum FailedState : uint32_t { kHealthy = 0, kFailed = 1, kTimedOut = 2, kLeft = 3 };

// Start of every segment. Its owner sleeps on `doorbell`; peers bump it after moving data
// to or from the owner, and futex-wake it only while `sleeping` is set. `pid` and
// `pid_namespace` let peers watch the owner's process; `failed` tells them that the owner
// gave up on an exchange (a FailedState), so that they stop waiting for it at once.
struct ControlBlock {
  alignas(kCacheLine) std::atomic<uint32_t> doorbell;
  alignas(kCacheLine) std::atomic<uint32_t> sleeping;
  alignas(kCacheLine) std::atomic<uint32_t> failed;
  int32_t pid;
  uint64_t pid_namespace;
};

// Header of a single-producer / single-consumer byte ring whose data follows it. Both
// counters count bytes since creation, so head - tail is the fill level.
struct RingHeader {
  alignas(kCacheLine) std::atomic<uint64_t> head;  // written by the producer (owner)
  alignas(kCacheLine) std::atomic<uint64_t> tail;  // written by the consumer
};

struct Ring {
  RingHeader* header;
  std::byte* data;
  size_t capacity;

  void write(uint64_t position, const std::byte* from, size_t bytes) const {
    const size_t offset = position % capacity;
    const size_t first = std::min(bytes, capacity - offset);
    std::memcpy(data + offset, from, first);
    std::memcpy(data, from + first, bytes - first);
  }

  void read(uint64_t position, std::byte* to, size_t bytes) const {
    const size_t offset = position % capacity;
    const size_t first = std::min(bytes, capacity - offset);
    std::memcpy(to, data + offset, first);
    std::memcpy(to + first, data, bytes - first);
  }
};

// Segment layout: the control block, then one ring per local peer of the owner, in
// local-rank order, skipping the owner itself.
size_t ring_stride(size_t ring_bytes) {
  return sizeof(RingHeader) + (ring_bytes + kCacheLine - 1) / kCacheLine * kCacheLine;
}

size_t segment_bytes(size_t ring_count, size_t ring_bytes) {
  return sizeof(ControlBlock) + ring_count * ring_stride(ring_bytes);
}

size_t ring_index(size_t owner, size_t consumer) {
  return consumer < owner ? consumer : consumer - 1;
}

ControlBlock* control_block_at(std::byte* segment) {
  return reinterpret_cast<ControlBlock*>(segment);
}

Ring ring_at(std::byte* segment, size_t index, size_t ring_bytes) {
  std::byte* header = segment + sizeof(ControlBlock) + index * ring_stride(ring_bytes);
  return Ring{reinterpret_cast<RingHeader*>(header), header + sizeof(RingHeader), ring_bytes};
}

[[noreturn]] void throw_errno(const char* call, const std::string& name, int error) {
  throw std::runtime_error(std::string("cgx shm: ") + call + "(" + name +
                           ") failed: " + std::strerror(error));
}

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() {
    if (fd_ >= 0) close(fd_);
  }
  FileDescriptor(FileDescriptor&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;
  int get() const { return fd_; }

 private:
  int fd_;
};

// A mapping of one rank's segment. The creator also owns the name until it unlinks it;
// destruction unmaps and drops a name still owned, so that a construction failing half
// way leaves nothing in /dev/shm.
class Segment {
 public:
  Segment() = default;
  Segment(Segment&& other) noexcept { swap(other); }
  Segment& operator=(Segment&& other) noexcept {
    Segment(std::move(other)).swap(*this);
    return *this;
  }
  ~Segment() {
    if (base_ != nullptr) munmap(base_, bytes_);
    if (owns_name_) shm_unlink(name_.c_str());
  }

  static Segment create(const std::string& name, size_t bytes) {
    OwnedShmName registration(name);  // first: a signal may come right after the open
    FileDescriptor fd(shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600));
    if (fd.get() < 0) throw_errno("shm_open", name, errno);
    Segment segment;
    segment.name_ = name;
    segment.owns_name_ = true;
    segment.registration_ = std::move(registration);
    // The umask may have removed the owner's bits, which peers (same user) need.
    if (fchmod(fd.get(), 0600) != 0) throw_errno("fchmod", name, errno);
    if (ftruncate(fd.get(), static_cast<off_t>(bytes)) != 0) throw_errno("ftruncate", name, errno);
    // Reserve the pages now: a full /dev/shm then fails here, not as SIGBUS mid-exchange.
    if (int error = posix_fallocate(fd.get(), 0, static_cast<off_t>(bytes)); error != 0) {
      if (error != ENOSPC) throw_errno("posix_fallocate", name, error);
      throw std::runtime_error("cgx shm: /dev/shm has no room for " + std::to_string(bytes) +
                               " bytes (" + name + "); lower CGX_SHM_RING_BYTES or enlarge "
                               "/dev/shm (docker: --shm-size)");
    }
    segment.map(fd.get(), bytes);
    return segment;
  }

  static Segment open(const std::string& name, size_t bytes) {
    FileDescriptor fd(shm_open(name.c_str(), O_RDWR, 0));
    if (fd.get() < 0) throw_errno("shm_open", name, errno);
    struct stat status {};
    if (fstat(fd.get(), &status) != 0) throw_errno("fstat", name, errno);
    if (static_cast<size_t>(status.st_size) != bytes) {
      throw std::runtime_error("cgx shm: segment " + name + " has " +
                               std::to_string(status.st_size) + " bytes, expected " +
                               std::to_string(bytes) +
                               " (do the local ranks agree on the ring size?)");
    }
    Segment segment;
    segment.name_ = name;
    segment.map(fd.get(), bytes);
    return segment;
  }

  // Drops the name; the mapping stays valid.
  void unlink_name() {
    if (shm_unlink(name_.c_str()) != 0 && errno != ENOENT) {
      throw_errno("shm_unlink", name_, errno);
    }
    owns_name_ = false;
    registration_.release();
  }

  std::byte* base() const { return base_; }

 private:
  void map(int fd, size_t bytes) {
    void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) throw_errno("mmap", name_, errno);
    base_ = static_cast<std::byte*>(base);
    bytes_ = bytes;
  }

  void swap(Segment& other) noexcept {
    std::swap(name_, other.name_);
    std::swap(base_, other.base_);
    std::swap(bytes_, other.bytes_);
    std::swap(owns_name_, other.owns_name_);
    std::swap(registration_, other.registration_);
  }

  std::string name_;
  std::byte* base_ = nullptr;
  size_t bytes_ = 0;
  bool owns_name_ = false;
  OwnedShmName registration_;  // while the name is ours: unlinked on SIGTERM / SIGHUP too
};

// The inode of this process's pid namespace: pids mean the same process only between
// processes that share it (0 where /proc cannot say).
uint64_t pid_namespace() {
  struct stat status {};
  return stat("/proc/self/ns/pid", &status) == 0 ? static_cast<uint64_t>(status.st_ino) : 0;
}

// A pidfd for the owner of `control`, which becomes readable when that process exits (not
// fooled by a reused pid); -1 where it cannot be had (another pid namespace, a kernel
// before 5.3): that peer's death is then found at the deadline only.
int watch_process(const ControlBlock& control) {
#ifdef SYS_pidfd_open
  const uint64_t ours = pid_namespace();
  if (ours == 0 || control.pid_namespace != ours || control.pid <= 0) return -1;
  return static_cast<int>(syscall(SYS_pidfd_open, control.pid, 0));
#else
  (void)control;
  return -1;
#endif
}

bool has_exited(int pidfd) {
  if (pidfd < 0) return false;
  pollfd watched{pidfd, POLLIN, 0};
  return poll(&watched, 1, 0) > 0 && (watched.revents & POLLIN) != 0;
}

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

// Tells the owner of `control` that data moved. seq_cst on doorbell and sleeping pairs
// with Impl::sleep_until_rung(): either we see the flag and wake the owner, or the owner
// sees our increment (and the data published before it) and does not sleep. FUTEX_WAKE is
// not the private variant because the waiter is another process.
void ring_doorbell(ControlBlock& control) {
  control.doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (control.sleeping.load(std::memory_order_seq_cst) != 0) {
    futex(&control.doorbell, FUTEX_WAKE, INT_MAX, nullptr);
  }
}

void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The ops of one exchange with one peer in one direction, consumed in posting order.
template <typename Byte>
struct OpQueue {
  std::vector<std::span<Byte>> ops;
  std::vector<bool> up_to;  // per op: a receive whose message states its length (Recv::up_to)
  size_t next = 0;    // first unfinished op
  size_t offset = 0;  // bytes of ops[next] already moved
  size_t total_bytes = 0;
  size_t moved_bytes = 0;

  void add(Byte* data, size_t bytes, bool stated_length = false) {
    if (bytes == 0) return;  // nothing to move, so already complete
    if (stated_length && bytes < kLengthBytes)
      throw std::invalid_argument("cgx shm: a receive of at most " + std::to_string(bytes) +
                                  " bytes cannot hold a message's length");
    ops.emplace_back(data, bytes);
    up_to.push_back(stated_length);
    total_bytes += bytes;
  }
  bool done() const { return next == ops.size(); }
  // Of an up_to receive, the length field alone first: the stream holds the next message
  // right behind a short one.
  std::span<Byte> unmoved() const {
    if (up_to[next] && offset < kLengthBytes) return ops[next].subspan(offset, kLengthBytes - offset);
    return ops[next].subspan(offset);
  }
  void advance(size_t bytes) {
    moved_bytes += bytes;
    offset += bytes;
    if (up_to[next] && offset == kLengthBytes) {
      uint64_t length = 0;
      std::memcpy(&length, ops[next].data(), kLengthBytes);
      if (length < kLengthBytes || length > ops[next].size())
        throw TransportError("cgx shm: a message of " + std::to_string(length) + " bytes for a receive of at most " +
                             std::to_string(ops[next].size()));
      total_bytes -= ops[next].size() - length;
      ops[next] = ops[next].first(length);
    }
    if (offset == ops[next].size()) {
      ++next;
      offset = 0;
    }
  }
};

struct PeerWork {
  OpQueue<const std::byte> sends;
  OpQueue<std::byte> recvs;

  bool done() const { return sends.done() && recvs.done(); }
};

// Copies what fits of `sends` into `ring` (up to kMaxStepBytes) and publishes it.
// Returns whether any byte moved.
bool push(const Ring& ring, OpQueue<const std::byte>& sends) {
  const uint64_t head = ring.header->head.load(std::memory_order_relaxed);  // ours alone
  // Acquire: the consumer has finished reading the space it released before we reuse it.
  const uint64_t tail = ring.header->tail.load(std::memory_order_acquire);
  const uint64_t end = std::min(tail + ring.capacity, head + kMaxStepBytes);
  uint64_t written = head;
  while (!sends.done() && written < end) {
    const std::span<const std::byte> unmoved = sends.unmoved();
    const size_t bytes = std::min<uint64_t>(unmoved.size(), end - written);
    ring.write(written, unmoved.data(), bytes);
    written += bytes;
    sends.advance(bytes);
  }
  if (written == head) return false;
  ring.header->head.store(written, std::memory_order_release);
  return true;
}

// Copies what `ring` holds into `recvs` (up to kMaxStepBytes) and releases the space.
// Returns whether any byte moved.
bool pull(const Ring& ring, OpQueue<std::byte>& recvs) {
  const uint64_t tail = ring.header->tail.load(std::memory_order_relaxed);  // ours alone
  // Acquire: the producer's copy into the ring is complete up to head.
  const uint64_t head = ring.header->head.load(std::memory_order_acquire);
  const uint64_t end = std::min(head, tail + kMaxStepBytes);
  uint64_t read = tail;
  while (!recvs.done() && read < end) {
    const std::span<std::byte> unmoved = recvs.unmoved();
    const size_t bytes = std::min<uint64_t>(unmoved.size(), end - read);
    ring.read(read, unmoved.data(), bytes);
    read += bytes;
    recvs.advance(bytes);
  }
  if (read == tail) return false;
  ring.header->tail.store(read, std::memory_order_release);
  return true;
}

std::string store_key(const std::string& name_prefix, const char* stage, int rank) {
  return name_prefix + "/" + stage + "/" + std::to_string(rank);
}

}  // namespace

struct ShmTransport::Impl {
  // One posted exchange; it leaves the queue when complete, or when dropped unwaited.
  struct Posted final : Pending {
    Posted(Impl& owner, std::vector<PeerWork> work) : owner(owner), work(std::move(work)) {}
    ~Posted() override {
      if (queued) owner.forget(this);
    }
    Impl& owner;
    std::vector<PeerWork> work;
    bool queued = true;
  };

  struct Peer {
    int rank;
    Segment segment;
    ControlBlock* control;  // the peer's doorbell
    Ring to_peer;           // in my segment
    Ring from_peer;         // in the peer's segment
    FileDescriptor process;  // a pidfd of the peer (-1: none)
  };

  struct Progress {
    bool moved = false;
    bool done = true;
  };

  int rank;
  Segment own_segment;
  ControlBlock* control = nullptr;
  std::vector<Peer> peers;  // the local ranks other than `rank`, in increasing order
  bool broken = false;      // an exchange failed part way: the streams are out of step
  std::deque<Posted*> posted;  // not yet complete, in posting order

  // Peers waiting for this rank stop now, not at their deadline: it will move no more.
  ~Impl() {
    if (control == nullptr) return;
    uint32_t healthy = kHealthy;
    control->failed.compare_exchange_strong(healthy, kLeft, std::memory_order_seq_cst);
    for (const Peer& peer : peers) ring_doorbell(*peer.control);
  }

  // A posted exchange dropped without a wait: its buffers are going away, and what it
  // has moved is lost, so the streams are out of step.
  void forget(Posted* pending) {
    posted.erase(std::find(posted.begin(), posted.end(), pending));
    broken = true;
  }

  Impl(int my_rank, const std::vector<int>& local_ranks, const std::string& name_prefix,
       size_t ring_bytes, KeyValueStore& store)
      : rank(my_rank) {
    if (ring_bytes == 0) throw std::invalid_argument("cgx shm: ring_bytes must be positive");
    if (!std::is_sorted(local_ranks.begin(), local_ranks.end()) ||
        std::adjacent_find(local_ranks.begin(), local_ranks.end()) != local_ranks.end()) {
      throw std::invalid_argument("cgx shm: local ranks must be strictly increasing");
    }
    const auto me = std::find(local_ranks.begin(), local_ranks.end(), rank);
    if (me == local_ranks.end()) {
      throw std::invalid_argument("cgx shm: rank " + std::to_string(rank) +
                                  " is not among its local ranks");
    }
    const auto my_index = static_cast<size_t>(me - local_ranks.begin());
    const size_t bytes = segment_bytes(local_ranks.size() - 1, ring_bytes);
    auto segment_name = [&](int owner) { return "/" + name_prefix + "-" + std::to_string(owner); };

    own_segment = Segment::create(segment_name(rank), bytes);
    control = new (own_segment.base()) ControlBlock{};
    control->pid = static_cast<int32_t>(getpid());
    control->pid_namespace = pid_namespace();
    for (size_t index = 0; index + 1 < local_ranks.size(); ++index) {
      new (ring_at(own_segment.base(), index, ring_bytes).header) RingHeader{};
    }

    const std::vector<uint8_t> present{1};
    // A peer that does not say it is there, or whose segment is gone, died or stalled in
    // set-up, maybe after creating its segment: nothing can use the segments now. Remove
    // the peers' names (one killed by SIGKILL cannot) and say which rank it was.
    auto give_up = [&](int peer, const std::string& what, const std::exception& cause) {
      for (int other : local_ranks)
        if (other != rank) shm_unlink(segment_name(other).c_str());
      throw std::runtime_error("cgx shm: rank " + std::to_string(peer) + " " + what +
                               " (dead or stalled in set-up?): " + cause.what());
    };
    auto wait_for = [&](const char* key, int peer, const char* what) {
      try {
        store.get(store_key(name_prefix, key, peer));
      } catch (const std::exception& e) {
        give_up(peer, what, e);
      }
    };
    store.set(store_key(name_prefix, "created", rank), present);
    for (int peer : local_ranks) {
      if (peer != rank) wait_for("created", peer, "has not created its shared memory in time");
    }
    peers.reserve(local_ranks.size() - 1);
    for (size_t index = 0; index < local_ranks.size(); ++index) {
      if (index == my_index) continue;
      Segment segment;
      try {
        segment = Segment::open(segment_name(local_ranks[index]), bytes);
      } catch (const std::exception& e) {
        give_up(local_ranks[index], "has no shared memory to open", e);
      }
      std::byte* base = segment.base();
      ControlBlock* peer_control = control_block_at(base);
      peers.push_back(Peer{local_ranks[index], std::move(segment), peer_control,
                           ring_at(own_segment.base(), ring_index(my_index, index), ring_bytes),
                           ring_at(base, ring_index(index, my_index), ring_bytes),
                           FileDescriptor(watch_process(*peer_control))});
    }
    store.set(store_key(name_prefix, "attached", rank), present);
    for (int peer : local_ranks) {
      if (peer != rank) wait_for("attached", peer, "has not opened the others' shared memory in time");
    }
    own_segment.unlink_name();
    // Every name is of use to nobody now: remove the peers' too, in case one of them is
    // killed (SIGKILL) before it removes its own.
    for (int peer : local_ranks)
      if (peer != rank) shm_unlink(segment_name(peer).c_str());
  }

  // Index into `peers`; throws for self and for ranks not on this host.
  size_t peer_index(int peer, const char* direction) const {
    const auto found = std::lower_bound(peers.begin(), peers.end(), peer,
                                        [](const Peer& p, int r) { return p.rank < r; });
    if (found == peers.end() || found->rank != peer) {
      throw std::invalid_argument("cgx shm: rank " + std::to_string(rank) + " cannot " +
                                  direction + " rank " + std::to_string(peer) +
                                  (peer == rank ? " (itself)" : " (not a local peer)"));
    }
    return static_cast<size_t>(found - peers.begin());
  }

  // One look at every pending ring, moving what can move.
  Progress make_progress(std::vector<PeerWork>& work) {
    Progress progress;
    for (size_t index = 0; index < peers.size(); ++index) {
      if (work[index].done()) continue;
      bool moved = push(peers[index].to_peer, work[index].sends);
      moved = pull(peers[index].from_peer, work[index].recvs) || moved;
      if (moved) ring_doorbell(*peers[index].control);
      progress.moved = progress.moved || moved;
      progress.done = progress.done && work[index].done();
    }
    return progress;
  }

  // Sleeps on our doorbell until a peer rings it, the deadline passes or kMaxSleep, unless
  // a last look at the rings, taken after announcing the sleep, finds work. Returns that
  // look's progress.
  Progress sleep_until_rung(std::vector<PeerWork>& work, Clock::time_point deadline) {
    control->sleeping.store(1, std::memory_order_seq_cst);
    const uint32_t doorbell_seen = control->doorbell.load(std::memory_order_seq_cst);
    const Progress progress = make_progress(work);
    const Clock::duration remaining = deadline - Clock::now();
    int wait_error = 0;
    if (!progress.moved && !progress.done && remaining > Clock::duration::zero()) {
      const auto nap = std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::min<Clock::duration>(remaining, kMaxSleep));
      const timespec timeout{static_cast<time_t>(nap.count() / 1'000'000'000),
                             static_cast<long>(nap.count() % 1'000'000'000)};
      if (futex(&control->doorbell, FUTEX_WAIT, doorbell_seen, &timeout) != 0) wait_error = errno;
    }
    control->sleeping.store(0, std::memory_order_seq_cst);
    // EAGAIN: rung before we slept; EINTR: a signal; ETIMEDOUT: the caller rechecks.
    if (wait_error != 0 && wait_error != EAGAIN && wait_error != EINTR &&
        wait_error != ETIMEDOUT) {
      throw TransportError(std::string("cgx shm: futex wait failed: ") +
                               std::strerror(wait_error));
    }
    return progress;
  }

  // After a sleep with nothing moved: a peer this exchange waits for that has exited, or
  // that gave up on an exchange of its own, will never move more than it has. What it
  // moved before it stopped may still be in the rings (a send completes once it is in
  // the ring: a peer may exit right after): that is taken first, and only work still left
  // then fails. Peers this exchange does not wait for may have finished and exited.
  void check_peers_alive(std::vector<PeerWork>& work) {
    for (size_t index = 0; index < peers.size(); ++index) {
      if (work[index].done()) continue;
      const Peer& peer = peers[index];
      const bool exited = has_exited(peer.process.get());
      const uint32_t failed = peer.control->failed.load(std::memory_order_seq_cst);
      if (!exited && failed == kHealthy) continue;
      while (make_progress(work).moved) {
      }
      if (work[index].done()) continue;
      const std::string who = "cgx shm: local rank " + std::to_string(peer.rank) + " (pid " +
                              std::to_string(peer.control->pid) + ")";
      if (exited)
        throw TransportError(who + " exited while this rank waited for it; waiting for " + outstanding(work));
      if (failed == kLeft)
        throw TransportError(who + " left the group (shut it down) while this rank waited for it; waiting for " +
                             outstanding(work));
      if (failed == kTimedOut)
        throw TimeoutError(who + " timed out in an exchange, so this one cannot complete; waiting for " +
                           outstanding(work));
      throw TransportError(who + " failed in an exchange (a peer of its own died?), so this one cannot "
                           "complete; waiting for " + outstanding(work));
    }
  }

  // "rank 1 (send: 10 of 20 bytes outstanding), rank 2 (...)": what `work` still waits for.
  std::string outstanding(const std::vector<PeerWork>& work) const {
    auto left = [](const char* direction, const auto& queue) {
      return std::string(direction) + ": " + std::to_string(queue.total_bytes - queue.moved_bytes) +
             " of " + std::to_string(queue.total_bytes) + " bytes outstanding";
    };
    std::string message;
    const char* separator = "";
    for (size_t index = 0; index < peers.size(); ++index) {
      if (work[index].done()) continue;
      message += separator + std::string("rank ") + std::to_string(peers[index].rank) + " (";
      if (!work[index].sends.done()) message += left("send", work[index].sends);
      if (!work[index].sends.done() && !work[index].recvs.done()) message += "; ";
      if (!work[index].recvs.done()) message += left("recv", work[index].recvs);
      message += ")";
      separator = ", ";
    }
    return message;
  }

  std::unique_ptr<Pending> post(const std::vector<Send>& sends, const std::vector<Recv>& recvs) {
    if (broken) {
      throw TransportError("cgx shm: transport unusable after an earlier failed exchange");
    }
    std::vector<PeerWork> work(peers.size());
    for (const Send& send : sends) {
      work[peer_index(send.peer, "send to")].sends.add(static_cast<const std::byte*>(send.data),
                                                       send.bytes);
    }
    for (const Recv& recv : recvs) {
      work[peer_index(recv.peer, "receive from")].recvs.add(static_cast<std::byte*>(recv.data),
                                                            recv.bytes, recv.up_to);
    }
    auto pending = std::make_unique<Posted>(*this, std::move(work));
    posted.push_back(pending.get());
    // Fill the rings now where no earlier exchange is ahead of this one: the peer can
    // start reading while our caller goes on.
    if (posted.size() == 1) make_progress(pending->work);
    return pending;
  }

  // Completes the posted exchanges in order, up to and including `pending`.
  void wait(Posted& pending, Clock::time_point deadline) {
    while (pending.queued) {
      Posted& first = *posted.front();
      try {
        complete(first.work, deadline);
      } catch (const std::exception& e) {
        broken = true;
        for (Posted* p : posted) p->queued = false;
        posted.clear();
        // Peers waiting for this rank stop now, not at their own deadline.
        control->failed.store(dynamic_cast<const TimeoutError*>(&e) ? kTimedOut : kFailed,
                              std::memory_order_seq_cst);
        for (const Peer& peer : peers) ring_doorbell(*peer.control);
        throw;
      }
      first.queued = false;
      posted.pop_front();
    }
  }

  // Moves data until `work` is done: spins briefly when idle, then sleeps on the doorbell.
  void complete(std::vector<PeerWork>& work, Clock::time_point deadline) {
    int idle_passes = 0;
    while (true) {
      Progress progress = make_progress(work);
      if (!progress.moved && !progress.done && idle_passes == kSpinPasses) {
        progress = sleep_until_rung(work, deadline);
        if (!progress.moved && !progress.done) check_peers_alive(work);
      }
      if (progress.done) return;
      if (Clock::now() >= deadline) throw TimeoutError("cgx shm: timed out waiting for " + outstanding(work));
      if (progress.moved) {
        idle_passes = 0;
      } else if (idle_passes < kSpinPasses) {
        ++idle_passes;
        cpu_relax();
      }
    }
  }
};

ShmTransport::ShmTransport(int rank, std::vector<int> local_ranks,
                           const std::string& name_prefix, size_t ring_bytes,
                           KeyValueStore& store)
    : impl_(std::make_unique<Impl>(rank, local_ranks, name_prefix, ring_bytes, store)) {}

ShmTransport::~ShmTransport() = default;

std::unique_ptr<Pending> ShmTransport::post(const std::vector<Send>& sends,
                                            const std::vector<Recv>& recvs) {
  return impl_->post(sends, recvs);
}

void ShmTransport::wait(Pending& pending, Clock::time_point deadline) {
  impl_->wait(static_cast<Impl::Posted&>(pending), deadline);
}

bool ShmTransport::reaches(int peer) const {
  return std::any_of(impl_->peers.begin(), impl_->peers.end(),
                     [peer](const Impl::Peer& p) { return p.rank == peer; });
}

}  // namespace cgx::transport
