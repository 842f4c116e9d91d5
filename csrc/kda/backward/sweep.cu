// CUDA training backward of KDA, chunked form (docs/contract.md, Recurrence, in the WY form of the chunked
// prefill): the sweep stage of launch_training_backward (finish.cu), the chunk-parallel reverse sweep.
//
// The algebra is kda_ops/reference_chunked_backward.py (checked there against fp64 autograd), with 16-token
// chunks ("sub-chunks" of the 64-token tape chunks):
//   forward, recomputed from S_0:  Γ = cumsum(a), E = e^{Γ}, L, Mqk, INV = (I + diag(β) L)^{-1},
//                                  X = K⁺ S_0ᵀ, R = INV (β ⊙ (V - X))
//   backward, given dO and dS_C:   dR = Mqkᵀ dO + Kr dS_Cᵀ, dY = INVᵀ dR, dA = -stril(dY Rᵀ),
//                                  dMqk = tril(dO Rᵀ), dKr = R dS_C, dK⁺ = -β dY S_0, dQ⁺ = dO S_0,
//                                  dS_0 = dS_C g_C + dOᵀ Q⁺ - (β dY)ᵀ K⁺, pair terms, dΓ, da = rev-cumsum(dΓ).
//
// Two stages. The backward chain (the chunked prefill kernel in reverse, kda/chunked/chunked_kernel.cuh with
// BWD = true, launched by csrc/api/training_cuda.cpp) carries dS over each sequence, last chunk first, and
// writes dS_C of every 16-token chunk to p.dstates. Then this kernel, one CTA (512 threads, 16 warps) per
// (64-token chunk, value head) task, persistent over the tasks, needs no serial dependence between tasks: it
// loads the state entering the chunk (initial_state for a sequence's first chunk, else its tape row) into
// shared memory (fp32 [128][132], padded rows; the small sweep: into its global scratch, see kStateFloats)
// and walks the four sub-chunks forward, each step with dS_C from p.dstates: the gradients of the sub-chunk,
// then S = S g_C + Rᵀ Kr for the next. Products run on tensor cores (tf32 mma.sync; 3xTF32 where dΓ needs
// the digits, see mma_frag); no atomics: bit-identical reruns, and the parameter partials are one row per
// task, summed in row order (the same bits on every GPU).
//
// Exponents: Γ is relative to the sub-chunk start, so E = e^{Γ} <= 1 and 1/E = e^{-Γ} <= e^{16|λ|} = e^{80}
// for the training contract's λ >= -5 (finite in fp32). Pair factors are formed either as E_i · e^{-Γ_j}
// (<= 1 for j <= i) or with the mid-token reference (each factor <= e^{8|λ|} = e^{40}) before they multiply
// anything, so no intermediate overflows.
// The softplus and precomputed gates are unbounded per token (a = -1000 is valid), so e^{-Γ} may overflow. Their
// kernel (kUnbounded) tests every sub-chunk: narrow ones (every |Γ| <= kNarrowSpan = 40, the lower-bound gate's
// own range of factors) take the factorised form above; in wide ones no positive exponent is ever evaluated:
// Ei holds the log-decay a itself, Kr's factor is e^{Γ_last - Γ} from suffix sums of a, and L, Mqk and the three
// pair terms use exact pairwise factors e^{Γ_i - Γ_j} (i >= j) on CUDA cores, the exponent summed outward from
// the pair's own token (Σ_{j < u <= i} a_u: no cancellation of large prefixes when a -1000 token precedes -1e-3
// ones), masked pairs never exponentiated. The lower-bound kernel is the kUnbounded = false instantiation, its
// machine code unchanged.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "kda/backward/backward_common.cuh"
#include "kda/backward/backward_params.h"
#include "kda/backward/tf32_mma.cuh"
#include "kda/common/cuda_check.h"
#include "kda/common/ptx.cuh"
#include "kda/common/recurrent_rules.h"  // kL2NormEps

namespace kda {
namespace {
using namespace bwd;

constexpr int kC = 16;         // tokens per sub-chunk
constexpr int kMid = 8;        // reference token of the pair factors ("mid" diagonal blocks, docs/design.md)
constexpr int kD = kBwdDim;    // K == V == 128
constexpr int kLD = kD + 4;    // padded row stride (floats) of the shared-memory matrices
constexpr int kThreads = 512;  // 16 warps: warp w owns columns [8w, 8w+8) of every [16 x 128] product
constexpr int kWarps = kThreads / 32;
constexpr int kSubPerTape = kTapeChunk / kC;
static_assert(kD == 128 && kWarps == 16, "thread layouts below assume 128 channels and 16 warps");

// The two [128][kLD] state matrices, S (the forward state entering the current sub-chunk, S[v][k]) then dS (the
// chain gradient dL/dS at the end of the current sub-chunk): at the start of shared memory, before the
// ChunkedBwdSmem tiles, in the default sweep; in a global scratch of 2 x 128 x kLD floats per CTA in the small
// sweep (kGlobalState: GPUs with ~99 KiB of shared memory per block, sm_120), where shared memory holds the
// tiles alone. Same arithmetic, same bits.
constexpr int kStateFloats = kD * kLD;

struct ChunkedBwdSmem {
  float kn[kC * kLD];  // normalised k
  float qs[kC * kLD];  // normalised q times scale
  float E[kC * kLD];   // e^{Γ}
  float Ei[kC * kLD];  // e^{-Γ}
  float vx[kC * kLD];  // v, then V - X, then dK⁺
  float dO[kC * kLD];  // dL/do, then dL/dq̂ (the fused L2-norm backward)
  float R[kC * kLD];   // deltas R = INV β (V - X)
  float kr[kC * kLD];  // Kr = k e^{Γ_last - Γ}
  float kp[kC * kLD];  // K⁺ = k e^{Γ}, then dY, then dQ⁺, then dΓ
  float dr[kC * kLD];  // dR, then dKr
  float L[kC][kC];     // strictly lower, β not applied
  float M[kC][kC];     // Mqk, lower incl. diagonal
  float INV[kC][kC];
  float dA[kC][kC];  // dL/dA (strictly lower), A = I + diag(β) L
  float dM[kC][kC];
  float beta[kC];   // σ(logit), 0 on padding tokens
  float rho_q[kC];  // 1 / |q| and 1 / |k| (the L2 norms' rsqrt, no scale), for the fused L2-norm backward
  float rho_k[kC];
  float gC[kD];       // e^{Γ_last}
  float ext[kD];      // extra dΓ of the last position (Kr·dKr and the S_0 decay term)
  float part[4][kD];  // partial column sums
};

__device__ __forceinline__ float4 ld4(const float* p) {
  return *reinterpret_cast<const float4*>(p);
}
__device__ __forceinline__ void st4(float* p, float4 x) {
  *reinterpret_cast<float4*>(p) = x;
}
__device__ __forceinline__ float dot4(float4 a, float4 b, float acc) {
  return fmaf(a.w, b.w, fmaf(a.z, b.z, fmaf(a.y, b.y, fmaf(a.x, b.x, acc))));
}

// Tensor-core products: tf32 mma.sync helpers (tf32, mma_frag, frag_each) in kda/backward/tf32_mma.cuh.

// ldmatrix of four 8x4 fp32 tiles (as 8x8 b16): lane l gives the row address of tile l / 8 and receives, from
// each tile, the 32-bit element (row l / 4, column l % 4), which is the tf32 m16n8k8 fragment layout.
__device__ __forceinline__ void ldsm_f32x4(const float* p, uint32_t (&r)[4]) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(p), r[0], r[1], r[2], r[3]);
}

