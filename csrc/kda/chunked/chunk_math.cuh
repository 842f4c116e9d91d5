// Per-chunk math shared by the two chunked kernels (the mma.sync kernel, chunked_prep.cuh / chunked_solve.cuh,
// and the Hopper kernel, sm90/chunked_sm90_kernel.cuh): 16-token chunks, K = V = 128. The gate of a chunk
// in log2 units and its in-chunk prefix, the q/k row norms, β, and the 16x16 inverse of the WY form. Both
// kernels call these with the same operands in the same order, which is what keeps their results the same
// bits (docs/design.md, "Chunked form").
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/common/bf16_bits.cuh"
#include "kda/params.h"

namespace kda::chunk_math {

constexpr int kChunkTokens = 16;  // tokens per chunk
constexpr int kChunkDim = 128;    // K = V
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kSpanLimit = 80.f * kLog2e;  // relative-exponent GEMM mode needs -Γ'_15 <= 80 nats (log2 units here)
constexpr float kMinLogDecay = -1e30f;       // keeps -inf gates from making inf - inf in relative exponents

__device__ __forceinline__ float to_float(const __nv_bfloat16 x) {
  return __bfloat162float(x);
}
template <class T>
__device__ __forceinline__ float to_float(const T x) {  // cutlass::bfloat16_t (the same exact conversion)
  return static_cast<float>(x);
}

// log-decay in log2 units (kda/common/recurrent_rules.h gate_log_decay times log2 e); A, Adtb, lb pre-scaled.
template <GateMode M>
__device__ __forceinline__ float gate_a(float x, float A, float Adtb, float dtb, float lb) {
  if constexpr (M == GateMode::kPrecomputed) {
    return x * kLog2e;
  } else if constexpr (M == GateMode::kSoftplus) {
    const float z = x + dtb;
    return -A * (z > 20.f ? z : log1pf(__expf(z)));
  } else {
    return __fdividef(lb, 1.f + exp2f(-fmaf(A, x, Adtb)));  // λ sigmoid(A (g + dt_bias)), log2 units
  }
}

// Γ' = Σ_{1..i} a of channel d over the chunk into gp[i * 128 + d] (a = 0 on rows i >= cl: padding, or the
// next sequence's tokens); returns a_0 and Γ'_15. graw: the chunk's raw gate rows [16][128].
template <GateMode M, class Bf16>
__device__ __forceinline__ void gate_prefix(const Bf16* graw, float* gp, int d, int cl, float A, float Adtb, float dtb,
                                            float lb, float& a0, float& gc) {
  // all loads first, then the 16 independent gate evaluations, then the (cheap) serial prefix
  float a[kChunkTokens];
#pragma unroll
  for (int i = 0; i < kChunkTokens; ++i) a[i] = to_float(graw[i * kChunkDim + d]);
#pragma unroll
  for (int i = 0; i < kChunkTokens; ++i) {
    const float x = fmaxf(gate_a<M>(a[i], A, Adtb, dtb, lb), kMinLogDecay);
    a[i] = i < cl ? x : 0.f;  // a select keeps the loop branch-free
  }
  a0 = a[0];
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kChunkTokens; ++i) {
    if (i > 0) acc += a[i];
    gp[i * kChunkDim + d] = acc;
  }
  gc = acc;
}

// gate_prefix for the call's gate mode.
template <class Bf16>
__device__ __forceinline__ void gate_prefix_of(GateMode mode, const Bf16* graw, float* gp, int d, int cl, float A,
                                               float Adtb, float dtb, float lb, float& a0, float& gc) {
  if (mode == GateMode::kLowerBound)
    gate_prefix<GateMode::kLowerBound>(graw, gp, d, cl, A, Adtb, dtb, lb, a0, gc);
  else if (mode == GateMode::kSoftplus)
    gate_prefix<GateMode::kSoftplus>(graw, gp, d, cl, A, Adtb, dtb, lb, a0, gc);
  else
    gate_prefix<GateMode::kPrecomputed>(graw, gp, d, cl, A, Adtb, dtb, lb, a0, gc);
}

// Σ x² of one 128-element bf16 row `row` (16-byte aligned, rows 256 bytes apart) split over 4 consecutive lanes
// (part4 = 0..3; lane part4 takes the 16-byte pieces part4, 4 + part4, 8 + part4, 12 + part4); all 4 lanes
// return the row's total. The pieces are visited in an order rotated by the row's parity, so that the 8 lanes of
// one shared-memory wavefront (two rows) read the two halves of the 32 banks: conflict-free.
__device__ __forceinline__ float row_sumsq_quad(const __nv_bfloat16* row, int part4, int row_parity) {
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int piece = ((e + row_parity) & 3) * 4 + part4;
    const uint4 w = *reinterpret_cast<const uint4*>(row + piece * 8);
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float lo = bf16_lo(ws[u]), hi = bf16_hi(ws[u]);
      s0 = fmaf(lo, lo, s0);
      s1 = fmaf(hi, hi, s1);
    }
  }
  float sq = s0 + s1;
  sq += __shfl_xor_sync(0xffffffffu, sq, 2);
  sq += __shfl_xor_sync(0xffffffffu, sq, 1);
  return sq;
}

