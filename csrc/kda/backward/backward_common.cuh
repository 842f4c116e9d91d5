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
__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }

__device__ __forceinline__ float warp_sum32(float x) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace bwd
}  // namespace kda