// d += Σ_k A[m][k] B(k, n0 + n) over k < 128, plain tf32, with A a [16][kLD] shared tile (k contiguous) read by
// ldmatrix; B_NK: B stored [n][kLD] (k contiguous, ldmatrix too unless B_GLOBAL: scalar loads of the same
// fragment, B in global memory), else [k][kLD] (n contiguous, scalar loads).
// Rows of kLD = 132 floats put the 8 rows of an ldmatrix phase in 8 distinct 16-byte bank groups.
// PRECISE: 3xTF32 (as mma_frag), for the products that feed dβ = dY · (V - X) of cancelling one-token sequences.
template <bool B_NK, bool B_GLOBAL = false, bool PRECISE = false>
__device__ __forceinline__ void mma_rows(float (&d)[4], int n0, const float* A, const float* B) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const float* pa = A + ((lane & 7) + 8 * ((lane >> 3) & 1)) * kLD + 4 * (lane >> 4);
  const float* pb =
      B_NK ? (B_GLOBAL ? B + (n0 + g) * kLD + q : B + (n0 + (lane & 7)) * kLD + 4 * (lane >> 3)) : B + q * kLD + n0 + g;
  float e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int k0 = 0; k0 < kD; k0 += 16) {
    uint32_t a0[4], a1[4], b[4];
    ldsm_f32x4(pa + k0, a0);
    ldsm_f32x4(pa + k0 + 8, a1);
    if constexpr (B_NK && B_GLOBAL) {  // ldmatrix's fragment: b[i] = B[n0 + g][k0 + 4 i + q]
#pragma unroll
      for (int i = 0; i < 4; ++i) b[i] = __float_as_uint(pb[k0 + 4 * i]);
    } else if constexpr (B_NK) {
      ldsm_f32x4(pb + k0, b);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) b[i] = __float_as_uint(pb[(k0 + 4 * i) * kLD]);
    }
    if constexpr (PRECISE) {  // x = hi + lo, each a tf32 number; a_hi b_lo + a_lo b_hi + a_hi b_hi
      uint32_t a0l[4], a1l[4], bl[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const float fa0 = __uint_as_float(a0[i]), fa1 = __uint_as_float(a1[i]), fb = __uint_as_float(b[i]);
        a0[i] = tf32_hi(fa0), a1[i] = tf32_hi(fa1), b[i] = tf32_hi(fb);
        a0l[i] = tf32(fa0 - __uint_as_float(a0[i])), a1l[i] = tf32(fa1 - __uint_as_float(a1[i]));
        bl[i] = tf32(fb - __uint_as_float(b[i]));
      }
      mma_tf32(d, a0l, b[0], b[1]);
      mma_tf32(d, a0, bl[0], bl[1]);
      mma_tf32(e, a1l, b[2], b[3]);
      mma_tf32(e, a1, bl[2], bl[3]);
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {  // round (see tf32)
        a0[i] += 0x1000u, a1[i] += 0x1000u;
        b[i] += 0x1000u;
      }
    }
    mma_tf32(d, a0, b[0], b[1]);
    mma_tf32(e, a1, b[2], b[3]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] += e[i];
}

// d1 += Σ_k A1[m][k] B[k][n0 + n], d2 += Σ_k A2[m][k] B[k][n0 + n] over k < 128: mma_rows<false> for two A tiles
// ([16][kLD]) against one B ([128][kLD], n contiguous), whose scalar loads serve both; A2 holds tf32-exact values.
__device__ __forceinline__ void mma_rows_pair(float (&d1)[4], float (&d2)[4], int n0, const float* A1, const float* A2,
                                              const float* B) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  const int ao = ((lane & 7) + 8 * ((lane >> 3) & 1)) * kLD + 4 * (lane >> 4);
  const float* pb = B + q * kLD + n0 + g;
  float e1[4] = {0.f, 0.f, 0.f, 0.f}, e2[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 2
  for (int k0 = 0; k0 < kD; k0 += 16) {
    uint32_t a0[4], a1[4], c0[4], c1[4], b[4];
    ldsm_f32x4(A1 + ao + k0, a0);
    ldsm_f32x4(A1 + ao + k0 + 8, a1);
    ldsm_f32x4(A2 + ao + k0, c0);
    ldsm_f32x4(A2 + ao + k0 + 8, c1);
#pragma unroll
    for (int i = 0; i < 4; ++i) b[i] = __float_as_uint(pb[(k0 + 4 * i) * kLD]) + 0x1000u;
#pragma unroll
    for (int i = 0; i < 4; ++i) a0[i] += 0x1000u, a1[i] += 0x1000u;
    mma_tf32(d1, a0, b[0], b[1]);
    mma_tf32(e1, a1, b[2], b[3]);
    mma_tf32(d2, c0, b[0], b[1]);
    mma_tf32(e2, c1, b[2], b[3]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) d1[i] += e1[i], d2[i] += e2[i];
}

// C[t][v] (acc ? +=: =) sign·Σ_c A[t][c] B[v][c]   (A, C [16][kLD]; B [128][kLD], in global memory if
// B_GLOBAL); warp w: v in [8w, 8w+8). PRECISE: 3xTF32 (mma_rows).
template <bool B_GLOBAL = false, bool PRECISE = false>
__device__ __forceinline__ void gemm_abt(float* C, const float* A, const float* B, float sign, bool acc) {
  const int n0 = (threadIdx.x >> 5) * 8;
  float d[4] = {};
  mma_rows<true, B_GLOBAL, PRECISE>(d, n0, A, B);
  frag_each(d, n0, [&](int t, int v, float x) {
    float* o = C + t * kLD + v;
    *o = acc ? fmaf(sign, x, *o) : sign * x;
  });
}

// C[t][c] = sign·rs(t)·Σ_v A[t][v] B[v][c]   (A, C [16][kLD]; B [128][kLD]); rs = row_scale or 1.
__device__ __forceinline__ void gemm_ab(float* C, const float* A, const float* B, float sign, const float* row_scale) {
  const int n0 = (threadIdx.x >> 5) * 8;
  float d[4] = {};
  mma_rows<false>(d, n0, A, B);
  frag_each(d, n0, [&](int t, int c, float x) { C[t * kLD + c] = (row_scale ? sign * row_scale[t] : sign) * x; });
}

// C[t][c] = Σ_j W(t, j)·cs(j)·A[j][c], W(t, j) = Wm[t][j] (or Wm[j][t] if TRANS), cs = colscale or 1.
// PRECISE: 3xTF32 (mma_frag).
template <bool TRANS, bool PRECISE = false>
__device__ __forceinline__ void gemm_small(float* C, const float (*Wm)[kC], const float* cs, const float* A) {
  const int n0 = (threadIdx.x >> 5) * 8;
  float d[4] = {};
  mma_frag<kC, PRECISE>(
      d, n0, [&](int m, int k) { return TRANS ? Wm[k][m] : Wm[m][k]; },
      [&](int k, int n) { return (cs ? cs[k] : 1.f) * A[k * kLD + n]; });
  frag_each(d, n0, [&](int t, int c, float x) { C[t * kLD + c] = x; });
}

// W[i][j] = sign·Σ_c fa(i, c)·fb(j, c) for j < i (strict) or j <= i, 0 above: warps w0 and w0 + 1
// (columns j in [0, 8) and [8, 16)); other warps return at once.
template <typename FA, typename FB>
__device__ __forceinline__ void gemm_tri(float (*W)[kC], int w0, FA fa, FB fb, bool strict, float sign) {
  const int w = (threadIdx.x >> 5) - w0;
  if (w < 0 || w > 1) return;
  float d[4] = {};
  mma_frag<kD, true>(d, 8 * w, fa, [&](int k, int n) { return fb(n, k); });
  frag_each(d, 8 * w, [&](int i, int j, float x) { W[i][j] = (strict ? j < i : j <= i) ? sign * x : 0.f; });
}

// Rank-16 update of a [128][kLD] matrix in place: X[v][c] = X[v][c]·gC[c] + Σ_t Σ_p a(p, t, v)·b(p, t, c),
// p < P, on tensor cores; warp w owns rows [16 (w/2), +16) and columns [64 (w%2), +64) (8 fragments).
template <int P, typename FA, typename FB>
__device__ __forceinline__ void rank_update(float* X, const float* gC, FA fa, FB fb) {
  const int m0 = (threadIdx.x >> 6) * 16, c0 = ((threadIdx.x >> 5) & 1) * 64;
  float d[8][4];
  {
    const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int c = c0 + 8 * nt + 2 * q;
      const float* x0 = X + (m0 + g) * kLD + c;
      const float* x1 = x0 + 8 * kLD;
      d[nt][0] = x0[0] * gC[c];
      d[nt][1] = x0[1] * gC[c + 1];
      d[nt][2] = x1[0] * gC[c];
      d[nt][3] = x1[1] * gC[c + 1];
    }
#pragma unroll
    for (int p = 0; p < P; ++p)
#pragma unroll
      for (int k0 = 0; k0 < kC; k0 += 8) {
        const uint32_t a[4] = {tf32(fa(p, k0 + q, m0 + g)), tf32(fa(p, k0 + q, m0 + g + 8)),
                               tf32(fa(p, k0 + q + 4, m0 + g)), tf32(fa(p, k0 + q + 4, m0 + g + 8))};
#pragma unroll
        for (int nt = 0; nt < 8; ++nt)
          mma_tf32(d[nt], a, tf32(fb(p, k0 + q, c0 + 8 * nt + g)), tf32(fb(p, k0 + q + 4, c0 + 8 * nt + g)));
      }
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int c = c0 + 8 * nt + 2 * q;
      float* x0 = X + (m0 + g) * kLD + c;
      float* x1 = x0 + 8 * kLD;
      x0[0] = d[nt][0];
      x0[1] = d[nt][1];
      x1[0] = d[nt][2];
      x1[1] = d[nt][3];
    }
  }
}

