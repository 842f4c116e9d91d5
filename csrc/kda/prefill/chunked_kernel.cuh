// Chunked ("WY form") KDA prefill on tensor cores, architecture-neutral (mma.sync m16n8k16 + ldmatrix +
// cp.async through CuTe's SM80/SM75 atoms: runs on every built arch, sm_90a and the Blackwell targets).
// SPEC §2.2; the plan and the numerics are in docs/design.md ("Chunked form", "Chunked CUDA kernel").
//
// One CTA per (sequence, value head, value-row part): NW warps, each owning 16 value rows of the head's
// state S[V, K] (K = 128) as an fp32 m16n8 accumulator (16 n-tiles x 4 = 64 registers per lane) for the
// whole sequence. The sequence is walked in chunks of C = 16 tokens; per chunk (Γ = in-chunk cumulative
// log-decay per channel, relative to the chunk start, so every e^{Γ} <= 1):
//   prep (all threads): L2 norms of q, k; gate -> log-decay a (0 on padding rows) -> Γ (fp32 prefix);
//     K⁺ = k̂ e^{Γ}, Q⁺ = q̂ scale e^{Γ} (bf16), Kr = k̂ e^{Γ_C - Γ} (fp16), γ_C = e^{Γ_C};
//     L = K⁻-form products and Mqk with RELATIVE exponents:
//       GEMM mode (every channel's in-chunk decay span Γ_0 - Γ_15 <= 80, always true for the lower-bound
//       gate with λ >= -5): reference row 7, Km = k̂ e^{Γ - Γ_7}, Qm = q̂ scale e^{Γ - Γ_7},
//       Kn = k̂ e^{Γ_7 - Γ} (every factor within e^{±80}; the products of unmasked entries are exactly
//       k̂_i k̂_j e^{Γ_i - Γ_j} <= |k|²), L = Km Knᵀ, Mqk = Qm Knᵀ by one warp each (bf16 mma);
//       pairwise mode (otherwise: unbounded softplus/precomputed gates): exact Σ_d k̂_i k̂_j e^{Γ_i - Γ_j}
//       on CUDA cores, masked pairs never exponentiated.
//     A' = diag(β) strict_tril(L); INV = (I + A')^{-1} by fp32 forward substitution (one warp, one column
//     per lane); INVb = INV diag(β) and Mqk = tril(Mqk) stored fp16.
//   chain (each warp, its 16 value rows; T = transposed, rows = value rows):
//     [Xᵀ | O_interᵀ] = S [K⁺ ; Q⁺]ᵀ    (A = bf16(S) straight from the accumulator registers)
//     Yᵀ = Vᵀ - Xᵀ;  Rᵀ = Yᵀ INVbᵀ      (fp16 operands)
//     Oᵀ = O_interᵀ + Rᵀ Mqkᵀ          -> staged in shared memory, 16-byte stores
//     S  = S ⊙ γ_C + Rᵀ Kr              (fp16 operands, fp32 accumulate into the state registers)
// Operand precisions follow the measurements in docs/design.md: bf16 for anything unbounded (S, the
// e^{±80} factors), fp16 (2^-11) for the bounded R path, which keeps fp32 states within SPEC's 1e-3.
//
// Raw token rows of the next chunk are copied with cp.async while the current chunk is computed (double
// buffer); rows past the end of the sequence are zero-filled and their gate forced to 0, so padding never
// touches the state. Checkpoint rows are written at chunk starts that are multiples of the interval
// (intervals are multiples of 16). Slot, activity and gate rules come from kda/common/recurrent_rules.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "kda/common/recurrent_rules.h"
#include "kda/params.h"

