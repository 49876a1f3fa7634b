// CUDA's names for the bodies in metal_kernels/*.cu, on the emulators' runtime (runtime.h), for
// tests/cuda_emulator.py: a block's threads are the runtime's threads, __shared__ arrays its
// threadgroup memory, __syncthreads its barrier and __shfl_xor_sync an exchange within a warp.
// Each call's line identifies it (emu::barrier says why).
#pragma once
#include <cmath>
#include <cstring>

#include "runtime.h"

static float rsqrtf(float v) { return 1.0f / std::sqrt(v); }
static float __int_as_float(int v) { float f; memcpy(&f, &v, sizeof f); return f; }
struct Dim { int x, y, z; };
static int g_threads;
#define threadIdx (Dim{emu::team.current, 0, 0})
#define blockIdx (Dim{emu::team.group[0], emu::team.group[1], 0})
#define blockDim (Dim{g_threads, 1, 1})
#define __shared__ static
static void __syncthreads(int line = __builtin_LINE()) { emu::barrier(line); }
static float __shfl_xor_sync(unsigned, float v, int lane_mask, int line = __builtin_LINE()) {
  unsigned took_part;
  const unsigned char* lanes = emu::simd_exchange(&v, sizeof v, line, &took_part);
  float r;
  memcpy(&r, lanes + 16 * ((emu::team.current % emu::kLanes) ^ lane_mask), sizeof r);
  return r;
}
struct Ints { long long v[8]; long long operator[](int i) const { return v[i]; } };