// [dim][dim] compact global -> [128][kLD] shared, asynchronous (cp.async, 16 bytes per copy, no registers):
// each thread's copies are complete after its cp_async_wait<0>(), visible to the CTA after a barrier behind
// it. dim < 128 (the padded K = V = 64 call's tapes and initial state, p.state_dim): the leading block, zeros
// elsewhere. A null src writes zeros (plain stores, visible after the same barrier). kGlobalState: dst is the
// CTA's global scratch, plain 16-byte loads and stores (visible to the CTA after the same barrier).
template <bool kGlobalState = false>
__device__ __forceinline__ void load_state(float* dst, const float* src, int dim = kD) {
  if (src == nullptr) {
    for (int i = threadIdx.x; i < kD * kLD / 4; i += kThreads) st4(dst + 4 * i, make_float4(0.f, 0.f, 0.f, 0.f));
    return;
  }
  if (dim != kD) {  // (zeros outside the leading block: plain stores, as a null src)
    for (int i = threadIdx.x; i < kD * kD / 4; i += kThreads) {
      const int v = i >> 5, c = (i & 31) * 4;
      if (v >= dim || c >= dim) st4(dst + v * kLD + c, make_float4(0.f, 0.f, 0.f, 0.f));
    }
  }
  if constexpr (kGlobalState) {
    for (int i = threadIdx.x; i < kD * kD / 4; i += kThreads) {
      const int v = i >> 5, c = (i & 31) * 4;
      if (v < dim && c < dim) st4(dst + v * kLD + c, ld4(src + v * dim + c));
    }
  } else {
#pragma unroll
    for (int i = threadIdx.x; i < kD * kD / 4; i += kThreads) {
      const int v = i >> 5, c = (i & 31) * 4;
      if (v < dim && c < dim)
        cute::SM80_CP_ASYNC_CACHEGLOBAL<cute::uint128_t>::copy(
            *reinterpret_cast<const cute::uint128_t*>(src + v * dim + c),
            *reinterpret_cast<cute::uint128_t*>(dst + v * kLD + c));
    }
    cute::cp_async_fence();
  }
}

// Four consecutive bf16 (8 bytes, aligned: the host passes token tensors with 16-byte bases and strides that
// are multiples of 8 elements) as floats; bf16 -> fp32 is exact (the high half of the word).
__device__ __forceinline__ void ld_bf16x4(const void* base, int64_t off, float (&x)[4]) {
  const uint2 r = *reinterpret_cast<const uint2*>(static_cast<const __nv_bfloat16*>(base) + off);
  x[0] = __uint_as_float(r.x << 16);
  x[1] = __uint_as_float(r.x & 0xffff0000u);
  x[2] = __uint_as_float(r.y << 16);
  x[3] = __uint_as_float(r.y & 0xffff0000u);
}

struct Task {
  SeqRange s;
  int hv, hq;
  float A;  // exp(A_log[hv])
};

// Pulls a [dim][dim] fp32 state (64 KB at dim 128: 512 lines of 128 bytes) into L2: one prefetch per thread.
__device__ __forceinline__ void prefetch_state_l2(const float* src, int dim = kD) {
  if (threadIdx.x * 32 < dim * dim) ptx::prefetch_l2(src + threadIdx.x * 32);
}

// Pulls the token rows a later sub-chunk step loads (k, q, v, dO, g of tokens [t0, t0 + len)) into L2 while the
// current step computes: 16 tokens x 5 rows x 2 lines of 128 bytes, one prefetch per thread.
__device__ __forceinline__ void prefetch_sub_chunk(const TrainingBackwardParams& p, const Task& tk, int64_t t0,
                                                   int len) {
  const int i = threadIdx.x;
  if (i >= kC * 10 || i / 10 >= len) return;
  const int64_t tok = t0 + i / 10;
  const int r = (i % 10) >> 1;
  const TokenTensor& tt = r == 0 ? p.k : (r == 1 ? p.q : (r == 2 ? p.v : (r == 3 ? p.dout : p.g)));
  const int head = r < 2 ? tk.hq : tk.hv;
  const auto* row = tt.row<__nv_bfloat16>(tk.s.batch, tok, head) + 64 * (i & 1);
  ptx::prefetch_l2(row);
}

