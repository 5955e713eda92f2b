// The tasks queued to cgx's own threads (the groups' workers, the callback threads),
// counted until each has run and released what it held. Releasing a tensor can take the
// GIL, which a thread cannot get once Python finalizes (Python ends the thread, and
// std::terminate follows): Python's exit waits first for none to be left (cgx/backend.py).
#pragma once

#include <chrono>

namespace cgx::backend::thread_tasks {

void queued();
void released();  // once the task ran and its captures are destroyed
// Waits until every task queued was released, or `bound` passed: false where it passed.
bool wait_released(std::chrono::milliseconds bound);

}  // namespace cgx::backend::thread_tasks
