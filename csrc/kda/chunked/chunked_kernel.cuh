// Chunked ("WY form") KDA prefill on tensor cores, architecture-neutral (mma.sync m16n8k16 + ldmatrix +
// cp.async through CuTe's SM80/SM75 atoms: runs on every built arch, sm_90a and the Blackwell targets).
// SPEC §2.2; the plan and the numerics are in docs/design.md ("Chunked form", "Chunked CUDA kernel").
//
// One CTA per (sequence, value head, value-row part), warp-specialised:
//   * NW chain warps, each owning 16 value rows of the head's state S[V, K] (K = 128) as an fp32 m16n8
//     accumulator (16 n-tiles x 4 = 64 registers per lane) for the whole sequence;
//   * 4 prep warps that turn the raw tokens of chunk j into the chain's operands, running up to two
//     chunks ahead of the chain through a double-buffered operand tile set (named barriers FULL/EMPTY).
// The sequence is walked in chunks of C = 16 tokens; per chunk (Γ = in-chunk cumulative log-decay per
// channel, relative to the chunk start, so every e^{Γ} <= 1; Γ' = Γ - Γ_0, relative to the first token):
//   prep: L2 norms of q, k; gate -> log-decay a (0 on padding rows) -> Γ (fp32 prefix, one thread per
//     channel); K⁺ = k̂ e^{Γ}, Q⁺ = q̂ scale e^{Γ} (bf16), Kr = k̂ e^{Γ_C - Γ} (fp16), γ_C = e^{Γ_C};
//     L and Mqk with RELATIVE exponents:
//       GEMM mode (every channel's in-chunk decay span -Γ'_15 <= 80, always true for the lower-bound
//       gate with λ >= -5): reference row 0, Km = k̂ e^{Γ'} <= |k̂|, Qm = q̂ scale e^{Γ'},
//       Kn = k̂ e^{-Γ'} <= |k̂| e^{80} (every factor within bf16/fp32 range; the products of unmasked
//       entries are exactly k̂_i k̂_j e^{Γ_i - Γ_j} <= |k|², masked ones <= |k|² e^{80}),
//       L = Km Knᵀ, Mqk = Qm Knᵀ by one prep warp each (bf16 mma); then K⁺ = Km e^{Γ_0},
//       Q⁺ = Qm e^{Γ_0}, Kr = Kn e^{Γ'_15}: two exponentials per element. Row i's operands depend on
//       tokens <= i only, so outputs are causal bit for bit;
//       pairwise mode (otherwise: unbounded softplus/precomputed gates): exact Σ_d k̂_i k̂_j e^{Γ_i - Γ_j}
//       on CUDA cores, masked pairs never exponentiated, K⁺/Q⁺/Kr from their own exponentials.
//     A' = diag(β) strict_tril(L); INV = (I + A')^{-1} by fp32 forward substitution (one warp, one column
//     per lane); INVb = INV diag(β) and Mqk = tril(Mqk) stored fp16.
//   chain (each chain warp, its 16 value rows; T = transposed, rows = value rows):
//     [Xᵀ | O_interᵀ] = S [K⁺ ; Q⁺]ᵀ    (A = bf16(S) straight from the accumulator registers)
//     Yᵀ = Vᵀ - Xᵀ;  Rᵀ = Yᵀ INVbᵀ      (fp16 operands)
//     Oᵀ = O_interᵀ + Rᵀ Mqkᵀ          -> staged in shared memory, 16-byte stores
//     S  = S ⊙ γ_C + Rᵀ Kr              (fp16 operands, fp32 accumulate into the state registers)
// Operand precisions follow the measurements in docs/design.md: bf16 for anything unbounded (S, the
// e^{80} factors), fp16 (2^-11) for the bounded R path, which keeps fp32 states within SPEC's 1e-3.
//
// Raw q/k/g rows of the next chunk are copied with cp.async by the prep warps while they prepare the
// current one (kRawStages - 1 chunks ahead); each chain warp copies its own 16 columns of v as far ahead.
// Rows past the end of the
// sequence are zero-filled and their gate forced to 0, so padding never touches the state. Checkpoint
// rows are written at chunk starts that are multiples of the interval (intervals are multiples of 16).
// Slot, activity and gate rules come from kda/common/recurrent_rules.h.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

#include "kda/common/bf16_bits.cuh"
#include "kda/common/recurrent_rules.h"
#include "kda/params.h"