// Loads the tokens [t0, t0 + len) of the sub-chunk (zeros beyond len) and forms E, Ei, gC, β,
// then L, Mqk, INV, K⁺, Kr, V - X = V - K⁺ Sᵀ and R. Ends synchronised. Returns whether the sub-chunk is wide:
// kUnbounded (softplus / precomputed gates) only, when some |Γ_t| of the sub-chunk exceeds kNarrowSpan (or is
// NaN); then Ei holds the log-decay a (0 past len) instead of e^{-Γ}, and L, Mqk come from pairwise exponents
// (see the file comment). Narrow sub-chunks of those gates take the lower-bound gate's factorised form, whose
// factors then stay within the same e^{40} (every |Γ_i - Γ_j| <= 40).
// S: the state entering the sub-chunk ([128][kLD], global memory if kGlobalState).
template <bool kUnbounded, bool kGlobalState>
__device__ auto sub_chunk_forward(ChunkedBwdSmem& sm, const TrainingBackwardParams& p, const Task& tk, int64_t t0,
                                  int len, float dtb_col, const float* S) {
  [[maybe_unused]] bool wide = false;  // (kUnbounded only; the lower-bound instantiation returns nothing)
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int tl = warp; tl < kC; tl += kThreads / 32) {
    float kx[4], qx[4], vv[4], dd[4];
    if (tl < len) {
      const int64_t tok = t0 + tl;
      const int64_t ko = p.k.offset(tk.s.batch, tok, tk.hq) + 4 * lane;
      const int64_t qo = p.q.offset(tk.s.batch, tok, tk.hq) + 4 * lane;
      const int64_t vo = p.v.offset(tk.s.batch, tok, tk.hv) + 4 * lane;
      const int64_t oo = p.dout.offset(tk.s.batch, tok, tk.hv) + 4 * lane;
      float sk = 0.f, sq = 0.f;
      ld_bf16x4(p.k.ptr, ko, kx);
      ld_bf16x4(p.q.ptr, qo, qx);
      ld_bf16x4(p.v.ptr, vo, vv);
      ld_bf16x4(p.dout.ptr, oo, dd);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        sk = fmaf(kx[e], kx[e], sk);
        sq = fmaf(qx[e], qx[e], sq);
      }
      // (without the L2 norm: ρ = 1, and the q, k rows are used as given)
      const float rk = p.use_qk_l2norm ? rsqrtf(warp_sum32(sk) + kL2NormEps) : 1.f;
      const float r0 = p.use_qk_l2norm ? rsqrtf(warp_sum32(sq) + kL2NormEps) : 1.f;
      const float rq = r0 * p.scale;
      if (lane == 0) sm.rho_q[tl] = r0, sm.rho_k[tl] = rk;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        kx[e] *= rk;
        qx[e] *= rq;
      }
      if (lane == 0) {
        const float bx = ld_bf16(p.beta.ptr, p.beta.offset(tk.s.batch, tok, tk.hv));
        sm.beta[tl] = p.beta_is_logit ? sigmoidf_(bx) : bx;
      }
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e) kx[e] = qx[e] = vv[e] = dd[e] = 0.f;
      if (lane == 0) sm.beta[tl] = 0.f;
    }
    const int o = tl * kLD + 4 * lane;
    st4(sm.kn + o, make_float4(kx[0], kx[1], kx[2], kx[3]));
    st4(sm.qs + o, make_float4(qx[0], qx[1], qx[2], qx[3]));
    st4(sm.vx + o, make_float4(vv[0], vv[1], vv[2], vv[3]));
    st4(sm.dO + o, make_float4(dd[0], dd[1], dd[2], dd[3]));
  }
  if constexpr (kUnbounded) {
    // Γ = inclusive prefix of the unbounded log-decay a over the sub-chunk (a = 0 past len), this thread's
    // channel tid / 4, tokens [4 (tid % 4), +4), as below; E = e^{Γ} <= 1; wide: Ei = a, and Kr's factor
    // e^{Γ_last - Γ_t} = e^{Σ_{u > t} a_u} <= 1 (suffix sums) into kr, multiplied by k̂ after the barrier;
    // narrow: Ei = e^{-Γ} <= e^{40}, as the lower-bound gate.
    const int c = threadIdx.x >> 2, part = threadIdx.x & 3;
    const bool softplus = p.gate_mode == GateMode::kSoftplus;
    float av[4], gam[4], run = 0.f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // the loads go out first
      const int t = 4 * part + u;
      av[u] = t < len ? ld_bf16(p.g.ptr, p.g.offset(tk.s.batch, t0 + t, tk.hv) + c) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      av[u] = 4 * part + u < len ? unbounded_log_decay(softplus, av[u] + dtb_col, tk.A) : 0.f;
      run += av[u];
      gam[u] = run;
    }
    const float t0s = __shfl_sync(0xffffffffu, run, 0, 4), t1s = __shfl_sync(0xffffffffu, run, 1, 4);
    const float t2s = __shfl_sync(0xffffffffu, run, 2, 4), t3s = __shfl_sync(0xffffffffu, run, 3, 4);
    const float off = part == 0 ? 0.f : (part == 1 ? t0s : (part == 2 ? t0s + t1s : (t0s + t1s) + t2s));
    const float later = part == 3 ? 0.f : (part == 2 ? t3s : (part == 1 ? t3s + t2s : (t3s + t2s) + t1s));
    const float sfx[4] = {((av[3] + av[2]) + av[1]) + later, (av[3] + av[2]) + later, av[3] + later, later};
    bool w = false;
