// The epilogue of the chunked kernel: how results leave the chain's registers. The chain role calls these
// in place (no barrier of their own: each warp writes only its own 16 value rows, and the output tile goes
// through the warp's own staging buffer, ChainStorage::ostage, ordered by __syncwarp).
//   chunked_out_row     first of a chain warp's 16 outputs of a token;
//   store_state_regs    the state (or the chain gradient) of the warp's rows, from the accumulator layout, to
//                       a pool slot, a checkpoint row or the final state, fp32 or bf16;
//   store_output_tile   the chunk's output Oᵀ of the warp's rows, staged as O[t][v] in shared memory, then
//                       16-byte stores per token (element stores when the output view is not 16-byte aligned).
#pragma once
#include "kda/chunked/chunked_config.cuh"

namespace kda::prefill {

// (t: index along T)
__device__ __forceinline__ __nv_bfloat16* chunked_out_row(const RecurrentParams& p, const SeqRange& sr, int hv, int v0,
                                                          int64_t t) {
  return static_cast<__nv_bfloat16*>(p.out) + sr.batch * p.out_batch_stride + t * p.out_token_stride +
         int64_t(hv) * p.out_head_stride + v0;
}

// s[nt][e] = S[v0 + gq + 8 (e >= 2)][8 nt + 2 cq + (e & 1)] (the mma accumulator layout)
template <int K>
__device__ __forceinline__ void store_state_regs(const float (&s)[K / 8][4], void* base, DType dt, int64_t off,
                                                 int64_t head_off, int v0, int gq, int cq) {
#pragma unroll
  for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
    for (int hr = 0; hr < 2; ++hr) {
      const int64_t e = off + head_off + int64_t(v0 + gq + 8 * hr) * K + 8 * nt + 2 * cq;
      if (dt == DType::kBFloat16)
        *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + e) =
            __floats2bfloat162_rn(s[nt][2 * hr], s[nt][2 * hr + 1]);
      else
        *reinterpret_cast<float2*>(static_cast<float*>(base) + e) = make_float2(s[nt][2 * hr], s[nt][2 * hr + 1]);
    }
}

// Tokens [t_first, t_first + cl) of the chunk; `out_row` as chunked_out_row for this warp.
template <class OutRow>
__device__ __forceinline__ void store_output_tile(__nv_bfloat16* os, const float (&ao)[2][4], int lane, int gq, int cq,
                                                  int cl, int64_t t_first, const OutRow& out_row, bool out_vec16) {
  // stage Oᵀ as O[t][v] (16 x 16 bf16) and store this warp's 16 columns per token with 16-byte stores
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      os[(8 * nt + 2 * cq + (e & 1)) * 16 + gq + 8 * (e >> 1)] = __float2bfloat16_rn(ao[nt][e]);
  __syncwarp();
  const int t = lane >> 1, half = lane & 1;
  if (t < cl) {
    __nv_bfloat16* dst = out_row(t_first + t) + half * 8;
    const uint4 w = *reinterpret_cast<const uint4*>(os + t * 16 + half * 8);
    if (out_vec16) {
      *reinterpret_cast<uint4*>(dst) = w;
    } else {
      const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&w);
#pragma unroll
      for (int e = 0; e < 8; ++e) dst[e] = x[e];
    }
  }
}

}  // namespace kda::prefill
