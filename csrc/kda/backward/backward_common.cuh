// Device helpers shared by the CUDA training backward kernels (training_backward.cu: the token-serial
// reverse sweep and the finishing kernels; training_backward_chunked.cu: the chunked backward).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/params.h"

namespace kda {
namespace bwd {

struct SeqSpan {
  int64_t batch, bos, len;
};

// Same rule as kda::seq_range (recurrent_rules.h): cu_seqlens clamped into [0, T].
__host__ __device__ __forceinline__ SeqSpan bwd_seq(const void* cu, bool i64, int64_t T, int64_t n) {
  if (cu == nullptr) return {n, 0, T};
  int64_t a, b;
  if (i64) {
    a = static_cast<const int64_t*>(cu)[n];
    b = static_cast<const int64_t*>(cu)[n + 1];
  } else {
    a = static_cast<const int32_t*>(cu)[n];
    b = static_cast<const int32_t*>(cu)[n + 1];
  }
  a = a < 0 ? 0 : (a > T ? T : a);
  b = b < a ? a : (b > T ? T : b);
  return {0, a, b - a};
}

__device__ __forceinline__ float ld_bf16(const void* base, int64_t off) {
  return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[off]);
}
__device__ __forceinline__ void st_bf16(void* base, int64_t off, float x) {
  static_cast<__nv_bfloat16*>(base)[off] = __float2bfloat16_rn(x);
}
__device__ __forceinline__ int64_t tok_off(const TokenTensor& t, int64_t batch, int64_t tok, int64_t head) {
  return batch * t.batch_stride + tok * t.token_stride + head * t.head_stride;
}
__device__ __forceinline__ float sigmoidf_(float x) { return 1.f / (1.f + __expf(-x)); }

__device__ __forceinline__ float warp_sum32(float x) {
#pragma unroll
  for (int o = 16; o >= 1; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

}  // namespace bwd
}  // namespace kda