#pragma unroll
    for (int u = 0; u < 4; ++u) w = w || !(fabsf(gam[u] + off) <= kNarrowSpan);  // (NaN counts as wide)
    wide = __syncthreads_or(w);                                                  // (every thread of the CTA is here)
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int o = (4 * part + u) * kLD + c;
      sm.E[o] = __expf(gam[u] + off);
      if (wide) {
        sm.Ei[o] = av[u];
        sm.kr[o] = __expf(sfx[u]);
      } else {
        sm.Ei[o] = __expf(-(gam[u] + off));
      }
    }
    if (part == 3) sm.gC[c] = __expf(gam[3] + off);
  } else {  // Γ = inclusive prefix of the log-decay a = λ σ(A (g + dt_bias)) over the sub-chunk (a = 0 past len),
    // from gate loads of this thread's own (channel tid / 4, tokens [4 (tid % 4), +4)): no barrier before the prefix
    const int c = threadIdx.x >> 2, part = threadIdx.x & 3;
    float gam[4], run = 0.f;
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // the loads go out first
      const int t = 4 * part + u;
      gam[u] = t < len ? ld_bf16(p.g.ptr, p.g.offset(tk.s.batch, t0 + t, tk.hv) + c) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      run += 4 * part + u < len ? p.lower_bound * sigmoidf_(tk.A * (gam[u] + dtb_col)) : 0.f;
      gam[u] = run;
    }
    const float t0s = __shfl_sync(0xffffffffu, run, 0, 4), t1s = __shfl_sync(0xffffffffu, run, 1, 4);
    const float t2s = __shfl_sync(0xffffffffu, run, 2, 4);
    const float off = part == 0 ? 0.f : (part == 1 ? t0s : (part == 2 ? t0s + t1s : (t0s + t1s) + t2s));
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const float gm = gam[u] + off;
      sm.E[(4 * part + u) * kLD + c] = __expf(gm);
      sm.Ei[(4 * part + u) * kLD + c] = __expf(-gm);
    }
    if (part == 3) sm.gC[c] = __expf(gam[3] + off);
  }
  // This thread's cp.async copies of S and dS (issued by the caller) are done, after the token loads above
  // had them in flight (the small sweep's plain copies are done already); the barrier publishes every
  // thread's before any use.
  cute::cp_async_wait<0>();
  __syncthreads();
  if (kUnbounded && wide) {
    // L and Mqk from exact pairwise exponents on CUDA cores: warp j, column j; lane: channels [4 lane, +4);
    // rows i >= j with the exponent Γ_i - Γ_j = Σ_{j < u <= i} a_u summed upward from token j (every factor
    // <= 1), the 16 partial rows then summed over the lanes (pair_column_store); masked pairs are never formed.
    const int j = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = 4 * lane;
    const float4 kj = ld4(sm.kn + j * kLD + c0);
    float vl[kC], vm[kC], ex[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      vl[i] = vm[i] = 0.f;
      if (i >= j) {  // (warp-uniform)
        const float4 ki = ld4(sm.kn + i * kLD + c0), qi = ld4(sm.qs + i * kLD + c0);
        if (i > j) {
          const float4 ai = ld4(sm.Ei + i * kLD + c0);
          ex[0] += ai.x, ex[1] += ai.y, ex[2] += ai.z, ex[3] += ai.w;
        }
        const float4 w =
            make_float4(kj.x * __expf(ex[0]), kj.y * __expf(ex[1]), kj.z * __expf(ex[2]), kj.w * __expf(ex[3]));
        vl[i] = dot4(ki, w, 0.f);
        vm[i] = dot4(qi, w, 0.f);
      }
    }
    pair_column_store(vl, lane, [&](int i, float x) { sm.L[i][j] = i > j ? x : 0.f; });
    pair_column_store(vm, lane, [&](int i, float x) { sm.M[i][j] = i >= j ? x : 0.f; });
  } else {
    // L and Mqk on tensor cores with the mid-token reference: e^{Γ_i - Γ_j} = P_i N_j, P = e^{Γ - Γ_mid}
    // (E · Ei_mid), N = e^{Γ_mid - Γ} (E_mid · Ei); every factor <= e^{8|λ|} = e^{40} (λ >= -5).
    const auto colop = [&](int j, int c) { return sm.kn[j * kLD + c] * (sm.E[kMid * kLD + c] * sm.Ei[j * kLD + c]); };
    gemm_tri(
        sm.L, 0, [&](int i, int c) { return sm.kn[i * kLD + c] * (sm.E[i * kLD + c] * sm.Ei[kMid * kLD + c]); }, colop,
        true, 1.f);
    gemm_tri(
        sm.M, 2, [&](int i, int c) { return sm.qs[i * kLD + c] * (sm.E[i * kLD + c] * sm.Ei[kMid * kLD + c]); }, colop,
        false, 1.f);
  }
  // K⁺ and Kr
  for (int idx = threadIdx.x; idx < kC * kD; idx += kThreads) {
    const int t = idx >> 7, c = idx & 127, o = t * kLD + c;
    sm.kp[o] = sm.kn[o] * sm.E[o];
    if (kUnbounded && wide)
      sm.kr[o] = sm.kn[o] * sm.kr[o];  // (kr: e^{Γ_last - Γ}, from the gate prefix)
    else
      sm.kr[o] = sm.kn[o] * (sm.gC[c] * sm.Ei[o]);
  }
  __syncthreads();         // L, K⁺ and Kr are complete
  if (threadIdx.x < kC) {  // INV column j by forward substitution
    const int j = threadIdx.x;
    float x[kC];
#pragma unroll
    for (int i = 0; i < kC; ++i) {
      float s = 0.f;
#pragma unroll
      for (int m = 0; m < i; ++m) s = fmaf(sm.L[i][m], x[m], s);
      x[i] = i < j ? 0.f : (i == j ? 1.f : -sm.beta[i] * s);
    }
#pragma unroll
    for (int i = 0; i < kC; ++i) sm.INV[i][j] = x[i];
  }
  gemm_abt<kGlobalState, true>(sm.vx, sm.kp, S, -1.f, true);  // V - X (3xTF32: dβ, see mma_rows)
  __syncthreads();
  gemm_small<false>(sm.R, sm.INV, sm.beta, sm.vx);  // R = INV diag(β) (V - X)
  __syncthreads();
  if constexpr (kUnbounded) return wide;
}

// da's reverse cumsum over a sub-chunk, 4 lanes per channel c (lane part holds tokens 4 part .. 4 part + 3): the
// sums within the lane's own tokens into suf, and the returned offset (the later lanes' sums and sm.ext[c], what
// the later sub-chunks carried in), so that da_t = suf[t - 4 part] + offset.
__device__ __forceinline__ float reverse_cumsum4(const ChunkedBwdSmem& sm, int c, int part, float (&suf)[4]) {
  float run = 0.f;
#pragma unroll
  for (int u = 3; u >= 0; --u) {
    run += sm.kp[(4 * part + u) * kLD + c];
    suf[u] = run;
  }
  const float s1 = __shfl_sync(0xffffffffu, run, 1, 4), s2 = __shfl_sync(0xffffffffu, run, 2, 4);
  const float s3 = __shfl_sync(0xffffffffu, run, 3, 4);
  return sm.ext[c] + (part == 3 ? 0.f : (part == 2 ? s3 : (part == 1 ? s3 + s2 : (s3 + s2) + s1)));
}

// The pair terms on tensor cores (mid-token reference, as L and Mqk), then dq, dk, dΓ per element: the factorised
// form of the lower-bound gate and of the unbounded gates' narrow sub-chunks.
__device__ __forceinline__ void pair_terms_mid(ChunkedBwdSmem& sm, const TrainingBackwardParams& p, const Task& tk,
                                               int64_t t0, int len) {
  const int tid = threadIdx.x;
  const int n0 = (tid >> 5) * 8;
  const auto P = [&](int i, int c) { return sm.E[i * kLD + c] * sm.Ei[kMid * kLD + c]; };
  const auto N = [&](int j, int c) { return sm.E[kMid * kLD + c] * sm.Ei[j * kLD + c]; };
  float rm[4] = {}, rl[4] = {}, cl[4] = {};
  const auto kN = [&](int j, int c) { return sm.kn[j * kLD + c] * N(j, c); };
  mma_frag<kC, true>(rm, n0, [&](int t, int j) { return sm.dM[t][j]; }, kN);               // Σ_j dM_tj k_j N_j
  mma_frag<kC, true>(rl, n0, [&](int t, int j) { return sm.beta[t] * sm.dA[t][j]; }, kN);  // Σ_j dL_tj k_j N_j
  mma_frag<kC, true>(
      cl, n0, [&](int t, int i) { return sm.dM[i][t]; },
      [&](int i, int c) { return sm.qs[i * kLD + c] * P(i, c); });  // Σ_i dM_it q_i P_i
  mma_frag<kC, true>(
      cl, n0, [&](int t, int i) { return sm.beta[i] * sm.dA[i][t]; },
      [&](int i, int c) { return sm.kn[i * kLD + c] * P(i, c); });  // Σ_i dL_it k_i P_i
  const int lane = tid & 31, g = lane >> 2, q = lane & 3;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int t = g + 8 * (e >> 1), cc = n0 + 2 * q + (e & 1), o = t * kLD + cc;
    const float ev = sm.E[o], ei = sm.Ei[o];
    const float dq = fmaf(sm.kp[o], ev, P(t, cc) * rm[e]);
    const float dk_row = fmaf(sm.vx[o], ev, P(t, cc) * rl[e]);
    const float dk_col = fmaf(sm.dr[o], sm.gC[cc] * ei, N(t, cc) * cl[e]);
    if (p.fused_qk) {  // dL/dq̂, dL/dk̂ for the L2-norm backward below (dO is dead, vx: own elements)
      sm.dO[o] = dq * p.scale;
      sm.vx[o] = dk_row + dk_col;
    } else if (t < len) {
      const int64_t ho = ((tk.s.batch * p.T + t0 + t) * p.HV + tk.hv) * kD + cc;
      p.dq_head[ho] = dq * p.scale;
      p.dk_head[ho] = dk_row + dk_col;
    }
    sm.kp[o] = fmaf(sm.qs[o], dq, sm.kn[o] * (dk_row - dk_col));  // dΓ over dQ⁺ (own element)
  }
}

