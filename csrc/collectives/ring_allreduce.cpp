// Ring allreduce with compression, as the two phases of phases.h. `next` = rank + 1 and
// `prev` = rank - 1 around the ring; rank r owns chunk r.
//   reduce_scatter, steps s = 0 .. size-2: send chunk (rank - s - 1) compressed to next,
//     receive chunk (rank - s - 2) from prev and decompress-add it. The partial sum is
//     re-quantized at every hop, so a value goes through size - 1 quantization stages;
//     the last chunk received is our own, fully reduced.
//   allgather: the owner compresses its chunk once and decodes it locally (one more
//     stage); steps s = 0 .. size-2 forward the compressed bytes of chunk (rank - s) to
//     next unchanged and decode chunk (rank - s - 1) from prev. Bytes are never
//     re-quantized on the way, so all ranks decode the same bytes: bit-identical results.
//
// Both phases move each chunk in pieces: step n = s * P + q moves piece q of step s's
// chunk, so piece q + 1 is compressed while piece q is on the wire. A piece forwarded or
// re-quantized at hop s + 1 arrived at hop s, P steps earlier; with one piece (P = 1)
// each step is finished before the next begins.
#include <algorithm>

#include "collectives/phases.h"
#include "collectives/pipeline.h"

namespace cgx::collectives {

namespace {
int mod(int a, int m) { return ((a % m) + m) % m; }
}  // namespace

Traffic ring_reduce_scatter(transport::Transport& transport, int rank, float* data,
                            const compression::LayoutCodec& codec, const Chunking& chunks,
                            const Phase& phase, Scratch& scratch) {
  const int size = chunks.parts();
  const int next = mod(rank + 1, size);
  const int prev = mod(rank - 1, size);
  const PieceLayout pieces = phase.pieces(codec, chunks);
  const int count = pieces.count();
  size_t largest = 0;
  for (int c = 0; c < size; ++c)
    for (int q = 0; q < count; ++q) largest = std::max(largest, pieces.bytes(c, q));
  // Two slots each way: step n's while step n - 1 is still on the wire or being decoded.
  const std::vector<uint8_t*> buf = scratch.buffers({largest, largest, largest, largest});
  auto outgoing = [&](int n) { return buf[n % 2]; };
  auto incoming = [&](int n) { return buf[2 + n % 2]; };
  auto out_chunk = [&](int n) { return mod(rank - n / count - 1, size); };
  auto in_chunk = [&](int n) { return mod(rank - n / count - 2, size); };

  compression::Executor& executor = *phase.executor;
  Steps steps;
  steps.count = (size - 1) * count;
  steps.serial = count == 1;
  steps.encode = [&](int n) {
    const int out = out_chunk(n), in = in_chunk(n), q = n % count;
    const Range piece = pieces.range(out, q);
    executor.compress_and_decode(codec, data, piece.begin, piece.end, outgoing(n),
                                 stream_seed(phase.seed, rank, n / count, out), phase.residual,
                                 /*decode_in_place=*/false);
    return StepExchange{{{next, outgoing(n), pieces.bytes(out, q)}},
                        {{prev, incoming(n), pieces.bytes(in, q)}}};
  };
  steps.decode = [&](int n) {
    const Range piece = pieces.range(in_chunk(n), n % count);
    executor.decompress_add(codec, incoming(n), piece.begin, piece.end, data);
  };
  run_steps(transport, executor, phase.deadline, steps);

  const std::vector<size_t> sizes = pieces.chunk_bytes();
  Traffic traffic;
  for (int s = 0; s + 1 < size; ++s) {
    const int out = mod(rank - s - 1, size);
    traffic += {sizes[out], static_cast<uint64_t>(chunks.length(out))};
  }
  return traffic;
}

Traffic ring_allgather(transport::Transport& transport, int rank, float* data,
                       const compression::LayoutCodec& codec, const Chunking& chunks,
                       const Phase& phase, const std::vector<uint8_t*>& buf) {
  const int size = chunks.parts();
  const int next = mod(rank + 1, size);
  const int prev = mod(rank - 1, size);
  const PieceLayout pieces = phase.pieces(codec, chunks);
  const int count = pieces.count();
  auto out_chunk = [&](int n) { return mod(rank - n / count, size); };
  auto in_chunk = [&](int n) { return mod(rank - n / count - 1, size); };

  compression::Executor& executor = *phase.executor;
  Steps steps;
  steps.count = (size - 1) * count;
  steps.serial = count == 1;
  steps.encode = [&](int n) {
    const int out = out_chunk(n), in = in_chunk(n), q = n % count;
    if (n < count)  // the first hop carries our own chunk, quantized here
      quantize_owned_chunk(executor, codec, data, pieces.range(rank, q),
                           buf[rank] + pieces.offset(rank, q),
                           stream_seed(phase.seed, rank, size, rank), phase.residual);
    return StepExchange{{{next, buf[out] + pieces.offset(out, q), pieces.bytes(out, q)}},
                        {{prev, buf[in] + pieces.offset(in, q), pieces.bytes(in, q)}}};
  };
  steps.decode = [&](int n) {
    const int in = in_chunk(n), q = n % count;
    const Range piece = pieces.range(in, q);
    executor.decompress(codec, buf[in] + pieces.offset(in, q), piece.begin, piece.end, data);
  };
  run_steps(transport, executor, phase.deadline, steps);

  const std::vector<size_t> sizes = pieces.chunk_bytes();
  Traffic traffic;
  for (int s = 0; s + 1 < size; ++s) {
    const int out = mod(rank - s, size);
    traffic += {sizes[out], static_cast<uint64_t>(chunks.length(out))};
  }
  return traffic;
}

}  // namespace cgx::collectives