namespace kda::prefill {

constexpr int kChunk = 16;         // tokens per chunk (the m16 of mma.sync)
constexpr int kHeadDim = 128;      // K = V
constexpr float kSpanLimit = 80.f;  // GEMM mode needs Γ_0 - Γ_15 <= this in every channel
constexpr float kL2Eps = 1e-6f;     // SPEC §2 step 1
constexpr float kMinLogDecay = -1e30f;  // keeps -inf gates from making inf - inf in relative exponents

template <int VB_>
struct ChunkedConfig {
  static constexpr int K = kHeadDim;
  static constexpr int VB = VB_;           // value rows per CTA
  static constexpr int NW = VB / 16;       // warps (16 value rows each)
  static constexpr int NT = NW * 32;       // threads
  static constexpr int kParts = K / VB;    // CTAs per (sequence, value head)
  static constexpr int KCH = K / 8;        // 16-byte pieces per K row
  static constexpr int NSEG = NT / K;      // token segments of the gate prefix (1 or 2)
  static_assert(VB == 64 || VB == 128, "value rows per CTA must be 64 or 128");
  static_assert(NSEG == 1 || NSEG == 2, "gate prefix layout");
};

// Shared memory of one CTA. Operand tiles [16 rows][K] of 16-bit values are XOR-swizzled in 16-byte
// pieces (piece ^ (row & 7)) so every ldmatrix phase hits 8 distinct bank groups.
template <int VB>
struct ChunkedSmem {
  static constexpr int K = kHeadDim;
  struct Raw {
    __nv_bfloat16 q[kChunk * K], k[kChunk * K], g[kChunk * K];
    __nv_bfloat16 v[kChunk * VB];
  };
  Raw raw[2];
  __nv_bfloat16 kp[kChunk * K], qp[kChunk * K];  // K⁺, Q⁺ (scale folded in)
  __half kr[kChunk * K];                         // Kr
  __nv_bfloat16 km[kChunk * K], qm[kChunk * K], kn[kChunk * K];
  float gam[kChunk * K];    // local prefix of the log-decay per token segment
  float gamma_c[K];         // e^{Γ_C}
  float ap[kChunk * kChunk];  // A' = diag(β) strict_tril(L)
  __half invb[kChunk * kChunk], mqk[kChunk * kChunk];
  float rq[kChunk], rk[kChunk], beta[kChunk];
  __nv_bfloat16 ostage[VB / 16][kChunk * 16];
};

__device__ __forceinline__ int swz(int row, int piece) { return row * kHeadDim + ((piece ^ (row & 7)) << 3); }

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ uint32_t pack_f16(float lo, float hi) {
  // Saturate: the R path is bounded for sane inputs; out-of-range values stay finite instead of inf.
  lo = fminf(fmaxf(lo, -65504.f), 65504.f);
  hi = fminf(fmaxf(hi, -65504.f), 65504.f);
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float bf(const __nv_bfloat16 x) { return __bfloat162float(x); }

__device__ __forceinline__ void ldsm_x4(const void* smem, uint32_t (&r)[4]) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}
__device__ __forceinline__ void ldsm_x4_t(const void* smem, uint32_t (&r)[4]) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1],
                                            d[2], d[3]);
}
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32F16F16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1],
                                          d[2], d[3]);
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  Copy::copy(*reinterpret_cast<const cute::uint128_t*>(gmem), *reinterpret_cast<cute::uint128_t*>(smem), pred);
}
__device__ __forceinline__ void cp_async_commit() { cute::cp_async_fence(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  cute::cp_async_wait<N>();
}

// [16 x 16] = A[16 x K] · B[16 x K]ᵀ over the swizzled tiles, bf16 operands, fp32 result (one warp).
__device__ __forceinline__ void gemm_16x16(const __nv_bfloat16* a, const __nv_bfloat16* b, int lane,
                                           float (&acc)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
  const int m = lane >> 3, r8 = lane & 7;
#pragma unroll
  for (int ks = 0; ks < kHeadDim / 16; ++ks) {
    uint32_t af[4], bfr[4];
    ldsm_x4(a + swz((m & 1) * 8 + r8, 2 * ks + (m >> 1)), af);
    ldsm_x4(b + swz((m >> 1) * 8 + r8, 2 * ks + (m & 1)), bfr);
    mma_bf16(acc[0], af, bfr[0], bfr[1]);
    mma_bf16(acc[1], af, bfr[2], bfr[3]);
  }
}

// B operand fragments (n = 16 rows of a row-major [16][16] fp16 matrix M, k = its columns): b for n-tile
// 0 in r[0..1], n-tile 1 in r[2..3].
__device__ __forceinline__ void load_b16x16(const __half* mat, int lane, uint32_t (&r)[4]) {
  const int m = lane >> 3, r8 = lane & 7;
  ldsm_x4(mat + ((m >> 1) * 8 + r8) * 16 + (m & 1) * 8, r);
}

template <int VB>
__global__ void __launch_bounds__(ChunkedConfig<VB>::NT, 1)
    kda_chunked_kernel(const RecurrentParams p, const bool out_vec16) {
  using Cfg = ChunkedConfig<VB>;
  using Smem = ChunkedSmem<VB>;
  constexpr int K = Cfg::K, NW = Cfg::NW, NT = Cfg::NT, KCH = Cfg::KCH, NSEG = Cfg::NSEG;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gq = lane >> 2, cq = lane & 3;  // mma fragment coordinates: row group, column pair

  // ---- which (sequence, value head, part) this CTA owns
  const int64_t item = blockIdx.x;
  const int part = static_cast<int>(item % Cfg::kParts);
  const int hv = static_cast<int>((item / Cfg::kParts) % p.HV);
  int64_t n = item / (int64_t(Cfg::kParts) * p.HV);
  if (p.seq_order != nullptr) {
    n = p.seq_order[n];
    if (n < 0 || n >= p.N) return;  // a broken permutation never reads out of bounds
  }
  const int h = hv / (p.HV / p.H);
  const int v0 = part * VB + warp * 16;  // this warp's first value row
  const SeqRange sr = seq_range(p, n);
  const StartState st = start_state(p, n);
  const int64_t head_off = int64_t(hv) * K * K;
  const int64_t inner = int64_t(p.HV) * K * K;

  auto out_row = [&](int64_t t) {  // first element of this warp's 16 outputs of token t (index along T)
    return static_cast<__nv_bfloat16*>(p.out) + sr.batch * p.out_batch_stride + t * p.out_token_stride +
           int64_t(hv) * p.out_head_stride + v0;
  };

  if (st.kind < 0) {  // inactive: zero output, no state read or write
    for (int64_t t = lane; t < sr.len * 2; t += 32) {
      __nv_bfloat16* o = out_row(sr.bos + t / 2) + (t % 2) * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = __float2bfloat16_rn(0.f);
    }
    return;
  }
  if (sr.len == 0 && p.final_state == nullptr) return;  // a zero-length sequence leaves its slot untouched

  // ---- start state into the accumulator layout: s[nt][e] = S[v0 + gq + 8 (e >= 2)][8 nt + 2 cq + (e & 1)]
  float s[K / 8][4];
  {
    const void* base = nullptr;
    DType dt = DType::kFloat32;
    int64_t off = 0;
    if (st.kind == 1 && sr.len > 0) base = p.state, dt = p.state_dtype, off = st.slot * p.state_slot_stride;
    if (st.kind == 2) base = p.state_source, dt = p.state_source_dtype, off = st.slot * p.source_slot_stride;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float x0 = 0.f, x1 = 0.f;
        if (base != nullptr) {
          const int64_t e = off + head_off + int64_t(v0 + gq + 8 * hr) * K + 8 * nt + 2 * cq;
          if (dt == DType::kBFloat16) {
            const __nv_bfloat162 w = *reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + e);
            x0 = __low2float(w), x1 = __high2float(w);
          } else {
            const float2 w = *reinterpret_cast<const float2*>(static_cast<const float*>(base) + e);
            x0 = w.x, x1 = w.y;
          }
        }
        s[nt][2 * hr] = x0, s[nt][2 * hr + 1] = x1;
      }
  }
  auto store_state = [&](void* base, DType dt, int64_t off) {
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
  };

  // ---- per-CTA gate constants: this thread's gate column and the head's A = exp(A_log)
  const int gcol = tid % K, gseg = tid / K;
  const float A = p.gate_mode != GateMode::kPrecomputed ? __expf(p.A_log[hv]) : 0.f;
  const float dtb = (p.gate_mode != GateMode::kPrecomputed && p.dt_bias != nullptr) ? p.dt_bias[int64_t(hv) * K + gcol]
                                                                                    : 0.f;

  const int64_t n_chunks = (sr.len + kChunk - 1) / kChunk;
  const int every = p.checkpoint_every_n_tokens;
  const int64_t ckpt_row0 = every > 0 ? p.checkpoint_cu_starts[n] : 0;

  // ---- raw copies of chunk c into buffer c & 1 (one cp.async group per chunk, empty past the end)
  const auto* qg = static_cast<const __nv_bfloat16*>(p.q.ptr) + sr.batch * p.q.batch_stride + int64_t(h) * p.q.head_stride;
  const auto* kg = static_cast<const __nv_bfloat16*>(p.k.ptr) + sr.batch * p.k.batch_stride + int64_t(h) * p.k.head_stride;
  const auto* gg = static_cast<const __nv_bfloat16*>(p.g.ptr) + sr.batch * p.g.batch_stride + int64_t(hv) * p.g.head_stride;
  const auto* vg = static_cast<const __nv_bfloat16*>(p.v.ptr) + sr.batch * p.v.batch_stride + int64_t(hv) * p.v.head_stride +
                   part * VB;
  const auto* bg = static_cast<const __nv_bfloat16*>(p.beta.ptr) + sr.batch * p.beta.batch_stride +
                   int64_t(hv) * p.beta.head_stride;
  auto issue_chunk = [&](int64_t c) {
    if (c < n_chunks) {
      typename Smem::Raw& rb = sm.raw[c & 1];
      const int64_t t0 = sr.bos + c * kChunk;
      const int cl = static_cast<int>(sr.len - c * kChunk < kChunk ? sr.len - c * kChunk : kChunk);
      constexpr int kQkg = kChunk * KCH;        // pieces per q/k/g tile
      constexpr int kVp = kChunk * (VB / 8);    // pieces of the v tile
      constexpr int kTotal = 3 * kQkg + kVp;
#pragma unroll
      for (int i = tid; i < kTotal; i += NT) {
        if (i < 3 * kQkg) {
          const int which = i / kQkg, r = (i % kQkg) / KCH, pc = i % KCH;
          const bool ok = r < cl;
          const int64_t t = t0 + (ok ? r : 0);
          const __nv_bfloat16* src = which == 0 ? qg + t * p.q.token_stride
                                                : (which == 1 ? kg + t * p.k.token_stride : gg + t * p.g.token_stride);
          __nv_bfloat16* dst = which == 0 ? rb.q : (which == 1 ? rb.k : rb.g);
          cp_async_16(dst + r * K + pc * 8, src + pc * 8, ok);
        } else {
          const int j = i - 3 * kQkg, r = j / (VB / 8), pc = j % (VB / 8);
          const bool ok = r < cl;
          const int64_t t = t0 + (ok ? r : 0);
          cp_async_16(rb.v + r * VB + pc * 8, vg + t * p.v.token_stride + pc * 8, ok);
        }
      }
    }
    cp_async_commit();
  };
  // beta of the next chunk: lanes 0..15 of warp 0 hold it in a register (a 2-byte value cannot cp.async)
  float beta_next = 0.f;
  auto load_beta = [&](int64_t c) {
    beta_next = 0.f;
    if (warp == 0 && lane < kChunk && c < n_chunks) {
      const int64_t t = c * kChunk + lane;
      if (t < sr.len) {
        const float b = bf(bg[(sr.bos + t) * p.beta.token_stride]);
        beta_next = p.beta_is_logit ? 1.f / (1.f + __expf(-b)) : b;
      }
    }
  };

  issue_chunk(0);
  load_beta(0);

  for (int64_t c = 0; c < n_chunks; ++c) {
    const int64_t t0 = c * kChunk;  // chunk start within the sequence
    const int cl = static_cast<int>(sr.len - t0 < kChunk ? sr.len - t0 : kChunk);
    const typename Smem::Raw& rb = sm.raw[c & 1];
    const float beta_cur = beta_next;
    issue_chunk(c + 1);
    cp_async_wait<1>();
    __syncthreads();  // (1) chunk c landed; the previous chunk's chain is done with every prepared tile
    load_beta(c + 1);

    // Checkpoint: the state BEFORE token t0 (t0 a multiple of the interval, itself a multiple of 16).
    if (every > 0 && t0 % every == 0) {
      const int64_t row = ckpt_row0 + t0 / every;
      if (row >= 0 && row < p.n_checkpoint_rows) store_state(p.state_checkpoints, p.checkpoint_dtype, row * inner);
    }

    // ---- P1: L2 norms (32 rows: q then k), gate -> log-decay -> local prefix, beta
    {
      constexpr int TPR = NT / 32, EPT = K / TPR;  // threads per row, elements per thread
      const int row = tid / TPR, j = tid % TPR;
      const __nv_bfloat16* src = (row < kChunk ? rb.q + row * K : rb.k + (row - kChunk) * K) + j * EPT;
      float ss = 0.f;
#pragma unroll
      for (int e = 0; e < EPT; e += 8) {
        const uint4 w = *reinterpret_cast<const uint4*>(src + e);
        const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&w);
#pragma unroll
        for (int u = 0; u < 8; ++u) ss = fmaf(bf(x[u]), bf(x[u]), ss);
      }
#pragma unroll
      for (int o = TPR / 2; o >= 1; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (j == 0) {
        const float r = p.use_qk_l2norm ? rsqrtf(ss + kL2Eps) : 1.f;
        if (row < kChunk)
          sm.rq[row] = r * p.scale;
        else
          sm.rk[row - kChunk] = r;
      }
      constexpr int TPS = kChunk / NSEG;  // tokens per prefix segment
      float acc = 0.f;
#pragma unroll
      for (int u = 0; u < TPS; ++u) {
        const int i = gseg * TPS + u;
        float a = 0.f;
        if (i < cl) {
          a = gate_log_decay<float>(p.gate_mode, bf(rb.g[i * K + gcol]), A, dtb, p.lower_bound);
          a = fmaxf(a, kMinLogDecay);
        }
        acc += a;
        sm.gam[i * K + gcol] = acc;
      }
      if (warp == 0 && lane < kChunk) sm.beta[lane] = beta_cur;
    }
    __syncthreads();  // (2)

    // ---- P3: decayed operand tiles, γ_C, and the GEMM-mode check
    int wide = 0;
    {
      auto gfull = [&](int i, int d) {
        float x = sm.gam[i * K + d];
        if (NSEG == 2 && i >= kChunk / 2) x += sm.gam[(kChunk / 2 - 1) * K + d];
        return x;
      };
#pragma unroll
      for (int idx = tid; idx < kChunk * KCH; idx += NT) {
        const int i = idx / KCH, pc = idx % KCH, d0 = pc * 8;
        const uint4 kw = *reinterpret_cast<const uint4*>(rb.k + i * K + d0);
        const uint4 qw = *reinterpret_cast<const uint4*>(rb.q + i * K + d0);
        const __nv_bfloat16* kx = reinterpret_cast<const __nv_bfloat16*>(&kw);
        const __nv_bfloat16* qx = reinterpret_cast<const __nv_bfloat16*>(&qw);
        const float rk = sm.rk[i], rq = sm.rq[i];
        float kp[8], qp[8], kr[8], km[8], qm[8], kn[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int d = d0 + e;
          const float gi = gfull(i, d), g7 = gfull(kChunk / 2 - 1, d), gc = gfull(kChunk - 1, d);
          const float kk = bf(kx[e]) * rk, qq = bf(qx[e]) * rq;
          const float e1 = __expf(gi), e3 = __expf(gi - g7);
          kp[e] = kk * e1, qp[e] = qq * e1;
          kr[e] = kk * __expf(gc - gi);
          km[e] = kk * e3, qm[e] = qq * e3;
          kn[e] = kk * __expf(g7 - gi);
          if (i == kChunk - 1) {
            sm.gamma_c[d] = __expf(gc);
            if (!(gfull(0, d) - gc <= kSpanLimit)) wide = 1;  // (NaN counts as wide)
          }
        }
        const int o = swz(i, pc);
        *reinterpret_cast<uint4*>(sm.kp + o) =
            make_uint4(pack_bf16(kp[0], kp[1]), pack_bf16(kp[2], kp[3]), pack_bf16(kp[4], kp[5]), pack_bf16(kp[6], kp[7]));
        *reinterpret_cast<uint4*>(sm.qp + o) =
            make_uint4(pack_bf16(qp[0], qp[1]), pack_bf16(qp[2], qp[3]), pack_bf16(qp[4], qp[5]), pack_bf16(qp[6], qp[7]));
        *reinterpret_cast<uint4*>(sm.kr + o) =
            make_uint4(pack_f16(kr[0], kr[1]), pack_f16(kr[2], kr[3]), pack_f16(kr[4], kr[5]), pack_f16(kr[6], kr[7]));
        *reinterpret_cast<uint4*>(sm.km + o) =
            make_uint4(pack_bf16(km[0], km[1]), pack_bf16(km[2], km[3]), pack_bf16(km[4], km[5]), pack_bf16(km[6], km[7]));
        *reinterpret_cast<uint4*>(sm.qm + o) =
            make_uint4(pack_bf16(qm[0], qm[1]), pack_bf16(qm[2], qm[3]), pack_bf16(qm[4], qm[5]), pack_bf16(qm[6], qm[7]));
        *reinterpret_cast<uint4*>(sm.kn + o) =
            make_uint4(pack_bf16(kn[0], kn[1]), pack_bf16(kn[2], kn[3]), pack_bf16(kn[4], kn[5]), pack_bf16(kn[6], kn[7]));
      }
    }
    const bool pairwise = __syncthreads_or(wide) != 0;  // (3)

    // ---- P4: L and Mqk (masked), then the inverse (warp 0)
    if (pairwise) {
      // Exact pairwise exponents on CUDA cores, one (i, j) entry per thread and step; masked entries are
      // written as 0 and never exponentiated.
      for (int e = tid; e < kChunk * kChunk; e += NT) {
        const int i = e / kChunk, j = e % kChunk;
        float l = 0.f, mq = 0.f;
        if (j <= i) {
          for (int d = 0; d < K; ++d) {
            float gi = sm.gam[i * K + d], gj = sm.gam[j * K + d];
            if (NSEG == 2) {
              const float off = sm.gam[(kChunk / 2 - 1) * K + d];
              gi += i >= kChunk / 2 ? off : 0.f;
              gj += j >= kChunk / 2 ? off : 0.f;
            }
            const float w = __expf(gi - gj) * bf(rb.k[j * K + d]);
            l = fmaf(bf(rb.k[i * K + d]), w, l);
            mq = fmaf(bf(rb.q[i * K + d]), w, mq);
          }
          l *= sm.rk[i] * sm.rk[j];
          mq *= sm.rq[i] * sm.rk[j];
        }
        sm.ap[e] = j < i ? sm.beta[i] * l : 0.f;
        sm.mqk[e] = __float2half_rn(fminf(fmaxf(mq, -65504.f), 65504.f));
      }
      __syncthreads();
    } else if (warp == 0 || warp == NW - 1) {
      float acc[2][4];
      gemm_16x16(warp == 0 ? sm.km : sm.qm, sm.kn, lane, acc);
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = gq + 8 * (e >> 1), j = 8 * nt + 2 * cq + (e & 1);
          if (warp == 0)
            sm.ap[i * kChunk + j] = j < i ? sm.beta[i] * acc[nt][e] : 0.f;
          else
            sm.mqk[i * kChunk + j] = __float2half_rn(j <= i ? fminf(fmaxf(acc[nt][e], -65504.f), 65504.f) : 0.f);
        }
      __syncwarp();
    }
    if (warp == 0 && lane < kChunk) {
      // INV = (I + A')^{-1}, column j = lane, forward substitution in fp32; INVb = INV diag(β).
      const int j = lane;
      float col[kChunk];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) {
        float x0 = i == j ? 1.f : 0.f, x1 = 0.f;
#pragma unroll
        for (int m = 0; m < i; ++m) {
          if (m & 1)
            x1 = fmaf(-sm.ap[i * kChunk + m], col[m], x1);
          else
            x0 = fmaf(-sm.ap[i * kChunk + m], col[m], x0);
        }
        col[i] = x0 + x1;
      }
      const float bj = sm.beta[j];
