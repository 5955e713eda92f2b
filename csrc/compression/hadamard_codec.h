// The hadamard scheme's CPU codec (hadamard_codec.cpp), as quantizer.cpp dispatches to it:
// a buffer laid out as `layout` (wire_layout), its whole buckets over up to `threads`.
#pragma once

#include <cstdint>

#include "compression/quantizer.h"

namespace cgx::compression {

void encode_hadamard_buffer(const QuantizerParams& params, const WireLayout& layout, const float* src,
                            uint64_t seed, uint32_t stream_offset, uint8_t* dst, int threads);
void decode_hadamard_buffer(const QuantizerParams& params, const WireLayout& layout, const uint8_t* src,
                            bool add, float* dst, int threads);

}  // namespace cgx::compression
