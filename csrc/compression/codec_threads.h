// Threads for the codec (CGX_CODEC_THREADS): one pool per process, shared by every group,
// that runs the parts of a codec call (runs of whole buckets, quantizer.cpp) side by side.
// The calling thread runs parts too and takes back any still queued, so a call finishes
// even when every worker is busy with another group's call, or gone (in the child of a
// fork(), which copies no threads: the pool starts new ones there when next asked). An
// idle worker watches for the next call for 0.2 ms before it sleeps: the calls of a
// collective come a piece at a time, and waking a sleeping thread takes longer.
#pragma once

#include <functional>

namespace cgx::compression {

// Runs part(0) .. part(parts - 1), at most `threads` at once (the caller's included), and
// returns once all have run. An exception of a part is rethrown here (the first one, once
// the others have finished).
void run_parts(int parts, int threads, const std::function<void(int)>& part);

}  // namespace cgx::compression