#pragma unroll
      for (int i = 0; i < kChunk; ++i) sm.invb[i * kChunk + j] = __float2half_rn(fminf(fmaxf(col[i] * bj, -65504.f), 65504.f));
    }

    // ---- C1: [Xᵀ | O_interᵀ] = S [K⁺ ; Q⁺]ᵀ and Yᵀ = Vᵀ - Xᵀ
    float ax[2][4], ao[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ax[nt][e] = 0.f, ao[nt][e] = 0.f;
    {
      const int m = lane >> 3, r8 = lane & 7;
#pragma unroll
      for (int ks = 0; ks < K / 16; ++ks) {
        const uint32_t a[4] = {pack_bf16(s[2 * ks][0], s[2 * ks][1]), pack_bf16(s[2 * ks][2], s[2 * ks][3]),
                               pack_bf16(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                               pack_bf16(s[2 * ks + 1][2], s[2 * ks + 1][3])};
        uint32_t bk[4], bq[4];
        ldsm_x4(sm.kp + swz((m >> 1) * 8 + r8, 2 * ks + (m & 1)), bk);
        ldsm_x4(sm.qp + swz((m >> 1) * 8 + r8, 2 * ks + (m & 1)), bq);
        mma_bf16(ax[0], a, bk[0], bk[1]);
        mma_bf16(ax[1], a, bk[2], bk[3]);
        mma_bf16(ao[0], a, bq[0], bq[1]);
        mma_bf16(ao[1], a, bq[2], bq[3]);
      }
    }
    // Yᵀ[v][t] = V[t][v] - Xᵀ[v][t] (padding rows: V = 0 and K⁺ = 0, so Y = 0)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int vr = warp * 16 + gq + 8 * (e >> 1), t = 8 * nt + 2 * cq + (e & 1);
        ax[nt][e] = bf(rb.v[t * VB + vr]) - ax[nt][e];
      }
    __syncthreads();  // (4) INVb and Mqk ready

    // ---- C2: Rᵀ = Yᵀ INVbᵀ; Oᵀ += Rᵀ Mqkᵀ; S = S ⊙ γ_C + Rᵀ Kr
    float ar[2][4];
    {
      const uint32_t ya[4] = {pack_f16(ax[0][0], ax[0][1]), pack_f16(ax[0][2], ax[0][3]), pack_f16(ax[1][0], ax[1][1]),
                              pack_f16(ax[1][2], ax[1][3])};
      uint32_t bi[4];
      load_b16x16(sm.invb, lane, bi);
#pragma unroll
      for (int e = 0; e < 4; ++e) ar[0][e] = 0.f, ar[1][e] = 0.f;
      mma_f16(ar[0], ya, bi[0], bi[1]);
      mma_f16(ar[1], ya, bi[2], bi[3]);
    }
    const uint32_t ra[4] = {pack_f16(ar[0][0], ar[0][1]), pack_f16(ar[0][2], ar[0][3]), pack_f16(ar[1][0], ar[1][1]),
                            pack_f16(ar[1][2], ar[1][3])};
    {
      uint32_t bm[4];
      load_b16x16(sm.mqk, lane, bm);
      mma_f16(ao[0], ra, bm[0], bm[1]);
      mma_f16(ao[1], ra, bm[2], bm[3]);
      // stage Oᵀ as O[t][v] (16 x 16 bf16) and store this warp's 16 columns per token with 16-byte stores
      __nv_bfloat16* os = sm.ostage[warp];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) os[(8 * nt + 2 * cq + (e & 1)) * 16 + gq + 8 * (e >> 1)] = __float2bfloat16_rn(ao[nt][e]);
      __syncwarp();
      const int t = lane >> 1, half = lane & 1;
      if (t < cl) {
        __nv_bfloat16* dst = out_row(sr.bos + t0 + t) + half * 8;
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
    {
      const int m = lane >> 3, r8 = lane & 7;
#pragma unroll
      for (int pp = 0; pp < K / 16; ++pp) {
        uint32_t b[4];
        ldsm_x4_t(sm.kr + swz((m & 1) * 8 + r8, 2 * pp + (m >> 1)), b);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int nt = 2 * pp + hh;
          const float2 gmm = *reinterpret_cast<const float2*>(sm.gamma_c + 8 * nt + 2 * cq);
          s[nt][0] *= gmm.x, s[nt][1] *= gmm.y, s[nt][2] *= gmm.x, s[nt][3] *= gmm.y;
          mma_f16(s[nt], ra, b[2 * hh], b[2 * hh + 1]);
        }
      }
    }
  }
  cp_async_wait<0>();

  if (p.state != nullptr && sr.len > 0) store_state(p.state, p.state_dtype, write_slot(p, n, 0) * p.state_slot_stride);
  if (p.final_state != nullptr) store_state(p.final_state, DType::kFloat32, n * inner);
}

}  // namespace kda::prefill

namespace kda::prefill {

template <int VB>
cudaError_t run_chunked_(const RecurrentParams& p, bool out_vec16, cudaStream_t stream) {
  using Cfg = ChunkedConfig<VB>;
  auto kernel = kda_chunked_kernel<VB>;
  constexpr int smem = static_cast<int>(sizeof(ChunkedSmem<VB>));
  static bool attr_set[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!attr_set[dev]) {
    const cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    attr_set[dev] = true;
  }
  const int64_t blocks = p.N * p.HV * Cfg::kParts;
  if (blocks <= 0) return cudaSuccess;
  kernel<<<dim3(static_cast<unsigned>(blocks)), Cfg::NT, smem, stream>>>(p, out_vec16);
  return cudaGetLastError();
}

}  // namespace kda::prefill
