// The collectives of a sharded model (FSDP2 under cgx.qsdp), written against Transport and
// the codec only. Every rank holds one shard of `shard.total()` values; the full buffer is
// `size` shards end to end, shard r belonging to rank r, each laid out as `shard` says
// (one segment per parameter, its bits and bucket size, or raw).
//
//   compressed_allgather: each rank quantizes its own shard once and decodes it in place;
//     every rank decodes every other shard from the bytes its owner sent. All ranks, the
//     owner included, end with bit-identical full buffers: the weights a step computes
//     with are the same everywhere. One quantization stage per value.
//   compressed_reduce_scatter: each rank quantizes the shard meant for each rank once
//     (its own included, unless with a residual: then it joins the sum as it is) and
//     sends it; the owner decodes the contributions and sums them in float32 in rank
//     order (SRA's first phase). One stage per contribution.
//   On one rank both return at once: nothing moves, and the values stay exact.
#pragma once

#include <cstdint>

#include "collectives/allreduce.h"

namespace cgx::collectives {

// The call's seed is stochastic rounding's stream (mixed with the rank) for the
// all-gather: the same seed and shard give the same bytes, so a forward and a backward
// gather of one step agree. Its residual must be unset (nothing is reduced).
struct AllgatherOptions : CallOptions {
  const compression::LayoutCodec* shard = nullptr;  // the layout of one shard
  // SRA: every owner sends its bytes to every peer; Ring: bytes are forwarded around the
  // ring unchanged. Either way every rank decodes its owner's bytes; the two give the same
  // bits except in stochastically rounded layers (each draws its own stream).
  ReductionAlgorithm algorithm = ReductionAlgorithm::SRA;
};

// `data`: the full buffer (size shards), this rank's values in shard `rank`; afterwards
// every shard holds its owner's values as decoded. Throws TimeoutError at the deadline.
Traffic compressed_allgather(transport::Transport& transport, int rank, int size, float* data,
                             const AllgatherOptions& options);

// The residual (size shards), where set, receives what quantizing this rank's
// contributions dropped, for error feedback.
struct ReduceScatterOptions : CallOptions {
  const compression::LayoutCodec* shard = nullptr;
};

// `data`: this rank's contributions, shard r for rank r; afterwards shard `rank` holds the
// sum over ranks (the other shards are left as they were). Throws TimeoutError at the
// deadline.
Traffic compressed_reduce_scatter(transport::Transport& transport, int rank, int size, float* data,
                                  const ReduceScatterOptions& options);

}  // namespace cgx::collectives
