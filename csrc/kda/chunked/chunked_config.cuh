// Configuration of the chunked kernel (chunked_kernel.cuh): the problem constants, the per-instantiation
// ChunkedConfig (value rows per CTA, pipeline depths, warp roles, named-barrier ids and counts), the
// fragment/tile helpers every role uses, and the CTA's shared memory, composed of each role's storage
// (chunked_prep.cuh, chunked_solve.cuh, chunked_chain.cuh own theirs; the operand tiles between them are
// here, since two roles share each).
//
// Roles and their barriers, per operand stage b = chunk % kStages:
//   prep  (G, 4 warps)  waits EMPTY[b] (the chain is done with stage b), writes the G -> W tiles and its
//                       share of the operands, arrives KREADY[b];
//   solve (W, 1 warp)   waits KREADY[b], writes L / Mqk / INVb into the operands, arrives FULL[b];
//   chain (NW warps)    waits FULL[b], consumes the operands (and its own v tile), arrives EMPTY[b].
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/common/bf16_bits.cuh"
#include "kda/chunked/chunk_math.cuh"
#include "kda/common/ptx.cuh"
#include "kda/common/recurrent_rules.h"
#include "kda/params.h"

namespace kda::prefill {

using namespace ::kda::ptx;         // ldsm / mma / cp.async / named barriers
using namespace ::kda::chunk_math;  // gate prefix, norms, β, the 16x16 inverse (shared with the Hopper kernel)

constexpr int kChunk = 16;                     // tokens per chunk (the m16 of mma.sync)
constexpr int kHeadDim = 128;                  // K = V
constexpr int kPrepWarps = 4;                  // "G" warps: gate, norms, decayed operand tiles
constexpr int kPrepThreads = kPrepWarps * 32;  // one per channel (K = 128)
constexpr int kSolveThreads = 32;              // "W" warp: L and Mqk GEMMs, the triangular inverse

// Named barriers (0 is __syncthreads): G-internal; KREADY (G -> W), FULL (W -> chain), EMPTY (chain -> G),
// each per operand buffer.
// Pipeline depths are template parameters (ChunkedConfig): kStages operand buffers between G/W and the
// chain (how far prep may run ahead), kRawStages cp.async ring slots for the raw token tiles (prefetch
// distance + 1). The default 3 / 4 needs ~150 KB of shared memory; 2 / 2 (~94 KB at VB = 64) fits sm_120.
constexpr int kBarPrep = 1, kBarFull0 = 2;  // then EMPTY, KREADY: ChunkedConfig::kBarEmpty0, kBarKReady0

// Benchmark-only switches (KDA_EXPERIMENT=chunked_diag=mask): skip one role's math to see what it costs. They break the
// results on purpose and are never set in normal use.
constexpr int kDiagNoChain = 1, kDiagNoSolve = 2, kDiagNoPrep = 4;

template <int VB_, int STAGES_ = 3, int RAW_STAGES_ = 4>
struct ChunkedConfig {
  static constexpr int K = kHeadDim;
  static constexpr int VB = VB_;  // value rows per CTA
  static constexpr int kStages = STAGES_;
  static constexpr int kRawStages = RAW_STAGES_;
  static constexpr int kBarEmpty0 = kBarFull0 + kStages, kBarKReady0 = kBarFull0 + 2 * kStages;
  static_assert(kBarKReady0 + kStages <= 16, "16 hardware barriers per CTA");
  static_assert(kStages >= 2 && kRawStages >= 2, "double buffering at least");
  static constexpr int NW = VB / 16;  // chain warps (16 value rows each)
  static constexpr int NC = NW * 32;  // chain threads
  static constexpr int NT = NC + kPrepThreads + kSolveThreads;
  static constexpr int kCountFull = NC + kSolveThreads;  // W arrives, chain syncs
  static constexpr int kCountEmpty = NC + kPrepThreads;  // chain arrives, G syncs
  static constexpr int kCountKReady = kPrepThreads + kSolveThreads;
  static constexpr int kParts = K / VB;  // CTAs per (sequence, value head)
  static constexpr int KCH = K / 8;      // 16-byte pieces per K row
  static_assert(VB == 64 || VB == 128, "value rows per CTA must be 64 or 128");
};

__device__ __forceinline__ int swz(int row, int piece) {
  return row * kHeadDim + ((piece ^ (row & 7)) << 3);
}

// ldmatrix addresses of a lane for the 8 k-steps over a swizzled [16][K] tile: row `row` (0..15), pieces
// 2 ks + bit. Since (2 ks + bit) ^ (row & 7) = 8 (ks >= 4) + ((2 (ks & 3) + bit) ^ (row & 7)), four offsets
// computed once replace the per-step swizzle arithmetic: offset(ks) = off[ks & 3] + (ks >> 2) * 64.
struct TileOffsets {
  int off[4];
  __device__ __forceinline__ TileOffsets(int row, int bit) {
#pragma unroll
    for (int q = 0; q < 4; ++q) off[q] = row * kHeadDim + (((2 * q + bit) ^ (row & 7)) << 3);
  }
  __device__ __forceinline__ int at(int ks) const { return off[ks & 3] + (ks >> 2) * 64; }
};

__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  // Saturate: the R path is bounded for sane inputs; out-of-range values stay finite instead of inf.
  lo = fminf(fmaxf(lo, -65504.f), 65504.f);
  hi = fminf(fmaxf(hi, -65504.f), 65504.f);
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float bf(const __nv_bfloat16 x) {
  return __bfloat162float(x);
}

// B operand fragments (n = 16 rows of a row-major [16][16] fp16 matrix M, k = its columns): b for n-tile
// 0 in r[0..1], n-tile 1 in r[2..3].
__device__ __forceinline__ void load_b16x16(const __half* mat, int lane, uint32_t (&r)[4]) {
  const int m = lane >> 3, r8 = lane & 7;
  ldsm_x4(mat + ((m >> 1) * 8 + r8) * 16 + (m & 1) * 8, r);
}

__device__ __forceinline__ uint4 pack8_bf16(const float (&x)[8]) {
  return make_uint4(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]), pack_bf16x2(x[4], x[5]), pack_bf16x2(x[6], x[7]));
}
__device__ __forceinline__ uint4 pack8_f16(const float (&x)[8]) {
  return make_uint4(pack_f16(x[0], x[1]), pack_f16(x[2], x[3]), pack_f16(x[4], x[5]), pack_f16(x[6], x[7]));
}
__device__ __forceinline__ uint4 pack8_f16_nosat(const float (&x)[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    __half2 h = __floats2half2_rn(x[2 * i], x[2 * i + 1]);
    w[i] = *reinterpret_cast<uint32_t*>(&h);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ float clamp_f16(float x) {
  return fminf(fmaxf(x, -65504.f), 65504.f);
}

// Stores x at M[r][c] of a [16][16] 16-bit operand matrix: fp16 (saturated) in the forward; in the backward
// chain (BWD) bf16 at the transposed position M[c][r], the orientation the adjoint products read.
template <bool BWD>
__device__ __forceinline__ void put16(__half* m, int r, int c, float x) {
  if constexpr (BWD)
    reinterpret_cast<__nv_bfloat16*>(m)[c * kChunk + r] = __float2bfloat16_rn(x);
  else
    m[r * kChunk + c] = __float2half_rn(clamp_f16(x));
}

// Shared memory of one CTA. Operand tiles [16 rows][K] of 16-bit values are XOR-swizzled in 16-byte
// pieces (piece ^ (row & 7)) so every ldmatrix phase hits 8 distinct bank groups. Every member is 16-byte
// aligned (cp.async, ldmatrix and float4/uint4 accesses) and a multiple of 16 bytes long, so the members
// lie where the roles expect them whatever their grouping.
template <int kStages>
struct alignas(16) ChunkedOperands {  // G/W -> chain, kStages-buffered
  static constexpr int K = kHeadDim;
  __nv_bfloat16 kp[kChunk * K], qp[kChunk * K];  // K⁺, Q⁺ (scale folded in)
  __half kr[kChunk * K];                         // Kr
  float gamma_c[K];                              // e^{Γ_C}
  __half invb[kChunk * kChunk], mqk[kChunk * kChunk];
};

// G -> W, kStages-buffered: the relative-exponent tiles of GEMM mode and A'.
template <int kStages>
struct alignas(16) PrepToSolveTiles {
  static constexpr int K = kHeadDim;
  alignas(16) __nv_bfloat16 km[kStages][kChunk * K], qm[kStages][kChunk * K], kn[kStages][kChunk * K];
  alignas(16) float ap[kStages][kChunk * kChunk];  // A' = diag(β) strict_tril(L) (by W, or by G in pairwise mode)
  alignas(16) float beta[kStages][kChunk];
};

// The work item of one CTA: (sequence n, value head hv, value-row part), and the chunk walk order.
template <bool BWD>
struct ChunkedTask {
  int64_t n;
  int part, hv, h;  // h: the q/k head of hv's GQA group
  SeqRange sr;
  StartState st;
  int64_t head_off;  // elements of head hv's [V, K] block within a slot
  int64_t inner;     // elements of one slot [HV, V, K]
  int64_t n_chunks;
  // the chunk the j-th step processes: j in the forward, last first in the backward chain
  __device__ __forceinline__ int64_t phys(int64_t j) const { return BWD ? n_chunks - 1 - j : j; }
  __device__ __forceinline__ int chunk_len(int64_t c) const {
    return static_cast<int>(sr.len - c * kChunk < kChunk ? sr.len - c * kChunk : kChunk);
  }
};

}  // namespace kda::prefill