// The state entering the 64-token chunk of task `task` (slot task / HV, value head task % HV): see tape_state;
// null for zeros or an unused slot.
__device__ __forceinline__ const float* task_state(const TrainingBackwardParams& p, int64_t task) {
  const int64_t slot = task / p.HV;
  const int64_t n = slot_sequence(p.slot_cu_starts, p.N, slot);
  return n < 0 ? nullptr : tape_state(p, n, slot - p.slot_cu_starts[n], static_cast<int>(task % p.HV));
}

// One CTA per (slot, value head) task, persistent: the gradients of the 64 tokens of one 64-token chunk from
// the state entering it, S_0 (initial_state for a sequence's first chunk, a tape row otherwise), and the chain
// gradient at its end dS_C (p.dstates, written by the backward chain).
// kUnbounded: the softplus and precomputed gates (p.gate_mode), pairwise exponents; else the lower-bound gate.
// kGlobalState: the small sweep, S and dS in the CTA's rows of p.sweep_state (see kStateFloats).
template <bool kUnbounded, bool kGlobalState>
__global__ void __launch_bounds__(kThreads, 1) kda_training_backward_chunked_kernel(const TrainingBackwardParams p) {
  extern __shared__ float4 smem_raw[];
  float* const S =
      kGlobalState ? p.sweep_state + int64_t(blockIdx.x) * 2 * kStateFloats : reinterpret_cast<float*>(smem_raw);
  float* const dS = S + kStateFloats;
  ChunkedBwdSmem& sm =
      *reinterpret_cast<ChunkedBwdSmem*>(reinterpret_cast<float*>(smem_raw) + (kGlobalState ? 0 : 2 * kStateFloats));
  const int tid = threadIdx.x;
  const int64_t tasks = p.n_slots * p.HV;
  const int group = p.HV / p.H;
  constexpr int64_t kState = int64_t(kD) * kD;

  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int64_t slot = task / p.HV;
    const int64_t n = slot_sequence(p.slot_cu_starts, p.N, slot);
    Task tk;
    tk.hv = static_cast<int>(task % p.HV);
    const int64_t c = n < 0 ? -1 : slot - p.slot_cu_starts[n];  // the 64-token chunk within the sequence
    if (n >= 0) tk.s = seq_range(p.cu_seqlens, p.cu_seqlens_int64, p.T, n);
    if (n < 0 || c < 0 || c * kTapeChunk >= tk.s.len) {
      // an unused slot (or a broken slot_cu_starts): zero partials, the finishing kernel sums every row
      __syncthreads();  // (the partial stores of the previous task are done with sm.part)
      if (tid < kD) p.ddt_partial[task * kD + tid] = 0.f;
      if (tid == 0) p.dA_partial[task] = 0.f;
      continue;
    }
    tk.hq = tk.hv / group;
    if constexpr (kUnbounded)
      tk.A = p.A_log != nullptr ? __expf(p.A_log[tk.hv]) : 0.f;  // (none with the precomputed gate)
    else
      tk.A = __expf(p.A_log[tk.hv]);
    // Gate chain rule: thread (column tid / 4, tokens [4 (tid % 4), +4) of each sub-chunk), fixed order.
    const float dtb_col = p.dt_bias != nullptr ? p.dt_bias[tk.hv * kD + (tid >> 2)] : 0.f;
    float ddt_acc = 0.f, dA_acc = 0.f;

    __syncthreads();                                                       // the previous task is done with S and dS
    load_state<kGlobalState>(S, tape_state(p, n, c, tk.hv), p.state_dim);  // null: zeros
    {
      const int64_t tc0 = tk.s.bos + c * kTapeChunk;
      const int clen =
          static_cast<int>(tk.s.len - c * kTapeChunk < kTapeChunk ? tk.s.len - c * kTapeChunk : kTapeChunk);
      const int nsub = (clen + kC - 1) / kC;
      // dS_C row of sub-chunk sb (a broken dstate_cu_starts reads nothing out of bounds: null = zeros)
      const int64_t drow0 = p.dstate_cu_starts[n] + c * kSubPerTape;
      const auto dstate = [&](int sb) -> const float* {
        const int64_t r = drow0 + sb;
        return r >= 0 && r < p.n_dstate_rows ? p.dstates + (r * p.HV + tk.hv) * kState : nullptr;
      };
      // Forward over the sub-chunks: S is the state entering sub-chunk sb (updated at the end of each step),
      // dS the chain gradient leaving it (from the backward chain). dS of sub-chunk sb + 1 is copied in while
      // step sb finishes (from the barrier after its last read of dS).
      load_state<kGlobalState>(dS, dstate(0));
      for (int sb = 0; sb < nsub; ++sb) {
        const int len = clen - sb * kC < kC ? clen - sb * kC : kC;
        const int64_t t0 = tc0 + sb * kC;
        if (sb + 1 < nsub) {
          prefetch_sub_chunk(p, tk, t0 + kC, clen - (sb + 1) * kC < kC ? clen - (sb + 1) * kC : kC);
          if (const float* nd = dstate(sb + 1)) prefetch_state_l2(nd);
        } else if (task + gridDim.x < tasks) {  // this CTA's next task: the state entering its chunk
          if (const float* ns = task_state(p, task + gridDim.x)) prefetch_state_l2(ns, p.state_dim);
        }
        bool wide = false;  // (the lower-bound gate: always the factorised form)
        if constexpr (kUnbounded)
          wide = sub_chunk_forward<true, kGlobalState>(sm, p, tk, t0, len, dtb_col, S);
        else
          sub_chunk_forward<false, kGlobalState>(sm, p, tk, t0, len, dtb_col, S);
        // dR = Mqkᵀ dO + Kr dSᵀ; dY = INVᵀ dR (into kp)
        // Column-local: a warp reads back only the dR columns it wrote (frag_each and mma_frag's B operand
        // use the same columns), so a warp barrier orders these three products.
        gemm_small<true, true>(sm.dr, sm.M, nullptr, sm.dO);  // (3xTF32 for these three and V - X: dβ)
        gemm_abt<kGlobalState, true>(sm.dr, sm.kr, dS, 1.f, true);
        __syncwarp();
        gemm_small<true, true>(sm.kp, sm.INV, nullptr, sm.dr);
        __syncthreads();
        const auto row_of = [&](const float* X) { return [X](int i, int c) { return X[i * kLD + c]; }; };
        gemm_tri(sm.dA, 0, row_of(sm.kp), row_of(sm.R), true, -1.f);  // dA = -stril(dY Rᵀ)
        gemm_tri(sm.dM, 2, row_of(sm.dO), row_of(sm.R), false, 1.f);  // dMqk = tril(dO Rᵀ)
        {  // the S_0 decay term of dΓ_last, g_C ⊙ colsum(dS_C ⊙ S_0): four partial sums of 32 rows
          const int c = tid & 127, v0 = (tid >> 7) * 32;
          float s[4] = {0.f, 0.f, 0.f, 0.f};  // independent chains (fixed order: deterministic)
#pragma unroll
          for (int v = 0; v < 32; v += 4)
#pragma unroll
            for (int u = 0; u < 4; ++u) s[u] = fmaf(dS[(v0 + v + u) * kLD + c], S[(v0 + v + u) * kLD + c], s[u]);
          sm.part[tid >> 7][c] = (s[0] + s[1]) + (s[2] + s[3]);
        }
        __syncthreads();
        if (tid < kD)
          sm.ext[tid] = sm.gC[tid] * ((sm.part[0][tid] + sm.part[1][tid]) + (sm.part[2][tid] + sm.part[3][tid]));
        {  // dβ and dv; warp w: token w
          const int warp = tid >> 5, lane = tid & 31;
          for (int t = warp; t < warp + 1; ++t) {
            const float4 dy = ld4(sm.kp + t * kLD + 4 * lane), vx = ld4(sm.vx + t * kLD + 4 * lane);
            float s = dot4(dy, vx, 0.f);
            if (lane < kC) s = fmaf(sm.dA[t][lane], sm.L[t][lane], s);
            s = warp_sum32(s);
            if (t < len) {
              const float b = sm.beta[t];
              const int64_t ti = tk.s.batch * p.T + t0 + t;
              if (lane == 0) st_bf16(p.dbeta, ti * p.HV + tk.hv, p.beta_is_logit ? s * b * (1.f - b) : s);
              const int64_t o = (ti * p.HV + tk.hv) * kD + 4 * lane;
              st_bf16(p.dv, o + 0, b * dy.x);
              st_bf16(p.dv, o + 1, b * dy.y);
              st_bf16(p.dv, o + 2, b * dy.z);
              st_bf16(p.dv, o + 3, b * dy.w);
            }
          }
        }
        gemm_ab(sm.dr, sm.R, dS, 1.f, nullptr);  // dKr = R dS_C (dR is dead)
        __syncthreads();                         // everyone is done with vx (dβ) and with dS
        if (sb + 1 < nsub) load_state<kGlobalState>(dS, dstate(sb + 1));
        {  // dK⁺ = -β dY S_0 (into vx) and dQ⁺ = dO S_0 (into kp once dY is dead; dO is bf16: exact in tf32)
          const int n0 = (tid >> 5) * 8;
          float dkp[4] = {}, dqp[4] = {};
          mma_rows_pair(dkp, dqp, n0, sm.kp, sm.dO, S);
          if (tid < kD) {
            float s = 0.f;
            for (int t = 0; t < kC; ++t) s = fmaf(sm.kr[t * kLD + tid], sm.dr[t * kLD + tid], s);
            sm.ext[tid] += s;
          }
          __syncthreads();  // every warp is done reading dY
          frag_each(dkp, n0, [&](int t, int c, float x) { sm.vx[t * kLD + c] = -sm.beta[t] * x; });
          frag_each(dqp, n0, [&](int t, int c, float x) { sm.kp[t * kLD + c] = x; });
        }
        __syncthreads();  // every product with S_0 is done; dO is dead (the fused dq̂ goes there)
        // the state entering the next sub-chunk: S = S g_C + Rᵀ Kr
        if (sb + 1 < nsub)
          rank_update<1>(
              S, sm.gC, [&](int, int t, int v) { return sm.R[t * kLD + v]; },
              [&](int, int t, int c) { return sm.kr[t * kLD + c]; });
        if constexpr (kUnbounded) {
          if (wide) {
            // pair terms from exact pairwise exponents on CUDA cores (warp t: row t; lane: channels [4 lane, +4)):
            // rm = Σ_{j<=t} dM_tj k_j e^{Γ_t - Γ_j}, rl = Σ_{j<t} β_t dA_tj k_j e^{Γ_t - Γ_j} with the exponent summed
            // downward from t, cl = Σ_{i>=t} (dM_it q_i + β_i dA_it k_i) e^{Γ_i - Γ_t} summed upward (every factor
            // <= 1); then dq, dk, dΓ per element as below, with Kr's factor e^{Γ_last - Γ_t} from the upward sum.
            const int t = tid >> 5, lane = tid & 31, c0 = 4 * lane;
            float rm[4] = {0.f, 0.f, 0.f, 0.f}, rl[4] = {0.f, 0.f, 0.f, 0.f}, cl[4] = {0.f, 0.f, 0.f, 0.f};
            float ex[4] = {0.f, 0.f, 0.f, 0.f};
            const float bt = sm.beta[t];
            for (int j = t; j >= 0; --j) {
              const float4 kj4 = ld4(sm.kn + j * kLD + c0), aj4 = ld4(sm.Ei + j * kLD + c0);
              const float kj[4] = {kj4.x, kj4.y, kj4.z, kj4.w}, aj[4] = {aj4.x, aj4.y, aj4.z, aj4.w};
              const float wm = sm.dM[t][j], wl = bt * sm.dA[t][j];
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float w = __expf(ex[e]) * kj[e];
                rm[e] = fmaf(wm, w, rm[e]);
                rl[e] = fmaf(wl, w, rl[e]);
                ex[e] += aj[e];
              }
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) ex[e] = 0.f;
            for (int i = t; i < kC; ++i) {
              const float4 ki4 = ld4(sm.kn + i * kLD + c0), qi4 = ld4(sm.qs + i * kLD + c0);
              if (i > t) {
                const float4 ai = ld4(sm.Ei + i * kLD + c0);
                ex[0] += ai.x, ex[1] += ai.y, ex[2] += ai.z, ex[3] += ai.w;
              }
              const float ki[4] = {ki4.x, ki4.y, ki4.z, ki4.w}, qi[4] = {qi4.x, qi4.y, qi4.z, qi4.w};
              const float wm = sm.dM[i][t], wl = sm.beta[i] * sm.dA[i][t];
#pragma unroll
              for (int e = 0; e < 4; ++e) {
                const float x = __expf(ex[e]);
                cl[e] = fmaf(wm, qi[e] * x, fmaf(wl, ki[e] * x, cl[e]));
              }
            }
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // (ex = Γ_last - Γ_t: a = 0 past len)
              const int cc = c0 + e, o = t * kLD + cc;
              const float ev = sm.E[o];
              const float dq = fmaf(sm.kp[o], ev, rm[e]);
              const float dk_row = fmaf(sm.vx[o], ev, rl[e]);
              const float dk_col = fmaf(sm.dr[o], __expf(ex[e]), cl[e]);
              if (p.fused_qk) {  // dL/dq̂, dL/dk̂ for the L2-norm backward below (dO is dead, vx: own elements)
                sm.dO[o] = dq * p.scale;
                sm.vx[o] = dk_row + dk_col;
              } else if (t < len) {
                const int64_t ho = ((tk.s.batch * p.T + t0 + t) * p.HV + tk.hv) * kD + cc;
                p.dq_head[ho] = dq * p.scale;
                p.dk_head[ho] = dk_row + dk_col;
              }
              sm.kp[o] = fmaf(sm.qs[o], dq, sm.kn[o] * (dk_row - dk_col));  // dΓ over dQ⁺ (own element)
            }
          } else {
            pair_terms_mid(sm, p, tk, t0, len);
          }
        } else {
          pair_terms_mid(sm, p, tk, t0, len);
        }
        __syncthreads();
        if (p.fused_qk) {  // no GQA group: the L2-norm backward here, dx = ρ (dx̂ - (x̂·dx̂) x̂); warp w: token w
          const int w = tid >> 5, lane = tid & 31;
          if (w < len) {
            const int o = w * kLD + 4 * lane;
            const float4 dqh = ld4(sm.dO + o), dkh = ld4(sm.vx + o), kh = ld4(sm.kn + o), qs4 = ld4(sm.qs + o);
            const float is = 1.f / p.scale;
            const float4 qh = make_float4(qs4.x * is, qs4.y * is, qs4.z * is, qs4.w * is);
            // without the L2 norm (ρ = 1): dx = dx̂, no projection
            const float dotq = p.use_qk_l2norm ? warp_sum32(dot4(qh, dqh, 0.f)) : 0.f;
            const float dotk = p.use_qk_l2norm ? warp_sum32(dot4(kh, dkh, 0.f)) : 0.f;
            const float rq = sm.rho_q[w], rk = sm.rho_k[w];
            const int64_t oo = ((tk.s.batch * p.T + t0 + w) * p.H + tk.hq) * kD + 4 * lane;
            const __nv_bfloat162 q01 = __floats2bfloat162_rn(rq * (dqh.x - dotq * qh.x), rq * (dqh.y - dotq * qh.y));
            const __nv_bfloat162 q23 = __floats2bfloat162_rn(rq * (dqh.z - dotq * qh.z), rq * (dqh.w - dotq * qh.w));
            const __nv_bfloat162 k01 = __floats2bfloat162_rn(rk * (dkh.x - dotk * kh.x), rk * (dkh.y - dotk * kh.y));
            const __nv_bfloat162 k23 = __floats2bfloat162_rn(rk * (dkh.z - dotk * kh.z), rk * (dkh.w - dotk * kh.w));
            *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.dq) + oo) =
                make_uint2(*reinterpret_cast<const uint32_t*>(&q01), *reinterpret_cast<const uint32_t*>(&q23));
            *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.dk) + oo) =
                make_uint2(*reinterpret_cast<const uint32_t*>(&k01), *reinterpret_cast<const uint32_t*>(&k23));
          }
        }
        if constexpr (kUnbounded) {
          // da = reverse cumsum of dΓ as below; softplus: a = -A softplus(x), x = g + dt_bias, dg = -A σ(x) da,
          // dA_log += da a, ddt += dg; precomputed: a = g, dg = da (no parameters).
          // Every quantity a_t enters (E_i for i >= t, Kr_i for i < t, g_C, the pairs i >= t > j) is an exponential
          // holding the factor e^{a_t}, so the exact da_t = e^{a_t} X_t, X_t a sum of the same terms with factors
          // <= 1. The reverse cumsum forms da_t from terms of X's scale that cancel, leaving a rounding residue of
          // ~2^-24 times that scale (which dA_log += da a then multiplies by |a|); below kNegligibleDecay
          // e^{a_t} < 2^-24, the exact da_t is smaller than that residue, and 0 is the closer value.
          const int c = tid >> 2, part = tid & 3;
          const bool softplus = p.gate_mode == GateMode::kSoftplus;
          float xt[4], suf[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {  // the gate loads go out first
            const int t = 4 * part + u;
            xt[u] = t < len ? ld_bf16(p.g.ptr, p.g.offset(tk.s.batch, t0 + t, tk.hv) + c) + dtb_col : 0.f;
          }
          const float off = reverse_cumsum4(sm, c, part, suf);
#pragma unroll
          for (int u = 3; u >= 0; --u) {
            const int t = 4 * part + u;
            if (t < len) {
              const float a = unbounded_log_decay(softplus, xt[u], tk.A);
              const float da = a < kNegligibleDecay ? 0.f : suf[u] + off;
              float dgv = da;
              if (softplus) {
                dgv = -tk.A * sigmoidf_(xt[u]) * da;
                ddt_acc += dgv;
                dA_acc = fmaf(da, a, dA_acc);
              }
              st_bf16(p.dg, ((tk.s.batch * p.T + t0 + t) * p.HV + tk.hv) * kD + c, dgv);
            }
          }
        } else {  // da = reverse cumsum of dΓ (4 lanes per channel, 4 tokens each); a = λ σ(z), z = A (g + dt_bias)
          const int c = tid >> 2, part = tid & 3;
          float zt[4], suf[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {  // the gate loads go out first
            const int t = 4 * part + u;
            zt[u] = t < len ? tk.A * (ld_bf16(p.g.ptr, p.g.offset(tk.s.batch, t0 + t, tk.hv) + c) + dtb_col) : 0.f;
          }
          const float off = reverse_cumsum4(sm, c, part, suf);
#pragma unroll
          for (int u = 3; u >= 0; --u) {
            const int t = 4 * part + u;
            if (t < len) {
              const float z = zt[u];
              const float sg = sigmoidf_(z);
              const float dz = p.lower_bound * (suf[u] + off) * sg * (1.f - sg);
              const float dgv = tk.A * dz;
              st_bf16(p.dg, ((tk.s.batch * p.T + t0 + t) * p.HV + tk.hv) * kD + c, dgv);
              ddt_acc += dgv;
              dA_acc = fmaf(dz, z, dA_acc);
            }
          }
        }
        __syncthreads();
      }
    }

    const int64_t part = task;  // = slot * HV + hv
    __syncthreads();
    sm.part[tid & 3][tid >> 2] = ddt_acc;
    __syncthreads();
    if (tid < kD)
      p.ddt_partial[part * kD + tid] = (sm.part[0][tid] + sm.part[1][tid]) + (sm.part[2][tid] + sm.part[3][tid]);
    __syncthreads();
    sm.part[tid & 3][tid >> 2] = dA_acc;
    __syncthreads();
    if (tid == 0) {
      float a = 0.f;
      for (int k = 0; k < kD; ++k) a += (sm.part[0][k] + sm.part[1][k]) + (sm.part[2][k] + sm.part[3][k]);
      p.dA_partial[part] = a;
    }
  }
}

}  // namespace

