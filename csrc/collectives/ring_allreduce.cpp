// Ring allreduce with compression. Terms: the buffer is cut into `size` chunks
// (Chunking); `next` = rank + 1 and `prev` = rank - 1 around the ring.
//   reduce-scatter, steps s = 0 .. size-2: send chunk (rank - s) compressed to next,
//     receive chunk (rank - s - 1) from prev and decompress-add it. The partial sum is
//     re-quantized at every hop, so a value goes through size - 1 quantization stages.
//   After it, rank owns chunk (rank + 1) fully reduced: it compresses it once and decodes
//     it locally (one more stage).
//   allgather, steps s = 0 .. size-2: forward the compressed bytes of chunk (rank + 1 - s)
//     to next unchanged and decode chunk (rank - s) from prev. Bytes are never
//     re-quantized on the way, so all ranks decode the same bytes: bit-identical results.
#include "collectives/allreduce.h"

#include <algorithm>

namespace cgx::collectives {

namespace {
int mod(int a, int m) { return ((a % m) + m) % m; }
}  // namespace

Traffic ring_allreduce(transport::Transport& transport, int rank, int size, float* data,
                       const compression::LayoutCodec& codec, const AllreduceOptions& options,
                       Scratch& scratch) {
  const Chunking chunks(codec, size);
  auto begin = [&](int c) { return chunks.offset(c); };
  auto end = [&](int c) { return chunks.offset(c + 1); };
  const int next = mod(rank + 1, size);
  const int prev = mod(rank - 1, size);

  // One compressed buffer per chunk, plus one to receive partial sums into.
  std::vector<size_t> sizes(size + 1);
  for (int c = 0; c < size; ++c) sizes[c] = codec.compressed_bytes(begin(c), end(c));
  sizes[size] = *std::max_element(sizes.begin(), sizes.begin() + size);
  const std::vector<uint8_t*> buf = scratch.buffers(sizes);
  uint8_t* incoming = buf[size];
  Traffic traffic;

  for (int s = 0; s + 1 < size; ++s) {
    const int out = mod(rank - s, size);
    const int in = mod(rank - s - 1, size);
    codec.compress(data, begin(out), end(out), buf[out], stream_seed(options.seed, rank, s, out));
    transport.exchange({{next, buf[out], sizes[out]}}, {{prev, incoming, sizes[in]}},
                       options.deadline);
    codec.decompress_add(incoming, begin(in), end(in), data);
    traffic += {sizes[out], static_cast<uint64_t>(chunks.length(out))};
  }

  const int owned = next;
  codec.compress(data, begin(owned), end(owned), buf[owned],
                 stream_seed(options.seed, rank, size, owned));
  codec.decompress(buf[owned], begin(owned), end(owned), data);

  for (int s = 0; s + 1 < size; ++s) {
    const int out = mod(rank + 1 - s, size);
    const int in = mod(rank - s, size);
    transport.exchange({{next, buf[out], sizes[out]}}, {{prev, buf[in], sizes[in]}},
                       options.deadline);
    codec.decompress(buf[in], begin(in), end(in), data);
    traffic += {sizes[out], static_cast<uint64_t>(chunks.length(out))};
  }
  return traffic;
}

}  // namespace cgx::collectives
