// The threads that complete cgx's futures, so the futures' callbacks run there. A thread
// is started whenever every existing one is busy: a callback that blocks (waiting for
// another collective of the group, say) never holds up another completion, as it could
// on torch's inter-op pool, whose size is fixed. Idle threads end after a while.
#pragma once

#include <functional>

namespace cgx::backend {

// Runs `task` on one of the threads (a task must not throw).
void run_on_callback_thread(std::function<void()> task);

}  // namespace cgx::backend
