// The CUDA header cuda_bf16.h, for sources built against the emulation.
#pragma once
#include "cuda_emulation.h"