// β as the kernels use it: sigmoid of the stored value when it is a logit.
__device__ __forceinline__ float beta_value(float x, bool is_logit) {
  return is_logit ? __fdividef(1.f, 1.f + __expf(-x)) : x;
}

// x = p[0..7]: two 16-byte loads (p 16-byte aligned), or with kVecLoads = false eight scalar loads, the
// inverse's earlier form, kept for an A/B in one build (the same values either way).
template <bool kVecLoads>
__device__ __forceinline__ void load_row8(const float* p, float (&x)[8]) {
  if constexpr (kVecLoads) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) x[e] = p[e];
  }
}

// INVb = (I + A')^{-1} diag(β) of the 16x16 unit-lower A' in fp32, by blocks: the two 8x8 diagonal blocks
// by forward substitution (lane c of each half-warp of lanes 0-15 owns column c of its block), then the
// off-diagonal block X = -I2 A'21 I1. ap: A' row-major [16][16] (its strictly lower part is read); i2s: 64
// floats of scratch shared by the warp; both 16-byte aligned (the rows are read 8 floats at a time, two
// 16-byte loads, where scalar loads took three times the load instructions on this serial path); beta[16].
// store(r, c, x) receives every element of INVb from lanes 0-15, or, with kSplitRows, rows r mod 8 < 4 of
// each block from lanes 0-15 and the others from lanes 16-31 (which hold the same columns: half the stores
// and products per lane on the serial tail). Called by one whole warp.
template <bool kVecLoads = true, bool kSplitRows = false, class Store>
__device__ __forceinline__ void unit_lower_inverse16(const float* ap, float* i2s, const float* beta, int lane,
                                                     Store&& store) {
  constexpr int C = kChunkTokens;
  const int blk = (lane >> 3) & 1, c = lane & 7, base = 8 * blk;
  float col[8];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    float x0 = i == c ? 1.f : 0.f, x1 = 0.f;
    if (i > 0) {
      float a[8];
      load_row8<kVecLoads>(ap + (base + i) * C + base, a);
#pragma unroll
      for (int mm = 0; mm < i; ++mm) {
        if (mm & 1)
          x1 = fmaf(-a[mm], col[mm], x1);
        else
          x0 = fmaf(-a[mm], col[mm], x0);
      }
    }
    col[i] = x0 + x1;
  }
  if (blk == 1 && lane < 16) {
#pragma unroll
    for (int r = 0; r < 8; ++r) i2s[r * 8 + c] = col[r];
  }
  float tcol[8];  // T[:, c] = A'21 I1[:, c] (meaningful in lanes 0..7)
#pragma unroll
  for (int r = 0; r < 8; ++r) {
    float a[8];
    load_row8<kVecLoads>(ap + (8 + r) * C, a);
    float t0 = 0.f, t1 = 0.f;
#pragma unroll
    for (int mm = 0; mm < 8; mm += 2) {
      t0 = fmaf(a[mm], col[mm], t0);
      t1 = fmaf(a[mm + 1], col[mm + 1], t1);
    }
    tcol[r] = t0 + t1;
  }
  __syncwarp();
  // rows of both blocks of column c: all 8 in lanes 0-15, or (kSplitRows) the first four in lanes 0-15 and the last
  // four in lanes 16-31, which hold the same columns (col[] indexed by constants only: a select per row)
  const int hi = kSplitRows ? lane >> 4 : 0;
  if (kSplitRows || lane < 16) {
#pragma unroll
    for (int rr = 0; rr < (kSplitRows ? 4 : 8); ++rr) {
      const int r = 4 * hi + rr;
      // ((4 + rr) & 7: a constant index in range also where the 8-row loop instantiates this select)
      const float cr = (kSplitRows && hi) ? col[(4 + rr) & 7] : col[rr];
      if (blk == 0) {
        const float bc = beta[c];
        float a[8];
        load_row8<kVecLoads>(i2s + r * 8, a);
        float x0 = 0.f, x1 = 0.f;
#pragma unroll
        for (int mm = 0; mm < 8; mm += 2) {
          x0 = fmaf(a[mm], tcol[mm], x0);
          x1 = fmaf(a[mm + 1], tcol[mm + 1], x1);
        }
        store(r, c, cr * bc);
        store(8 + r, c, -(x0 + x1) * bc);
      } else {
        const float bc = beta[8 + c];
        store(r, 8 + c, 0.f);
        store(8 + r, 8 + c, cr * bc);
      }
    }
  }
  __syncwarp();  // i2s is reused by the next call
}

}  // namespace kda::chunk_math
