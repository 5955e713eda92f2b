// The CUDA header cuda_runtime.h, for sources built against the emulation.
#pragma once
#include "cuda_emulation.h"