namespace kda::prefill {

constexpr int kChunk = 16;              // tokens per chunk (the m16 of mma.sync)
constexpr int kHeadDim = 128;           // K = V
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kSpanLimit = 80.f * kLog2e;  // GEMM mode needs -Γ'_15 <= 80 (log2 units here) in every channel
constexpr float kMinLogDecay = -1e30f;  // keeps -inf gates from making inf - inf in relative exponents
constexpr int kPrepWarps = 4;                  // "G" warps: gate, norms, decayed operand tiles
constexpr int kPrepThreads = kPrepWarps * 32;  // one per channel (K = 128)
constexpr int kSolveThreads = 32;              // "W" warp: L and Mqk GEMMs, the triangular inverse

// Named barriers (0 is __syncthreads): G-internal; KREADY (G -> W), FULL (W -> chain), EMPTY (chain -> G),
// each per operand buffer.
// Pipeline depths are template parameters (ChunkedConfig): kStages operand buffers between G/W and the
// chain (how far prep may run ahead), kRawStages cp.async ring slots for the raw token tiles (prefetch
// distance + 1). The default 3 / 4 needs ~150 KB of shared memory; 2 / 2 (~94 KB at VB = 64) fits sm_120.
constexpr int kBarPrep = 1, kBarFull0 = 2;  // then EMPTY, KREADY: ChunkedConfig::kBarEmpty0, kBarKReady0

// Benchmark-only switches (KDA_CHUNKED_DIAG): skip one role's math to see what it costs. They break the
// results on purpose and are never set in normal use.
constexpr int kDiagNoChain = 1, kDiagNoSolve = 2, kDiagNoPrep = 4;

template <int VB_, int STAGES_ = 3, int RAW_STAGES_ = 4>
struct ChunkedConfig {
  static constexpr int K = kHeadDim;
  static constexpr int VB = VB_;             // value rows per CTA
  static constexpr int kStages = STAGES_;
  static constexpr int kRawStages = RAW_STAGES_;
  static constexpr int kBarEmpty0 = kBarFull0 + kStages, kBarKReady0 = kBarFull0 + 2 * kStages;
  static_assert(kBarKReady0 + kStages <= 16, "16 hardware barriers per CTA");
  static_assert(kStages >= 2 && kRawStages >= 2, "double buffering at least");
  static constexpr int NW = VB / 16;         // chain warps (16 value rows each)
  static constexpr int NC = NW * 32;         // chain threads
  static constexpr int NT = NC + kPrepThreads + kSolveThreads;
  static constexpr int kCountFull = NC + kSolveThreads;    // W arrives, chain syncs
  static constexpr int kCountEmpty = NC + kPrepThreads;    // chain arrives, G syncs
  static constexpr int kCountKReady = kPrepThreads + kSolveThreads;
  static constexpr int kParts = K / VB;      // CTAs per (sequence, value head)
  static constexpr int KCH = K / 8;          // 16-byte pieces per K row
  static_assert(VB == 64 || VB == 128, "value rows per CTA must be 64 or 128");
};

// Shared memory of one CTA. Operand tiles [16 rows][K] of 16-bit values are XOR-swizzled in 16-byte
// pieces (piece ^ (row & 7)) so every ldmatrix phase hits 8 distinct bank groups.
template <int VB, int kStages = 3, int kRawStages = 4>
struct ChunkedSmem {
  static constexpr int K = kHeadDim;
  struct alignas(16) Raw {  // G warps' cp.async ring
    __nv_bfloat16 q[kChunk * K], k[kChunk * K], g[kChunk * K];
  };
  struct alignas(16) Operands {  // G/W -> chain, double-buffered
    __nv_bfloat16 kp[kChunk * K], qp[kChunk * K];  // K⁺, Q⁺ (scale folded in)
    __half kr[kChunk * K];                         // Kr
    float gamma_c[K];                              // e^{Γ_C}
    __half invb[kChunk * kChunk], mqk[kChunk * kChunk];
  };
  // Every member is 16-byte aligned (cp.async, ldmatrix and float4/uint4 accesses).
  alignas(16) Raw raw[kRawStages];
  alignas(16) Operands op[kStages];
  // G -> W, double-buffered
  alignas(16) __nv_bfloat16 km[kStages][kChunk * K], qm[kStages][kChunk * K], kn[kStages][kChunk * K];
  alignas(16) float ap[kStages][kChunk * kChunk];  // A' = diag(β) strict_tril(L) (by W, or by G in pairwise mode)
  alignas(16) float beta[kStages][kChunk];
  // G-only scratch
  alignas(16) float gp[kChunk * K];  // Γ' = Γ - Γ_0
  alignas(16) float e0[K], ecp[K];   // e^{Γ_0}, e^{Γ'_15}
  alignas(16) float a0[K], gc[K];    // Γ_0, Γ'_15
  alignas(16) float rq[kChunk], rk[kChunk];
  alignas(16) float i2s[8 * 8];  // W-only: the lower diagonal block's inverse
  // chain-only: per warp, v of two chunks and the output staging tile
  alignas(16) __nv_bfloat16 vbuf[VB / 16][kRawStages][kChunk * 16];
  alignas(16) __nv_bfloat16 ostage[VB / 16][kChunk * 16];
  alignas(16) int pairwise[kStages];
};

__device__ __forceinline__ int swz(int row, int piece) { return row * kHeadDim + ((piece ^ (row & 7)) << 3); }

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

// B operand fragments (n = 16 rows of a row-major [16][16] fp16 matrix M, k = its columns): b for n-tile
// 0 in r[0..1], n-tile 1 in r[2..3].
__device__ __forceinline__ void load_b16x16(const __half* mat, int lane, uint32_t (&r)[4]) {
  const int m = lane >> 3, r8 = lane & 7;
  ldsm_x4(mat + ((m >> 1) * 8 + r8) * 16 + (m & 1) * 8, r);
}


__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// bar.red.or over `count` threads: true when any participant passed a non-zero flag.
__device__ __forceinline__ bool named_sync_or(int id, int count, int flag) {
  uint32_t r;
  asm volatile(
      "{\n .reg .pred p;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred p, %2, %3, p;\n selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(r)
      : "r"(flag), "r"(id), "r"(count)
      : "memory");
  return r != 0;
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
__device__ __forceinline__ float clamp_f16(float x) { return fminf(fmaxf(x, -65504.f), 65504.f); }

// The log-decay of gate_log_decay (kda/common/recurrent_rules.h, the contract) in log2 units, a·log2 e,
// so that every later exponential is one ex2, with fast-math intrinsics: A, Adtb and lb arrive pre-scaled
// (A log2e, A dt_bias log2e, λ log2e).
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

// Γ' = Σ_{1..i} a of channel d over the chunk into sm.gp (a = 0 on padding rows); returns a_0 and Γ'_15.
template <GateMode M, class Raw>
__device__ __forceinline__ void gate_prefix(const Raw& rb, float* gp, int d, int cl, float A, float Adtb, float dtb,
                                            float lb, float& a0, float& gc) {
  // all loads first, then the 16 independent gate evaluations, then the (cheap) serial prefix
  float a[kChunk];
#pragma unroll
  for (int i = 0; i < kChunk; ++i) a[i] = bf(rb.g[i * kHeadDim + d]);
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    const float x = fmaxf(gate_a<M>(a[i], A, Adtb, dtb, lb), kMinLogDecay);
    a[i] = i < cl ? x : 0.f;  // padding rows (zero-filled) never decay; a select keeps the loop branch-free
  }
  a0 = a[0];
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kChunk; ++i) {
    if (i > 0) acc += a[i];
    gp[i * kHeadDim + d] = acc;
  }
  gc = acc;
}

