// Ring allreduce with compression, as the two phases of allreduce.h. `next` = rank + 1 and
// `prev` = rank - 1 around the ring; rank r owns chunk r.
//   reduce_scatter, steps s = 0 .. size-2: send chunk (rank - s - 1) compressed to next,
//     receive chunk (rank - s - 2) from prev and decompress-add it. The partial sum is
//     re-quantized at every hop, so a value goes through size - 1 quantization stages;
//     the last chunk received is our own, fully reduced.
//   allgather: the owner compresses its chunk once and decodes it locally (one more
//     stage); steps s = 0 .. size-2 forward the compressed bytes of chunk (rank - s) to
//     next unchanged and decode chunk (rank - s - 1) from prev. Bytes are never
//     re-quantized on the way, so all ranks decode the same bytes: bit-identical results.
#include <algorithm>
#include <stdexcept>

#include "collectives/allreduce.h"

namespace cgx::collectives {

namespace {
int mod(int a, int m) { return ((a % m) + m) % m; }
}  // namespace

Traffic ring_reduce_scatter(transport::Transport& transport, int rank, float* data,
                            const compression::LayoutCodec& codec, const Chunking& chunks,
                            const Phase& phase, Scratch& scratch) {
  // A ring hop sends partial sums, not this rank's own contribution.
  if (phase.sent) throw std::invalid_argument("the ring reduce-scatter has no per-rank contribution to report");
  const int size = chunks.parts();
  const int next = mod(rank + 1, size);
  const int prev = mod(rank - 1, size);
  const std::vector<size_t> sizes = compressed_sizes(codec, chunks);
  const size_t largest = *std::max_element(sizes.begin(), sizes.end());
  const std::vector<uint8_t*> buf = scratch.buffers({largest, largest});
  uint8_t* outgoing = buf[0];
  uint8_t* incoming = buf[1];
  compression::Executor& executor = *phase.executor;
  Traffic traffic;
  for (int s = 0; s + 1 < size; ++s) {
    const int out = mod(rank - s - 1, size);
    const int in = mod(rank - s - 2, size);
    executor.compress(codec, data, chunks.offset(out), chunks.offset(out + 1), outgoing,
                      stream_seed(phase.seed, rank, s, out));
    executor.sync();
    transport.exchange({{next, outgoing, sizes[out]}}, {{prev, incoming, sizes[in]}},
                       phase.deadline);
    executor.decompress_add(codec, incoming, chunks.offset(in), chunks.offset(in + 1), data);
    traffic += {sizes[out], static_cast<uint64_t>(chunks.length(out))};
  }
  executor.sync();
  return traffic;
}

Traffic ring_allgather(transport::Transport& transport, int rank, float* data,
                       const compression::LayoutCodec& codec, const Chunking& chunks,
                       const Phase& phase, const std::vector<uint8_t*>& buf) {
  const int size = chunks.parts();
  const int next = mod(rank + 1, size);
  const int prev = mod(rank - 1, size);
  const std::vector<size_t> sizes = compressed_sizes(codec, chunks);
  compression::Executor& executor = *phase.executor;
  quantize_owned_chunk(executor, codec, data, chunks.range(rank), buf[rank],
                       stream_seed(phase.seed, rank, size, rank));
  Traffic traffic;
  for (int s = 0; s + 1 < size; ++s) {
    const int out = mod(rank - s, size);
    const int in = mod(rank - s - 1, size);
    executor.sync();
    transport.exchange({{next, buf[out], sizes[out]}}, {{prev, buf[in], sizes[in]}},
                       phase.deadline);
    executor.decompress(codec, buf[in], chunks.offset(in), chunks.offset(in + 1), data);
    traffic += {sizes[out], static_cast<uint64_t>(chunks.length(out))};
  }
  executor.sync();
  return traffic;
}

}  // namespace cgx::collectives