int64_t training_backward_chunked_smem_bytes(bool small) {
  return static_cast<int64_t>(sizeof(ChunkedBwdSmem)) + (small ? 0 : 2 * kStateFloats * int64_t(sizeof(float)));
}

int64_t training_backward_sweep_state_floats() {
  return 2 * int64_t(kStateFloats);
}

cudaError_t launch_training_backward_chunked_sweep(const TrainingBackwardParams& p, cudaStream_t stream) {
  if (p.dstates == nullptr || p.dstate_cu_starts == nullptr || p.slot_cu_starts == nullptr)
    return cudaErrorInvalidValue;
  const bool small = p.sweep_state != nullptr;  // the small sweep: S and dS in the global scratch
  const int smem = static_cast<int>(training_backward_chunked_smem_bytes(small));
  // the lower-bound gate's factorised exponents, or the pairwise ones of the unbounded gates
  const bool lb = p.gate_mode == GateMode::kLowerBound;
  const auto kernel =
      small
          ? (lb ? kda_training_backward_chunked_kernel<false, true> : kda_training_backward_chunked_kernel<true, true>)
          : (lb ? kda_training_backward_chunked_kernel<false, false>
                : kda_training_backward_chunked_kernel<true, false>);
  KDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (p.n_slots * p.HV <= 0) return cudaSuccess;
  kernel<<<p.grid, kThreads, smem, stream>>>(p);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace kda
