// A group's validated settings (cgx/config.py parses the CGX_* variables into these).
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>

#include "collectives/allreduce.h"
#include "common/mix.h"
#include "compression/quantizer.h"

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
// validate() in argument_checks.cpp checks a Settings against the same constants.
using compression::kMaxBits;  // compressed: 1..kMaxBits bits per value
using compression::kRawBits;  // no compression, the values travel exactly
// Larger buckets buy nothing (metadata is already negligible) and would overflow sizes.
constexpr int64_t kMaxBucketSize = int64_t{1} << 30;
constexpr int64_t kMaxMinimalSize = int64_t{1} << 62;
constexpr int64_t kMinShmRingBytes = 4096;
constexpr int64_t kMaxShmRingBytes = int64_t{1} << 36;
constexpr int64_t kMaxPieceValues = int64_t{1} << 30;
constexpr int kMaxCodecThreads = 1024;
constexpr size_t kMaxShmNameTag = 32;

// The fields of Settings, each declared once here: the struct below, its Python binding
// (bindings.cpp) and signed_settings_digest expand this list, and tests/test_config.py
// checks it against cgx/config.py's VARIABLES. No defaults here: the defaults are
// VARIABLES', and cgx/backend.py's to_settings sets every field from a cgx.Config. The
// zeros are "unset"; an unset bits, bucket_size, shm_ring_bytes or hostname fails validate().
//
// The third column says whether a field changes what a call computes or which way it goes
// (kSigned: every compressed call's signature carries it, in signed_settings_digest, so
// ranks that differ in it fail the call's check on every rank) or only how the values get
// there (kNotSigned: transports, buffers, debugging, this rank's host name).
#define CGX_SETTINGS_FIELDS(X)                                                                       \
  X(int, bits, kSigned)                        /* 1..kMaxBits, or kRawBits = no compression */    \
  X(int64_t, bucket_size, kSigned)                                                                \
  X(int64_t, minimal_size, kSigned)            /* tensors with at most this many go exactly */    \
  X(bool, compression_auto, kSigned)           /* each call the faster way (path_choice.h) */     \
  X(bool, skip_incomplete_buckets, kSigned)                                                       \
  X(bool, stochastic_rounding, kSigned)                                                           \
  X(compression::Scheme, scheme, kSigned)                                                         \
  X(uint64_t, seed, kSigned)                   /* stochastic rounding's streams */                \
  X(InnerCommunicator, inner_communicator, kNotSigned)                                            \
  X(CrossCommunicator, cross_communicator, kNotSigned)                                            \
  X(collectives::ReductionAlgorithm, inner_reduction, kSigned)                                    \
  X(collectives::ReductionAlgorithm, cross_reduction, kSigned)                                    \
  X(bool, intra_broadcast, kSigned)            /* hierarchical: through one leader per host */    \
  X(bool, intra_compress, kSigned)             /* hierarchical: compress inside a host too */     \
  X(std::string, hostname, kNotSigned)         /* ranks with the same name share a host */        \
  X(std::string, shm_name_tag, kNotSigned)     /* in this rank's segment names; "" for none */    \
  X(int64_t, shm_ring_bytes, kNotSigned)                                                          \
  X(int64_t, piece_values, kNotSigned)         /* pipeline piece (CallOptions); changes no bit */ \
  X(int, codec_threads, kNotSigned)            /* 1..kMaxCodecThreads; changes no bit */          \
  X(bool, deferred_execution, kNotSigned)      /* debugging: host codec work queued to sync() */

constexpr bool kSigned = true;
constexpr bool kNotSigned = false;

struct Settings {
#define CGX_DECLARE_SETTING(type, name, is_signed) type name{};
  CGX_SETTINGS_FIELDS(CGX_DECLARE_SETTING)
#undef CGX_DECLARE_SETTING
};

namespace detail {
// A setting's value as one word for the digest.
template <typename T>
constexpr uint64_t setting_word(const T& value) {
  return static_cast<uint64_t>(value);
}
inline uint64_t setting_word(const std::string& text) {
  uint64_t word = text.size();
  for (const char c : text) word = splitmix64(word ^ static_cast<unsigned char>(c));
  return word;
}
}  // namespace detail

// A 64-bit digest of the kSigned fields, in the table's order (what a call's signature
// carries as `settings`; the group computes it once, at construction).
inline uint64_t signed_settings_digest(const Settings& s) {
  uint64_t digest = 0;
#define CGX_MIX_SETTING(type, name, is_signed) \
  if (is_signed) digest = splitmix64(digest ^ detail::setting_word(s.name));
  CGX_SETTINGS_FIELDS(CGX_MIX_SETTING)
#undef CGX_MIX_SETTING
  return digest;
}

// The quantizer the settings give a compressed call without a layout of its own. A group's
// scheme where the codec takes its bits and bucket size (hadamard stops at 4 bits), maxmin
// elsewhere (compression/schemes.h, fitted_scheme), as a CompressionPolicy's is
// (cgx/layers.py): the default scheme holds at every width.
inline compression::QuantizerParams quantizer_of(const Settings& s) {
  compression::QuantizerParams params;
  params.bits = s.bits;
  params.bucket_size = s.bucket_size;
  params.skip_incomplete_buckets = s.skip_incomplete_buckets;
  params.stochastic = s.stochastic_rounding;
  params.scheme = compression::fitted_scheme(s.scheme, s.bits, s.bucket_size);
  return params;
}

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