__device__ __forceinline__ void load8f(const float* p, float (&x)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
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

// BWD = false: the prefill (and the training forward with tapes). BWD = true: the backward chain of the
// training backward (kda_ops/reference_chunked_backward.py, chain_step), the same prep on the same chunks
// walked last to first, with the value rows of the chain gradient dS[V, K] in the chain warps' registers:
//   dRᵀ = dS Krᵀ + dOᵀ Mqk,  dXᵀ = -dRᵀ INVb,  dS = dS ⊙ γ_C + dOᵀ Q⁺ + dXᵀ K⁺   (all bf16 operands, fp32 acc)
// p.v carries dO, p.state_source dfinal_state (null: zeros), p.final_state receives dinitial_state and
// p.state_checkpoints receives dS at the END of every 16-token chunk (the chain gradient entering it from the
// right), row (every / 16) * checkpoint_cu_starts[n] + chunk: every / 16 sub-rows per checkpoint row.
template <int VB, int STAGES, int RAW_STAGES, bool BWD>
__global__ void __launch_bounds__(ChunkedConfig<VB, STAGES, RAW_STAGES>::NT, 1)
    kda_chunked_kernel(const RecurrentParams p, const bool out_vec16, const int diag) {
  using Cfg = ChunkedConfig<VB, STAGES, RAW_STAGES>;
  using Smem = ChunkedSmem<VB, STAGES, RAW_STAGES>;
  constexpr int kStages = Cfg::kStages, kRawStages = Cfg::kRawStages;
  constexpr int kBarEmpty0 = Cfg::kBarEmpty0, kBarKReady0 = Cfg::kBarKReady0;
  constexpr int K = Cfg::K, NW = Cfg::NW, NC = Cfg::NC;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;

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
  const SeqRange sr = seq_range(p, n);
  const StartState st = start_state(p, n);
  const int64_t head_off = int64_t(hv) * K * K;
  const int64_t inner = int64_t(p.HV) * K * K;
  const int64_t n_chunks = (sr.len + kChunk - 1) / kChunk;
  // the chunk the j-th step processes: j in the forward, last first in the backward chain
  auto phys = [&](int64_t j) { return BWD ? n_chunks - 1 - j : j; };
  auto chunk_len = [&](int64_t c) {
    return static_cast<int>(sr.len - c * kChunk < kChunk ? sr.len - c * kChunk : kChunk);
  };
  const int v0 = part * VB + warp * 16;  // a chain warp's first value row
  auto out_row = [&](int64_t t) {  // first of this chain warp's 16 outputs of token t (index along T)
    return static_cast<__nv_bfloat16*>(p.out) + sr.batch * p.out_batch_stride + t * p.out_token_stride +
           int64_t(hv) * p.out_head_stride + v0;
  };

  if (st.kind < 0) {  // inactive: zero output, no state read or write (never in the backward chain)
    if (!BWD && warp < NW)
      for (int64_t t = lane; t < sr.len * 2; t += 32) {
        __nv_bfloat16* o = out_row(sr.bos + t / 2) + (t % 2) * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = __float2bfloat16_rn(0.f);
      }
    return;
  }
  if (sr.len == 0 && p.final_state == nullptr) return;  // a zero-length sequence leaves its slot untouched

  if (warp >= NW + kPrepWarps) {
    // ================================ W: L, Mqk, inverse ================================
    for (int64_t j = 0; j < n_chunks; ++j) {
      const int b = static_cast<int>(j % kStages);
      named_sync(kBarKReady0 + b, Cfg::kCountKReady);  // G's tiles of chunk j
      typename Smem::Operands& op = sm.op[b];
      float* ap = sm.ap[b];
      const float* bt = sm.beta[b];
      if (diag & kDiagNoSolve) {
        named_arrive(kBarFull0 + b, Cfg::kCountFull);
        continue;
      }
      if (!sm.pairwise[b]) {
        // L = Km Knᵀ and Mqk = Qm Knᵀ, interleaved (shared B fragments), even/odd k-steps into separate
        // accumulators (half the dependent HMMA chain)
        const int gq = lane >> 2, cq = lane & 3;
        const TileOffsets toff_a(((lane >> 3) & 1) * 8 + (lane & 7), (lane >> 4) & 1);  // A fragments
        const TileOffsets toff_b(((lane >> 4) & 1) * 8 + (lane & 7), (lane >> 3) & 1);  // B fragments
        float al[2][4] = {}, aq[2][4] = {}, al2[2][4] = {}, aq2[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) {
          uint32_t fk[4], fq[4], fn[4];
          ldsm_x4(sm.km[b] + toff_a.at(ks), fk);
          ldsm_x4(sm.qm[b] + toff_a.at(ks), fq);
          ldsm_x4(sm.kn[b] + toff_b.at(ks), fn);
          float(&x)[2][4] = (ks & 1) ? al2 : al;
          float(&y)[2][4] = (ks & 1) ? aq2 : aq;
          mma_bf16(x[0], fk, fn[0], fn[1]);
          mma_bf16(x[1], fk, fn[2], fn[3]);
          mma_bf16(y[0], fq, fn[0], fn[1]);
          mma_bf16(y[1], fq, fn[2], fn[3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) al[nt][e] += al2[nt][e], aq[nt][e] += aq2[nt][e];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = gq + 8 * (e >> 1), jj = 8 * nt + 2 * cq + (e & 1);
            ap[i * kChunk + jj] = jj < i ? bt[i] * al[nt][e] : 0.f;
            put16<BWD>(op.mqk, i, jj, jj <= i ? aq[nt][e] : 0.f);
          }
        __syncwarp();
      }
      // INV = (I + A')^{-1} blockwise in fp32: the two 8x8 diagonal blocks by forward substitution (lane c of
      // each half-warp: column c of its block), then the off-diagonal block X = -I2 A'21 I1. INVb = INV diag(β).
      {
        const int blk = (lane >> 3) & 1, c = lane & 7, base = 8 * blk;
        float col[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          float x0 = i == c ? 1.f : 0.f, x1 = 0.f;
#pragma unroll
          for (int mm = 0; mm < i; ++mm) {
            const float a = ap[(base + i) * kChunk + base + mm];
            if (mm & 1)
              x1 = fmaf(-a, col[mm], x1);
            else
              x0 = fmaf(-a, col[mm], x0);
          }
          col[i] = x0 + x1;
        }
        if (blk == 1 && lane < 16) {
#pragma unroll
          for (int r = 0; r < 8; ++r) sm.i2s[r * 8 + c] = col[r];
        }
        float tcol[8];  // T[:, c] = A'21 I1[:, c] (meaningful in lanes 0..7)
#pragma unroll
        for (int r = 0; r < 8; ++r) {
          float t0 = 0.f, t1 = 0.f;
#pragma unroll
          for (int mm = 0; mm < 8; mm += 2) {
            t0 = fmaf(ap[(8 + r) * kChunk + mm], col[mm], t0);
            t1 = fmaf(ap[(8 + r) * kChunk + mm + 1], col[mm + 1], t1);
          }
          tcol[r] = t0 + t1;
        }
        __syncwarp();
        if (lane < 8) {
          const float bc = bt[c];
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            float x0 = 0.f, x1 = 0.f;
#pragma unroll
            for (int mm = 0; mm < 8; mm += 2) {
              x0 = fmaf(sm.i2s[r * 8 + mm], tcol[mm], x0);
              x1 = fmaf(sm.i2s[r * 8 + mm + 1], tcol[mm + 1], x1);
            }
            put16<BWD>(op.invb, r, c, col[r] * bc);
            put16<BWD>(op.invb, 8 + r, c, -(x0 + x1) * bc);
          }
        } else if (lane < 16) {
          const float bc = bt[8 + c];
#pragma unroll
          for (int r = 0; r < 8; ++r) {
            put16<BWD>(op.invb, r, 8 + c, 0.f);
            put16<BWD>(op.invb, 8 + r, 8 + c, col[r] * bc);
          }
        }
        __syncwarp();  // i2s is reused next chunk
      }
      named_arrive(kBarFull0 + b, Cfg::kCountFull);  // operands of chunk j are ready
    }
    return;
  }
  if (warp >= NW) {
    // ================================ G: gate, norms, operand tiles ================================
    const int ptid = tid - NC;
    const int d = ptid;  // the gate channel of this thread
    const bool in_gate = p.gate_mode != GateMode::kPrecomputed;
    const float A = in_gate ? __expf(p.A_log[hv]) : 0.f;
    const float dtb = (in_gate && p.dt_bias != nullptr) ? p.dt_bias[int64_t(hv) * K + d] : 0.f;
    // pre-scaled gate constants (gate_a works in log2 units)
    const float A2 = A * kLog2e;
    const float Adtb = A2 * dtb;
    const float lb2 = p.lower_bound * kLog2e;
    const __nv_bfloat16* src3[3] = {
        static_cast<const __nv_bfloat16*>(p.q.ptr) + sr.batch * p.q.batch_stride + int64_t(h) * p.q.head_stride,
        static_cast<const __nv_bfloat16*>(p.k.ptr) + sr.batch * p.k.batch_stride + int64_t(h) * p.k.head_stride,
        static_cast<const __nv_bfloat16*>(p.g.ptr) + sr.batch * p.g.batch_stride + int64_t(hv) * p.g.head_stride};
    const int64_t stride3[3] = {p.q.token_stride, p.k.token_stride, p.g.token_stride};
    const auto* bsrc = static_cast<const __nv_bfloat16*>(p.beta.ptr) + sr.batch * p.beta.batch_stride +
                       int64_t(hv) * p.beta.head_stride;

    // raw q, k, g of chunk c into ring slot c % kRawStages: 3 tiles x 256 pieces of 16 bytes, 6 per thread
    auto issue = [&](int64_t c) {
      if (c < n_chunks) {
        typename Smem::Raw& rb = sm.raw[c % kRawStages];
        __nv_bfloat16* dst3[3] = {rb.q, rb.k, rb.g};
        const int64_t t0 = sr.bos + phys(c) * kChunk;
        const int cl = chunk_len(phys(c));
#pragma unroll
        for (int u = 0; u < 6; ++u) {
          const int which = u >> 1, within = ptid + kPrepThreads * (u & 1), r = within >> 4, pc = within & 15;
          const bool ok = r < cl;
          cp_async_16(dst3[which] + r * K + pc * 8, src3[which] + (t0 + (ok ? r : 0)) * stride3[which] + pc * 8, ok);
        }
      }
      cp_async_commit();
    };
    // raw beta bits of chunk c (threads 0..15); converted one chunk later, so the global load's latency is
    // never waited on
    auto load_beta = [&](int64_t c) {
      __nv_bfloat16 bv = __float2bfloat16_rn(0.f);
      if (ptid < kChunk && c < n_chunks && phys(c) * kChunk + ptid < sr.len)
        bv = bsrc[(sr.bos + phys(c) * kChunk + ptid) * p.beta.token_stride];
      return bv;
    };

#pragma unroll
    for (int c = 0; c < kRawStages - 1; ++c) issue(c);
    __nv_bfloat16 beta_next = load_beta(0);
    for (int64_t j = 0; j < n_chunks; ++j) {
      const int b = static_cast<int>(j % kStages);
      const int cl = chunk_len(phys(j));
      const __nv_bfloat16 beta_raw = beta_next;
      beta_next = load_beta(j + 1);
      // The chain is done with chunk j-kStages' operands (and so, transitively, is W with its G -> W tiles).
      if (j >= kStages) named_sync(kBarEmpty0 + b, Cfg::kCountEmpty);
      cp_async_wait<kRawStages - 2>();
      // raw(j) visible to every G thread, and every G thread is done with chunk j-1 (incl. its raw slot,
      // refilled right below: issuing before this barrier would race with slower threads' reads)
      named_sync(kBarPrep, kPrepThreads);
      issue(j + kRawStages - 1);
      const typename Smem::Raw& rb = sm.raw[j % kRawStages];
      typename Smem::Operands& op = sm.op[b];

      if (diag & kDiagNoPrep) {
        if (ptid == 0) sm.pairwise[b] = 0;
        named_arrive(kBarKReady0 + b, Cfg::kCountKReady);
        continue;
      }
      // ---- P1: gate prefix of channel d, per-channel constants, L2 norms, beta
      float a0 = 0.f, gc = 0.f;
      if (p.gate_mode == GateMode::kLowerBound)
        gate_prefix<GateMode::kLowerBound>(rb, sm.gp, d, cl, A2, Adtb, dtb, lb2, a0, gc);
      else if (p.gate_mode == GateMode::kSoftplus)
        gate_prefix<GateMode::kSoftplus>(rb, sm.gp, d, cl, A2, Adtb, dtb, lb2, a0, gc);
      else
        gate_prefix<GateMode::kPrecomputed>(rb, sm.gp, d, cl, A2, Adtb, dtb, lb2, a0, gc);
      sm.e0[d] = exp2f(a0);  // (a0, gc, Γ' are in log2 units)
      sm.ecp[d] = exp2f(gc);
      sm.a0[d] = a0;  // the raw exponents, for the pairwise fallback
      sm.gc[d] = gc;
      op.gamma_c[d] = exp2f(a0 + gc);
      const int wide = !(-gc <= kSpanLimit);  // (NaN counts as wide)
      {
        const int row = ptid >> 2, part4 = ptid & 3;  // 32 rows (q then k), 4 threads x 32 elements each
        const __nv_bfloat16* src = (row < kChunk ? rb.q + row * K : rb.k + (row - kChunk) * K) + part4 * 32;
        float ss0 = 0.f, ss1 = 0.f;
#pragma unroll
        for (int e = 0; e < 32; e += 8) {
          const uint4 w = *reinterpret_cast<const uint4*>(src + e);
          const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            const float lo = bf16_lo(ws[u]), hi = bf16_hi(ws[u]);
            ss0 = fmaf(lo, lo, ss0);
            ss1 = fmaf(hi, hi, ss1);
          }
        }
        float ss = ss0 + ss1;
        ss += __shfl_xor_sync(0xffffffffu, ss, 2);
        ss += __shfl_xor_sync(0xffffffffu, ss, 1);
        if (part4 == 0) {
          const float r = p.use_qk_l2norm ? rsqrtf(ss + kL2NormEps) : 1.f;
          if (row < kChunk)
            sm.rq[row] = r * p.scale;
          else
            sm.rk[row - kChunk] = r;
        }
      }
      if (ptid < kChunk) {
        const float x = bf(beta_raw);
        sm.beta[b][ptid] = ptid < cl ? (p.beta_is_logit ? __fdividef(1.f, 1.f + __expf(-x)) : x) : 0.f;
      }
      const bool pairwise = named_sync_or(kBarPrep, kPrepThreads, wide);

      // ---- P3: decayed operand tiles (2 items of 8 channels per thread)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int idx = ptid + kPrepThreads * u, i = idx >> 4, pc = idx & 15, d0 = pc * 8;
        float gi[8];
        load8f(sm.gp + i * K + d0, gi);
        const uint4 kw = *reinterpret_cast<const uint4*>(rb.k + i * K + d0);
        const uint4 qw = *reinterpret_cast<const uint4*>(rb.q + i * K + d0);
        const uint32_t kws[4] = {kw.x, kw.y, kw.z, kw.w}, qws[4] = {qw.x, qw.y, qw.z, qw.w};
        float kk[8], qq[8];
        const float rk = sm.rk[i], rq = sm.rq[i];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          kk[2 * e] = bf16_lo(kws[e]) * rk, kk[2 * e + 1] = bf16_hi(kws[e]) * rk;
          qq[2 * e] = bf16_lo(qws[e]) * rq, qq[2 * e + 1] = bf16_hi(qws[e]) * rq;
        }
        float kp[8], qp[8], kr[8];
        const int o = swz(i, pc);
        if (!pairwise) {
          float e0v[8], ecv[8], km[8], qm[8], kn[8];
          load8f(sm.e0 + d0, e0v);
          load8f(sm.ecp + d0, ecv);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float ex = exp2f(gi[e]), ei = __fdividef(1.f, ex);  // e^{±Γ'}, Γ' in [-80, 0] (nats)
            km[e] = kk[e] * ex, qm[e] = qq[e] * ex, kn[e] = kk[e] * ei;
            kp[e] = km[e] * e0v[e], qp[e] = qm[e] * e0v[e], kr[e] = kn[e] * ecv[e];
          }
          *reinterpret_cast<uint4*>(sm.km[b] + o) = pack8_bf16(km);
          *reinterpret_cast<uint4*>(sm.qm[b] + o) = pack8_bf16(qm);
          *reinterpret_cast<uint4*>(sm.kn[b] + o) = pack8_bf16(kn);
        } else {
          // exact exponentials of the absolute (<= 0) exponents: Γ_i = a_0 + Γ'_i, Γ_C - Γ_i = Γ'_15 - Γ'_i
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float e1 = exp2f(sm.a0[d0 + e] + gi[e]);
            kp[e] = kk[e] * e1, qp[e] = qq[e] * e1;
            kr[e] = kk[e] * exp2f(sm.gc[d0 + e] - gi[e]);
          }
        }
        *reinterpret_cast<uint4*>(op.kp + o) = pack8_bf16(kp);
        *reinterpret_cast<uint4*>(op.qp + o) = pack8_bf16(qp);
        // |Kr| <= |k̂| <= 1 with the L2 norm: no saturation needed
        if constexpr (BWD)  // bf16: the B operand of dS Krᵀ, whose A (dS) is bf16
          *reinterpret_cast<uint4*>(op.kr + o) = pack8_bf16(kr);
        else
          *reinterpret_cast<uint4*>(op.kr + o) = p.use_qk_l2norm ? pack8_f16_nosat(kr) : pack8_f16(kr);
      }
      if (pairwise) {
        // Exact pairwise exponents on CUDA cores (Γ_i - Γ_j = Γ'_i - Γ'_j), masked entries written as 0
        // and never exponentiated; W then only inverts.
        for (int e = ptid; e < kChunk * kChunk; e += kPrepThreads) {
          const int i = e / kChunk, jj = e % kChunk;
          float l = 0.f, mq = 0.f;
          if (jj <= i) {
            for (int dd = 0; dd < K; ++dd) {
              const float w = exp2f(sm.gp[i * K + dd] - sm.gp[jj * K + dd]) * bf(rb.k[jj * K + dd]);
              l = fmaf(bf(rb.k[i * K + dd]), w, l);
              mq = fmaf(bf(rb.q[i * K + dd]), w, mq);
            }
            l *= sm.rk[i] * sm.rk[jj];
            mq *= sm.rq[i] * sm.rk[jj];
          }
          sm.ap[b][e] = jj < i ? sm.beta[b][i] * l : 0.f;
          put16<BWD>(op.mqk, i, jj, mq);
        }
      }
      if (ptid == 0) sm.pairwise[b] = pairwise;
      named_arrive(kBarKReady0 + b, Cfg::kCountKReady);
    }
    // Match the chain's EMPTY arrivals of the last kStages chunks, so no barrier is left half-arrived.
    for (int64_t j = n_chunks > kStages ? n_chunks : kStages; j < n_chunks + kStages; ++j)
      named_sync(kBarEmpty0 + static_cast<int>(j % kStages), Cfg::kCountEmpty);
    cp_async_wait<0>();
    return;
  }

  // ================================ chain warps ================================
  const int gq = lane >> 2, cq = lane & 3;  // mma fragment coordinates: row group, column pair

  // start state into the accumulator layout: s[nt][e] = S[v0 + gq + 8 (e >= 2)][8 nt + 2 cq + (e & 1)]
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
            const __nv_bfloat162 w =
                *reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + e);
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

  const int every = p.checkpoint_every_n_tokens;
  const int64_t ckpt_row0 = every > 0 ? p.checkpoint_cu_starts[n] : 0;
  // this warp's 16 columns of v, kRawStages - 1 chunks ahead: lane -> (token lane / 2, 8 columns (lane & 1) * 8)
  const auto* vsrc = static_cast<const __nv_bfloat16*>(p.v.ptr) + sr.batch * p.v.batch_stride +
                     int64_t(hv) * p.v.head_stride + v0 + (lane & 1) * 8;
  auto issue_v = [&](int64_t c) {  // (dO in the backward chain)
    if (c < n_chunks) {
      const int t = lane >> 1;
      const int64_t pc = phys(c);
      const bool ok = pc * kChunk + t < sr.len;
      cp_async_16(&sm.vbuf[warp][c % kRawStages][t * 16 + (lane & 1) * 8],
                  vsrc + (sr.bos + (ok ? pc * kChunk + t : 0)) * p.v.token_stride, ok);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < kRawStages - 1; ++c) issue_v(c);
  // this lane's ldmatrix offsets: B fragments of K⁺/Q⁺ (n = token rows), transposed B fragments of Kr
  const TileOffsets toff_b(((lane >> 4) & 1) * 8 + (lane & 7), (lane >> 3) & 1);
  const TileOffsets toff_t(((lane >> 3) & 1) * 8 + (lane & 7), (lane >> 4) & 1);

  for (int64_t c = 0; c < n_chunks; ++c) {
    const int b = static_cast<int>(c % kStages);
    const int64_t t0 = phys(c) * kChunk;  // chunk start within the sequence
    const int cl = chunk_len(phys(c));
    __syncwarp();  // every lane is done with the v slot refilled below (chunk c - 1's)
    issue_v(c + kRawStages - 1);

    if constexpr (BWD) {
      // dS at the end of EVERY 16-token chunk: row (every / 16) * (checkpoint row of the sequence) + chunk
      // (the sub-rows of checkpoint row r are (every / 16) r + 0 .. every / 16 - 1).
      if (every > 0) {
        const int64_t row = ckpt_row0 * (every / kChunk) + t0 / kChunk;
        if (row >= 0 && row < p.n_checkpoint_rows) store_state(p.state_checkpoints, p.checkpoint_dtype, row * inner);
      }
    } else if (every > 0 && t0 % every == 0 && t0 / every >= p.checkpoint_first) {
      // Checkpoint: the state BEFORE token t0 (t0 a multiple of the interval, itself a multiple of 16).
      const int64_t row = ckpt_row0 + t0 / every - p.checkpoint_first;
      if (row >= 0 && row < p.n_checkpoint_rows) store_state(p.state_checkpoints, p.checkpoint_dtype, row * inner);
    }
    cp_async_wait<kRawStages - 1>();
    __syncwarp();
    named_sync(kBarFull0 + b, Cfg::kCountFull);  // the operands of chunk c
    const typename Smem::Operands& op = sm.op[b];
    const __nv_bfloat16* vb = sm.vbuf[warp][c % kRawStages];
    if (diag & kDiagNoChain) {
      named_arrive(kBarEmpty0 + b, Cfg::kCountEmpty);
      continue;
    }
    if constexpr (BWD) {
      // A operand dOᵀ [16 value rows][16 tokens] from this warp's dO tile vb[t][v] (bf16 pairs along t)
      const auto pk = [&](int vr, int t) {
        __nv_bfloat162 w;
        w.x = vb[t * 16 + vr], w.y = vb[(t + 1) * 16 + vr];
        return *reinterpret_cast<uint32_t*>(&w);
      };
      const uint32_t oa[4] = {pk(gq, 2 * cq), pk(gq + 8, 2 * cq), pk(gq, 2 * cq + 8), pk(gq + 8, 2 * cq + 8)};
      // ---- dRᵀ = dS Krᵀ + dOᵀ Mqk (op.mqk holds Mqkᵀ)
      float ax[2][4], ax2[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ax[nt][e] = 0.f, ax2[nt][e] = 0.f;
      {
        uint32_t bm[4];
        load_b16x16(op.mqk, lane, bm);
        mma_bf16(ax2[0], oa, bm[0], bm[1]);
        mma_bf16(ax2[1], oa, bm[2], bm[3]);
        uint32_t bk[2][4];
        ldsm_x4(op.kr + toff_b.at(0), bk[0]);
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) {
          const int cur = ks & 1;
          if (ks + 1 < K / 16) ldsm_x4(op.kr + toff_b.at(ks + 1), bk[cur ^ 1]);
          const uint32_t a[4] = {pack_bf16x2(s[2 * ks][0], s[2 * ks][1]), pack_bf16x2(s[2 * ks][2], s[2 * ks][3]),
                                 pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                 pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
          float(&x)[2][4] = cur ? ax2 : ax;
          mma_bf16(x[0], a, bk[cur][0], bk[cur][1]);
          mma_bf16(x[1], a, bk[cur][2], bk[cur][3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ax[nt][e] += ax2[nt][e];
      }
      // ---- dXᵀ = -dRᵀ INVb (op.invb holds INVbᵀ)
      float ar[2][4];
      {
        const uint32_t ya[4] = {pack_bf16x2(ax[0][0], ax[0][1]), pack_bf16x2(ax[0][2], ax[0][3]),
                                pack_bf16x2(ax[1][0], ax[1][1]), pack_bf16x2(ax[1][2], ax[1][3])};
        uint32_t bi[4];
        load_b16x16(op.invb, lane, bi);
#pragma unroll
        for (int e = 0; e < 4; ++e) ar[0][e] = 0.f, ar[1][e] = 0.f;
        mma_bf16(ar[0], ya, bi[0], bi[1]);
        mma_bf16(ar[1], ya, bi[2], bi[3]);
      }
      const uint32_t xa[4] = {pack_bf16x2(-ar[0][0], -ar[0][1]), pack_bf16x2(-ar[0][2], -ar[0][3]),
                              pack_bf16x2(-ar[1][0], -ar[1][1]), pack_bf16x2(-ar[1][2], -ar[1][3])};
      // ---- dS = dS ⊙ γ_C + dOᵀ Q⁺ + dXᵀ K⁺
#pragma unroll
      for (int pp = 0; pp < K / 16; ++pp) {
        uint32_t bq[4], bk[4];
        ldsm_x4_t(op.qp + toff_t.at(pp), bq);
        ldsm_x4_t(op.kp + toff_t.at(pp), bk);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int nt = 2 * pp + hh;
          const float2 gmm = *reinterpret_cast<const float2*>(op.gamma_c + 8 * nt + 2 * cq);
          s[nt][0] *= gmm.x, s[nt][1] *= gmm.y, s[nt][2] *= gmm.x, s[nt][3] *= gmm.y;
          mma_bf16(s[nt], oa, bq[2 * hh], bq[2 * hh + 1]);
          mma_bf16(s[nt], xa, bk[2 * hh], bk[2 * hh + 1]);
        }
      }
    } else {

    // ---- [Xᵀ | O_interᵀ] = S [K⁺ ; Q⁺]ᵀ and Yᵀ = Vᵀ - Xᵀ
    // Two accumulator sets (even / odd k-steps) halve the dependent HMMA chain; the B fragments of step
    // ks + 1 are loaded before the HMMAs of step ks (ldmatrix and mma are ordered asm).
    float ax[2][4], ao[2][4], ax2[2][4], ao2[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) ax[nt][e] = 0.f, ao[nt][e] = 0.f, ax2[nt][e] = 0.f, ao2[nt][e] = 0.f;
    {
      uint32_t bk[2][4], bq[2][4];
      ldsm_x4(op.kp + toff_b.at(0), bk[0]);
      ldsm_x4(op.qp + toff_b.at(0), bq[0]);
#pragma unroll
      for (int ks = 0; ks < K / 16; ++ks) {
        const int cur = ks & 1;
        if (ks + 1 < K / 16) {
          ldsm_x4(op.kp + toff_b.at(ks + 1), bk[cur ^ 1]);
          ldsm_x4(op.qp + toff_b.at(ks + 1), bq[cur ^ 1]);
        }
        const uint32_t a[4] = {pack_bf16x2(s[2 * ks][0], s[2 * ks][1]), pack_bf16x2(s[2 * ks][2], s[2 * ks][3]),
                               pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                               pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
        float(&x)[2][4] = cur ? ax2 : ax;
        float(&o)[2][4] = cur ? ao2 : ao;
        mma_bf16(x[0], a, bk[cur][0], bk[cur][1]);
        mma_bf16(x[1], a, bk[cur][2], bk[cur][3]);
        mma_bf16(o[0], a, bq[cur][0], bq[cur][1]);
        mma_bf16(o[1], a, bq[cur][2], bq[cur][3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ax[nt][e] += ax2[nt][e], ao[nt][e] += ao2[nt][e];
    }
    // Yᵀ[v][t] = V[t][v] - Xᵀ[v][t] (padding rows: V = 0 and K⁺ = 0, so Y = 0)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int vr = gq + 8 * (e >> 1), t = 8 * nt + 2 * cq + (e & 1);
        ax[nt][e] = bf(vb[t * 16 + vr]) - ax[nt][e];
      }

    // ---- Rᵀ = Yᵀ INVbᵀ; Oᵀ += Rᵀ Mqkᵀ; S = S ⊙ γ_C + Rᵀ Kr
    float ar[2][4];
    {
      const uint32_t ya[4] = {pack_f16(ax[0][0], ax[0][1]), pack_f16(ax[0][2], ax[0][3]),
                              pack_f16(ax[1][0], ax[1][1]), pack_f16(ax[1][2], ax[1][3])};
      uint32_t bi[4];
      load_b16x16(op.invb, lane, bi);
#pragma unroll
      for (int e = 0; e < 4; ++e) ar[0][e] = 0.f, ar[1][e] = 0.f;
      mma_f16(ar[0], ya, bi[0], bi[1]);
      mma_f16(ar[1], ya, bi[2], bi[3]);
    }
    const uint32_t ra[4] = {pack_f16(ar[0][0], ar[0][1]), pack_f16(ar[0][2], ar[0][3]), pack_f16(ar[1][0], ar[1][1]),
                            pack_f16(ar[1][2], ar[1][3])};
    {
      uint32_t bm[4];
      load_b16x16(op.mqk, lane, bm);
      mma_f16(ao[0], ra, bm[0], bm[1]);
      mma_f16(ao[1], ra, bm[2], bm[3]);
      // stage Oᵀ as O[t][v] (16 x 16 bf16) and store this warp's 16 columns per token with 16-byte stores
      __nv_bfloat16* os = sm.ostage[warp];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          os[(8 * nt + 2 * cq + (e & 1)) * 16 + gq + 8 * (e >> 1)] = __float2bfloat16_rn(ao[nt][e]);
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
#pragma unroll
      for (int pp = 0; pp < K / 16; ++pp) {
        uint32_t bb[4];
        ldsm_x4_t(op.kr + toff_t.at(pp), bb);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int nt = 2 * pp + hh;
          const float2 gmm = *reinterpret_cast<const float2*>(op.gamma_c + 8 * nt + 2 * cq);
          s[nt][0] *= gmm.x, s[nt][1] *= gmm.y, s[nt][2] *= gmm.x, s[nt][3] *= gmm.y;
          mma_f16(s[nt], ra, bb[2 * hh], bb[2 * hh + 1]);
        }
      }
    }
    }  // (forward)
    named_arrive(kBarEmpty0 + b, Cfg::kCountEmpty);  // done with chunk c's operands
  }
  cp_async_wait<0>();

  if (p.state != nullptr && sr.len > 0) store_state(p.state, p.state_dtype, write_slot(p, n, 0) * p.state_slot_stride);
  if (p.final_state != nullptr) store_state(p.final_state, DType::kFloat32, n * inner);
}

}  // namespace kda::prefill

namespace kda::prefill {

template <int VB, int STAGES, int RAW_STAGES, bool BWD>
cudaError_t run_chunked_(const RecurrentParams& p, bool out_vec16, int diag, cudaStream_t stream) {
  using Cfg = ChunkedConfig<VB, STAGES, RAW_STAGES>;
  auto kernel = kda_chunked_kernel<VB, STAGES, RAW_STAGES, BWD>;
  constexpr int smem = static_cast<int>(sizeof(ChunkedSmem<VB, STAGES, RAW_STAGES>));
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
  kernel<<<dim3(static_cast<unsigned>(blocks)), Cfg::NT, smem, stream>>>(p, out_vec16, diag);
  return cudaGetLastError();
}

}  // namespace kda::prefill
