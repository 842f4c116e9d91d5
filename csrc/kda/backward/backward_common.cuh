// Device helpers shared by the CUDA training backward kernels (finish.cu: the uncovered-token zeroing and
// the finishing kernels; sweep.cu: the reverse sweep).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/common/recurrent_rules.h"  // seq_range: the clamp rule of every kernel
#include "kda/params.h"

namespace kda {
namespace bwd {

__device__ __forceinline__ float ld_bf16(const void* base, int64_t off) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]);
}
__device__ __forceinline__ void st_bf16(void* base, int64_t off, float x) {
  static_cast<__nv_bfloat16*>(base)[off] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ float sigmoidf_(float x) {
  return 1.f / (1.f + __expf(-x));
}

__device__ __forceinline__ float warp_sum32(float x) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// The widest |Γ| (nats) of a sub-chunk of an unbounded gate that still takes the factorised tensor-core form: every
// factor then stays <= e^{40}, as the lower-bound gate's mid-token factors do (8 |λ| <= 40).
constexpr float kNarrowSpan = 40.f;
constexpr float kNegligibleDecay = -17.f;  // e^{-17} < 2^-24, fp32's unit roundoff (the da rule, below)

// The log-decay of the unbounded gates from x = g + dt_bias (softplus; A = exp(A_log)) or x = g (precomputed), in
// nats, as the forward computes it (kda/chunked/chunk_math.cuh gate_a: softplus(x) = x above 20; the same floor,
// which keeps a -inf gate from making inf - inf).
constexpr float kMinLogDecayNats = -1e30f;
__device__ __forceinline__ float unbounded_log_decay(bool softplus, float x, float A) {
  const float a = softplus ? -A * (x > 20.f ? x : log1pf(__expf(x))) : x;
  return fmaxf(a, kMinLogDecayNats);
}

// Σ over the 32 lanes of v[i], for each i < 16, in a fixed order: a transposing butterfly (each step halves the
// rows a lane carries and doubles the lanes summed; 16 shuffles where 16 warp sums take 80). Lanes 2i and 2i + 1
// end with the total of row i; store(i, total) runs on lane 2i.
template <typename F>
__device__ __forceinline__ void pair_column_store(float (&v)[16], int lane, F store) {
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const bool up = lane & 16;
    const float send = up ? v[k] : v[k + 8], keep = up ? v[k + 8] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 16);
  }
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const bool up = lane & 8;
    const float send = up ? v[k] : v[k + 4], keep = up ? v[k + 4] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 8);
  }
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const bool up = lane & 4;
    const float send = up ? v[k] : v[k + 2], keep = up ? v[k + 2] : v[k];
    v[k] = keep + __shfl_xor_sync(0xffffffffu, send, 4);
  }
  {
    const bool up = lane & 2;
    const float send = up ? v[0] : v[1], keep = up ? v[1] : v[0];
    v[0] = keep + __shfl_xor_sync(0xffffffffu, send, 2);
  }
  v[0] += __shfl_xor_sync(0xffffffffu, v[0], 1);
  if ((lane & 1) == 0) store(lane >> 1, v[0]);
}

// Slot r belongs to the one sequence n with slot_cu_starts[n] <= r < slot_cu_starts[n + 1] (empty sequences own
// no slots); -1 for slots past the last sequence's.
__device__ __forceinline__ int64_t slot_sequence(const int64_t* starts, int64_t N, int64_t row) {
  if (row < 0 || row >= starts[N]) return -1;
  int64_t lo = 0, hi = N;  // invariant: starts[lo] <= row < starts[hi]
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) / 2;
    if (starts[mid] <= row)
      lo = mid;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace bwd
}  // namespace kda
