// A group's validated settings (cgx/config.py parses the CGX_* variables into these).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>

#include "collectives/allreduce.h"

namespace cgx::backend {

// How ranks on one host exchange compressed data, and ranks on different hosts.
enum class InnerCommunicator { SHM, MPI, GLOO };
enum class CrossCommunicator { MPI, GLOO };
// The names users write (CGX_*_COMMUNICATOR_TYPE), in the enums' order; the one list of
// them (cgx/config.py reads them through cgx._C).
constexpr const char* kInnerCommunicatorNames[] = {"SHM", "MPI", "GLOO"};
constexpr const char* kCrossCommunicatorNames[] = {"MPI", "GLOO"};
static_assert(std::size(kInnerCommunicatorNames) == static_cast<size_t>(InnerCommunicator::GLOO) + 1);
static_assert(std::size(kCrossCommunicatorNames) == static_cast<size_t>(CrossCommunicator::GLOO) + 1);

// The limits of the settings, each declared once (the bit widths at the codec). cgx/config.py and cgx/layers.py read
// them from cgx._C (RAW_BITS, MAX_BITS, ...) to parse and check values, naming the variable;
// validate() in process_group_cgx.cpp checks a Settings against the same constants.
using compression::kMaxBits;  // compressed: 1..kMaxBits bits per value
using compression::kRawBits;  // no compression, the values travel exactly
// Larger buckets buy nothing (metadata is already negligible) and would overflow sizes.
constexpr int64_t kMaxBucketSize = int64_t{1} << 30;
constexpr int64_t kMaxMinimalSize = int64_t{1} << 62;
constexpr int64_t kMinShmRingBytes = 4096;
constexpr int64_t kMaxShmRingBytes = int64_t{1} << 36;
constexpr int64_t kMaxPieceValues = int64_t{1} << 30;

// The fields of Settings, each declared once here: the struct below and its Python binding
// (bindings.cpp) expand this list, and tests/test_config.py checks it against cgx/config.py's
// VARIABLES. No defaults here: the defaults are VARIABLES', and cgx/backend.py's to_settings
// sets every field from a cgx.Config. The zeros are "unset"; an unset bits, bucket_size,
// shm_ring_bytes or hostname fails validate().
#define CGX_SETTINGS_FIELDS(X)                                                           \
  X(int, bits)                        /* 1..kMaxBits, or kRawBits = no compression */    \
  X(int64_t, bucket_size)                                                                \
  X(int64_t, minimal_size)            /* tensors with at most this many go exactly */    \
  X(bool, compression_auto)           /* each call the faster way (path_choice.h) */     \
  X(bool, skip_incomplete_buckets)                                                       \
  X(bool, stochastic_rounding)                                                           \
  X(compression::Scheme, scheme)                                                         \
  X(uint64_t, seed)                                                                      \
  X(InnerCommunicator, inner_communicator)                                               \
  X(CrossCommunicator, cross_communicator)                                               \
  X(collectives::ReductionAlgorithm, inner_reduction)                                    \
  X(collectives::ReductionAlgorithm, cross_reduction)                                    \
  X(bool, intra_broadcast)            /* hierarchical: through one leader per host */    \
  X(bool, intra_compress)             /* hierarchical: compress inside a host too */     \
  X(std::string, hostname)            /* ranks with the same name share a host */        \
  X(int64_t, shm_ring_bytes)                                                             \
  X(int64_t, piece_values)            /* pipeline piece (CallOptions); 0: no pipeline */ \
  X(bool, deferred_execution)         /* debugging: host codec work queued to sync() */

struct Settings {
#define CGX_DECLARE_SETTING(type, name) type name{};
  CGX_SETTINGS_FIELDS(CGX_DECLARE_SETTING)
#undef CGX_DECLARE_SETTING
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
