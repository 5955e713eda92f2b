// A group's validated settings (cgx/config.py parses the CGX_* variables into these).
#pragma once

#include <cstdint>
#include <string>

#include "collectives/allreduce.h"

namespace cgx::backend {

// How ranks on one host exchange compressed data, and ranks on different hosts.
enum class InnerCommunicator { SHM, MPI, GLOO };
enum class CrossCommunicator { MPI, GLOO };

// Larger buckets buy nothing (metadata is already negligible) and would overflow sizes.
constexpr int64_t kMaxBucketSize = int64_t{1} << 30;
constexpr int64_t kMaxShmRingBytes = int64_t{1} << 36;

struct Settings {
  int bits = 32;  // 1..8, or 32 = no compression
  int64_t bucket_size = 512;
  int64_t minimal_size = 16;  // tensors with at most this many elements go exactly
  bool skip_incomplete_buckets = false;
  bool stochastic_rounding = false;
  uint64_t seed = 0;
  InnerCommunicator inner_communicator = InnerCommunicator::SHM;
  CrossCommunicator cross_communicator = CrossCommunicator::GLOO;
  collectives::ReductionAlgorithm inner_reduction = collectives::ReductionAlgorithm::SRA;
  collectives::ReductionAlgorithm cross_reduction = collectives::ReductionAlgorithm::SRA;
  bool intra_broadcast = false;  // hierarchical: through one leader per host
  bool intra_compress = true;    // hierarchical: compress inside a host too
  std::string hostname;  // ranks with the same name share a host
  int64_t shm_ring_bytes = 4 << 20;
  bool deferred_execution = false;  // debugging: host codec work queued until sync()
};

// Whether this build has the CUDA codec (a CUDA torch and nvcc at build time).
constexpr bool kWithCuda =
#ifdef CGX_WITH_CUDA
    true;
#else
    false;
#endif

// Whether this build has the MPI transport.
constexpr bool kWithMpi =
#ifdef CGX_WITH_MPI
    true;
#else
    false;
#endif

}  // namespace cgx::backend
