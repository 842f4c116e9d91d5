// CUDA training backward of KDA (SPEC §2.1): a deterministic token-serial reverse sweep.
//
// Anatomy (the first correct version, kept as KDA_TRAINING_BACKWARD=serial; the default is the chunked
// backward of training_backward_chunked.cu, which shares kernels 2 and 3):
//
// 1. kda_training_backward_kernel — one CTA per (sequence n, value head hv) task, persistent over
//    tasks (grid = min(tasks, SMs): the per-CTA scratch is bounded by the grid). 256 threads; warp w
//    owns value rows [16w, 16w+16); lane = (rh, kl): rows 16w + 8rh + i (i < 8), columns 8kl + j (j < 8).
//    Each thread keeps an 8x8 fp32 fragment of the state S and of G = dL/dS in registers. Rows of S
//    and G evolve independently given the shared per-token k, q, decay, β, so the row dots (S k, G k)
//    are 16-lane butterflies inside a warp; only dq, dk, da, dβ need sums over rows, done per token
//    through shared memory in a fixed order (no atomics anywhere: bit-identical reruns).
//    Per 64-token chunk, last to first:
//      a. prologue (warp per token): normalised k, decay d = exp(λ σ(A (g + dt_bias))), β = σ(beta),
//         v, into shared memory;
//      b. forward recompute from the tape row: δ_t = v_t - S̄_t k_t kept in shared memory, the state at
//         every 8-token sub-block start saved to this CTA's global scratch (same thread writes and
//         reads it back: no synchronisation needed);
//      c. sub-blocks last to first, tokens last to first: rebuild S̄_t from the sub-block checkpoint by
//         replaying the stored rank-1 updates (bit-identical to step b: same fp32 operations, no
//         contraction), then the §2.1 reverse step; per-token partials of dq, dk, da (per column) and
//         dβ are summed over the 8 warps by threads 0..128, which also apply the gate and beta chain
//         rules and write dg, dβ, and the per-value-head dq/dk (w.r.t. the normalised q/k) to fp32
//         workspace. dA_log / ddt_bias are accumulated per task in a fixed token order.
// 2. kda_training_backward_qk_finish_kernel — warp per (token, q/k head, q|k): GQA sum of the value
//    heads of the group in increasing hv, then the L2-norm backward, bf16 out.
// 3. kda_training_backward_param_finish_kernel — dA_log and ddt_bias summed over the partial rows in order.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "kda/backward/backward_params.h"
#include "kda/backward/backward_common.cuh"
#include "kda/common/recurrent_rules.h"  // kL2NormEps

namespace kda {
namespace {
using namespace bwd;

constexpr int kDim = kBwdDim;
constexpr int kChunk = kTapeChunk;
constexpr int kSub = kBwdSubBlock;
constexpr int kWarps = kBwdThreads / 32;

static_assert(kDim == 128 && kWarps == 8, "the lane layout below assumes 128 rows/cols and 8 warps");
static_assert(kChunk % kSub == 0, "sub-blocks tile the tape chunk");

struct BwdSmem {
  float kn[kChunk][kDim];     // normalised k of the chunk's tokens
  float dd[kChunk][kDim];     // decay exp(a)
  float delta[kChunk][kDim];  // v (after the prologue), then δ = v - S̄ k (after the forward recompute)
  float qn[kSub][kDim];       // normalised q * scale of the current sub-block
  float dos[kSub][kDim];      // dL/do of the current sub-block
  float pbuf[2][kWarps][3][kDim];  // per-warp column partials (dq, dk, da), double-buffered per token
  float pbeta[2][kWarps];          // per-warp dβ partials
  float bs[kChunk];                // β = sigmoid(beta logit)
  float red[kDim];                 // end-of-task dA_log reduction
};

// Sums each of 8 values over the 16 lanes of a half-warp (xor butterfly: every lane gets the
// bit-identical total, since a + b == b + a in IEEE arithmetic).
__device__ __forceinline__ void half_allreduce8(float (&x)[8]) {
#pragma unroll
  for (int o = 1; o <= 8; o <<= 1)
#pragma unroll
    for (int i = 0; i < 8; ++i) x[i] += __shfl_xor_sync(0xffffffffu, x[i], o);
}

__device__ __forceinline__ void ld8(float (&x)[8], const float* src) {
  const float4 a = reinterpret_cast<const float4*>(src)[0];
  const float4 b = reinterpret_cast<const float4*>(src)[1];
  x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
  x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}
__device__ __forceinline__ void st8(float* dst, const float (&x)[8]) {
  reinterpret_cast<float4*>(dst)[0] = make_float4(x[0], x[1], x[2], x[3]);
  reinterpret_cast<float4*>(dst)[1] = make_float4(x[4], x[5], x[6], x[7]);
}

// An 8x8 fragment (rows row0.., cols col0..) of a compact [128, 128] fp32 matrix.
__device__ __forceinline__ void load_frag(float (&F)[8][8], const float* m, int row0, int col0) {
#pragma unroll
  for (int i = 0; i < 8; ++i) ld8(F[i], m + (row0 + i) * kDim + col0);
}
__device__ __forceinline__ void store_frag(float* m, const float (&F)[8][8], int row0, int col0) {
#pragma unroll
  for (int i = 0; i < 8; ++i) st8(m + (row0 + i) * kDim + col0, F[i]);
}
// Scratch layout of one saved state: float4 index (i*2 + h)*256 + tid (coalesced, thread-private).
__device__ __forceinline__ void save_scratch(float* s, const float (&F)[8][8], int tid) {
  float4* s4 = reinterpret_cast<float4*>(s);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    s4[(i * 2 + 0) * kBwdThreads + tid] = make_float4(F[i][0], F[i][1], F[i][2], F[i][3]);
    s4[(i * 2 + 1) * kBwdThreads + tid] = make_float4(F[i][4], F[i][5], F[i][6], F[i][7]);
  }
}
__device__ __forceinline__ void load_scratch(float (&F)[8][8], const float* s, int tid) {
  const float4* s4 = reinterpret_cast<const float4*>(s);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const float4 a = s4[(i * 2 + 0) * kBwdThreads + tid];
    const float4 b = s4[(i * 2 + 1) * kBwdThreads + tid];
    F[i][0] = a.x; F[i][1] = a.y; F[i][2] = a.z; F[i][3] = a.w;
    F[i][4] = b.x; F[i][5] = b.y; F[i][6] = b.z; F[i][7] = b.w;
  }
}

// One forward state step on the fragment, S <- S diag(d) + r kᵀ, with explicit rounding so that the
// forward recompute and the replay in the reverse sweep produce bit-identical states.
__device__ __forceinline__ void replay_step(float (&S)[8][8], const float (&d)[8], const float (&kk)[8],
                                            const float (&r)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j) S[i][j] = __fmaf_rn(r[i], kk[j], __fmul_rn(S[i][j], d[j]));
}

// Column partials of one warp: fold the two row halves (lanes l and l^16), half 0 stores 8 columns.
__device__ __forceinline__ void store_col_partial(float* dst, float (&acc)[8], int rh, int col0) {
#pragma unroll
  for (int j = 0; j < 8; ++j) acc[j] += __shfl_xor_sync(0xffffffffu, acc[j], 16);
  if (rh == 0) st8(dst + col0, acc);
}

__global__ void __launch_bounds__(kBwdThreads, 1) kda_training_backward_kernel(const TrainingBackwardParams p) {
  extern __shared__ float4 smem_raw[];
  BwdSmem& sm = *reinterpret_cast<BwdSmem*>(smem_raw);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, kl = lane & 15, rh = lane >> 4;
  const int row0 = 16 * warp + 8 * rh;
  const int col0 = 8 * kl;
  float* scr = p.scratch + static_cast<int64_t>(blockIdx.x) * kBwdScratchPerCta;
  const int64_t tasks = p.N * p.HV;
  const int group = p.HV / p.H;
  const float lam = p.lower_bound;
  constexpr int64_t kState = int64_t(kDim) * kDim;

  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x) {
    const int64_t n = task / p.HV;
    const int hv = static_cast<int>(task % p.HV);
    const int hq = hv / group;
    const SeqRange s = seq_range(p.cu_seqlens, p.cu_seqlens_int64, p.T, n);
    const float A = __expf(p.A_log[hv]);
    const int64_t state_off = (n * p.HV + hv) * kState;

    float G[8][8];
    if (p.dfinal_state != nullptr) {
      load_frag(G, p.dfinal_state + state_off, row0, col0);
    } else {
#pragma unroll
      for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) G[i][j] = 0.f;
    }
    float ddt_acc = 0.f, dA_acc = 0.f;  // threads < 128: column tid, in reverse token order
    const float dtb_col = (tid < kDim && p.dt_bias != nullptr) ? p.dt_bias[hv * kDim + tid] : 0.f;
    int par = 0;

    const int64_t nc = (s.len + kChunk - 1) / kChunk;
    for (int64_t c = nc - 1; c >= 0; --c) {
      const int64_t t0 = s.bos + c * kChunk;  // first token of the chunk (index along T)
      const int len = static_cast<int>(s.len - c * kChunk < kChunk ? s.len - c * kChunk : kChunk);
      __syncthreads();  // the previous chunk is done with kn/dd/delta/bs

      // a. prologue: warp per token, lane owns elements 4*lane .. 4*lane+3.
      for (int tl = warp; tl < len; tl += kWarps) {
        const int64_t tok = t0 + tl;
        const int64_t ko = p.k.offset(s.batch, tok, hq) + 4 * lane;
        const int64_t go = p.g.offset(s.batch, tok, hv) + 4 * lane;
        const int64_t vo = p.v.offset(s.batch, tok, hv) + 4 * lane;
        float x[4], ss = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          x[e] = ld_bf16(p.k.ptr, ko + e);
          ss = fmaf(x[e], x[e], ss);
        }
        const float rho = rsqrtf(warp_sum32(ss) + kL2NormEps);
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = 4 * lane + e;
          sm.kn[tl][col] = x[e] * rho;
          const float dtb = p.dt_bias != nullptr ? p.dt_bias[hv * kDim + col] : 0.f;
          const float z = A * (ld_bf16(p.g.ptr, go + e) + dtb);
          sm.dd[tl][col] = __expf(lam * sigmoidf_(z));
          sm.delta[tl][col] = ld_bf16(p.v.ptr, vo + e);
        }
        if (lane == 0) sm.bs[tl] = sigmoidf_(ld_bf16(p.beta.ptr, p.beta.offset(s.batch, tok, hv)));
      }
      __syncthreads();

      // b. forward recompute of the chunk from its tape row.
      float S[8][8];
      {
        if (const float* s0 = tape_state(p, n, c, hv)) {  // initial_state for c = 0, else a tape row
          load_frag(S, s0, row0, col0);
        } else {  // no initial_state, or a broken tape_cu_starts contract: never read out of bounds
#pragma unroll
          for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) S[i][j] = 0.f;
        }
      }
      for (int tl = 0; tl < len; ++tl) {
        if (tl % kSub == 0) save_scratch(scr + (tl / kSub) * kState, S, tid);
        float d[8], kk[8], pp[8], vv[8];
        ld8(d, &sm.dd[tl][col0]);
        ld8(kk, &sm.kn[tl][col0]);
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          pp[i] = 0.f;
#pragma unroll
          for (int j = 0; j < 8; ++j) pp[i] = fmaf(__fmul_rn(S[i][j], d[j]), kk[j], pp[i]);
        }
        half_allreduce8(pp);
        ld8(vv, &sm.delta[tl][row0]);
        const float beta = sm.bs[tl];
        float r[8], dl[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          dl[i] = __fsub_rn(vv[i], pp[i]);
          r[i] = __fmul_rn(beta, dl[i]);
        }
        __syncwarp();  // every lane has read v before it is overwritten by δ
        if (kl == 0) st8(&sm.delta[tl][row0], dl);
        replay_step(S, d, kk, r);
      }

      // c. reverse sweep over the sub-blocks.
      const int nsb = (len + kSub - 1) / kSub;
      for (int sb = nsb - 1; sb >= 0; --sb) {
        const int cl = sb * kSub;
        const int bl = len - cl < kSub ? len - cl : kSub;
        __syncthreads();  // δ of the chunk is written; the previous sub-block is done with qn/dos
        if (warp < bl) {
          const int64_t tok = t0 + cl + warp;
          const int64_t qo = p.q.offset(s.batch, tok, hq) + 4 * lane;
          const int64_t oo = p.dout.offset(s.batch, tok, hv) + 4 * lane;
          float x[4], ss = 0.f;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            x[e] = ld_bf16(p.q.ptr, qo + e);
            ss = fmaf(x[e], x[e], ss);
          }
          const float rs = rsqrtf(warp_sum32(ss) + kL2NormEps) * p.scale;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            sm.qn[warp][4 * lane + e] = x[e] * rs;
            sm.dos[warp][4 * lane + e] = ld_bf16(p.dout.ptr, oo + e);
          }
        }
        __syncthreads();

        for (int jj = bl - 1; jj >= 0; --jj) {
          const int tl = cl + jj;
          // Rebuild S̄_t: replay the sub-block's first jj tokens, then decay by d_t.
          float Sb[8][8];
          load_scratch(Sb, scr + sb * kState, tid);
          for (int i2 = 0; i2 < jj; ++i2) {
            const int tr = cl + i2;
            float d2[8], k2[8], r2[8];
            ld8(d2, &sm.dd[tr][col0]);
            ld8(k2, &sm.kn[tr][col0]);
            ld8(r2, &sm.delta[tr][row0]);
            const float b2 = sm.bs[tr];
#pragma unroll
            for (int i = 0; i < 8; ++i) r2[i] = __fmul_rn(b2, r2[i]);
            replay_step(Sb, d2, k2, r2);
          }
          float d[8], kk[8];
          ld8(d, &sm.dd[tl][col0]);
          ld8(kk, &sm.kn[tl][col0]);
#pragma unroll
          for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int j = 0; j < 8; ++j) Sb[i][j] = __fmul_rn(Sb[i][j], d[j]);

          // G += dO qᵀ (q carries scale): G is now dL/dS_t.
          float dO[8];
          {
            float qs[8];
            ld8(qs, &sm.qn[jj][col0]);
            ld8(dO, &sm.dos[jj][row0]);
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
              for (int j = 0; j < 8; ++j) G[i][j] = fmaf(dO[i], qs[j], G[i][j]);
          }
          // u = G k (row dots over the 16 column lanes).
          float u[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            u[i] = 0.f;
#pragma unroll
            for (int j = 0; j < 8; ++j) u[i] = fmaf(G[i][j], kk[j], u[i]);
          }
          half_allreduce8(u);
          const float beta = sm.bs[tl];
          float dl[8], r[8];
          ld8(dl, &sm.delta[tl][row0]);
#pragma unroll
          for (int i = 0; i < 8; ++i) r[i] = __fmul_rn(beta, dl[i]);

          float* pb = &sm.pbuf[par][warp][0][0];
          // dq (before the scale factor): S_tᵀ dO with S_t = S̄ + r kᵀ.
          {
            float rdo = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) rdo = fmaf(r[i], dO[i], rdo);
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              acc[j] = kk[j] * rdo;
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[j] = fmaf(Sb[i][j], dO[i], acc[j]);
            }
            store_col_partial(pb, acc, rh, col0);
          }
          // dβ = uᵀ δ; dv = β u.
          {
            float db = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) db = fmaf(u[i], dl[i], db);
            db += __shfl_xor_sync(0xffffffffu, db, 16);
            if (lane == 0) sm.pbeta[par][warp] = db;
            float uk = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i) uk = kl == i ? u[i] : uk;
            if (kl < 8) {
              const int64_t ti = s.batch * p.T + t0 + tl;
              st_bf16(p.dv, (ti * p.HV + hv) * kDim + row0 + kl, beta * uk);
            }
          }
          float dp[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) dp[i] = -beta * u[i];
          // dk = Gᵀ r + S̄ᵀ dp.
          {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
              acc[j] = 0.f;
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[j] = fmaf(G[i][j], r[i], fmaf(Sb[i][j], dp[i], acc[j]));
            }
            store_col_partial(pb + kDim, acc, rh, col0);
          }
          // dS̄ = G + dp kᵀ; da = Σ_v S̄ ⊙ dS̄ per column; G <- dS̄ diag(d) (= dL/dS_{t-1}).
          {
            float acc[8];
#pragma unroll
            for (int j = 0; j < 8; ++j) acc[j] = 0.f;
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
              for (int j = 0; j < 8; ++j) {
                const float dS = fmaf(dp[i], kk[j], G[i][j]);
                acc[j] = fmaf(Sb[i][j], dS, acc[j]);
                G[i][j] = dS * d[j];
              }
            store_col_partial(pb + 2 * kDim, acc, rh, col0);
          }
          __syncthreads();  // partials of this token are in pbuf[par]

          // Fixed-order sums over the 8 warps and the per-token chain rules.
          const int64_t ti = s.batch * p.T + t0 + tl;
          if (tid < kDim) {
            float dqv = 0.f, dkv = 0.f, dav = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) {
              dqv += sm.pbuf[par][w][0][tid];
              dkv += sm.pbuf[par][w][1][tid];
              dav += sm.pbuf[par][w][2][tid];
            }
            const int64_t o = (ti * p.HV + hv) * kDim + tid;
            p.dq_head[o] = dqv * p.scale;
            p.dk_head[o] = dkv;
            // Lower-bound gate: a = λ σ(z), z = A (g + dt_bias).
            const float z = A * (ld_bf16(p.g.ptr, p.g.offset(s.batch, t0 + tl, hv) + tid) + dtb_col);
            const float sg = sigmoidf_(z);
            const float dz = lam * dav * sg * (1.f - sg);
            const float dgv = A * dz;
            st_bf16(p.dg, o, dgv);
            ddt_acc += dgv;
            dA_acc = fmaf(dz, z, dA_acc);
          } else if (tid == kDim) {
            float db = 0.f;
#pragma unroll
            for (int w = 0; w < kWarps; ++w) db += sm.pbeta[par][w];
            st_bf16(p.dbeta, ti * p.HV + hv, db * beta * (1.f - beta));
          }
          par ^= 1;
        }
      }
    }

    // dinitial_state = G; per-task parameter partials.
    store_frag(p.dinitial_state + state_off, G, row0, col0);
    if (tid < kDim) {
      p.ddt_partial[(n * p.HV + hv) * kDim + tid] = ddt_acc;
      sm.red[tid] = dA_acc;
    }
    __syncthreads();
    if (tid == 0) {
      float a = 0.f;
      for (int k = 0; k < kDim; ++k) a += sm.red[k];
      p.dA_partial[n * p.HV + hv] = a;
    }
    __syncthreads();  // red and pbuf are free for the next task
  }
}

// Warp per (token, q/k head, q|k): GQA sum of the group's value heads (increasing hv), then the
// L2-norm backward dx~ = ρ dx - ρ³ (x~·dx) x~ with ρ = rsqrt(|x~|² + 1e-6).
__global__ void __launch_bounds__(256) kda_training_backward_qk_finish_kernel(const TrainingBackwardParams p) {
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t total = p.B * p.T * p.H * 2;
  if (gw >= total) return;
  const int which = static_cast<int>(gw & 1);  // 0: q, 1: k
  const int64_t rest = gw >> 1;
  const int h = static_cast<int>(rest % p.H);
  const int64_t ti = rest / p.H;
  const int64_t b = ti / p.T, t = ti % p.T;
  const int group = p.HV / p.H;
  void* out = which ? p.dk : p.dq;
  // Packed tokens outside covered_tokens (outside every sequence, for a valid cu_seqlens): their workspace rows
  // may be unwritten; their gradient is 0 (x there is never read: it may hold inf/NaN).
  if (!covered_tokens(p).contains(t)) {
#pragma unroll
    for (int e = 0; e < 4; ++e) st_bf16(out, (ti * p.H + h) * kDim + 4 * lane + e, 0.f);
    return;
  }
  const float* dh = which ? p.dk_head : p.dq_head;
  const TokenTensor& x = which ? p.k : p.q;
  float dx[4] = {0.f, 0.f, 0.f, 0.f};
  for (int g = 0; g < group; ++g) {
    const float* src = dh + (ti * p.HV + h * group + g) * kDim + 4 * lane;
#pragma unroll
    for (int e = 0; e < 4; ++e) dx[e] += src[e];
  }
  const int64_t xo = x.offset(b, t, h) + 4 * lane;
  float xr[4], ss = 0.f, dot = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    xr[e] = ld_bf16(x.ptr, xo + e);
    ss = fmaf(xr[e], xr[e], ss);
    dot = fmaf(xr[e], dx[e], dot);
  }
  ss = warp_sum32(ss);
  dot = warp_sum32(dot);
  const float rho = rsqrtf(ss + kL2NormEps);
  const float c3 = rho * rho * rho * dot;
#pragma unroll
  for (int e = 0; e < 4; ++e) st_bf16(out, (ti * p.H + h) * kDim + 4 * lane + e, rho * dx[e] - c3 * xr[e]);
}

// Zeroes dv, dg, dβ (and dq, dk when the sweep writes them itself) of the packed tokens outside covered_tokens
// (for a valid cu_seqlens: the tokens no sequence covers); runs before the sweep, so a token a broken
// cu_seqlens covers anyway still gets the sweep's values. Packed layout (B = 1); block per token of
// [0, lo) and [hi, T), 16-byte stores.
__global__ void __launch_bounds__(256) kda_training_backward_zero_uncovered_kernel(const TrainingBackwardParams p) {
  const CoveredTokens cov = covered_tokens(p);
  const auto zero = [](void* base, int64_t row, int64_t row_elems) {  // bf16 rows of a multiple of 8 elements
    uint4* r = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(base) + row * row_elems);
    for (int64_t i = threadIdx.x; i < row_elems / 8; i += blockDim.x) r[i] = make_uint4(0u, 0u, 0u, 0u);
  };
  const int64_t uncovered = cov.lo + (p.T - cov.hi);
  for (int64_t i = blockIdx.x; i < uncovered; i += gridDim.x) {
    const int64_t ti = i < cov.lo ? i : cov.hi + (i - cov.lo);
    zero(p.dv, ti, int64_t(p.HV) * kDim);
    zero(p.dg, ti, int64_t(p.HV) * kDim);
    for (int h = threadIdx.x; h < p.HV; h += blockDim.x) st_bf16(p.dbeta, ti * p.HV + h, 0.f);
    if (p.fused_qk) {
      zero(p.dq, ti, int64_t(p.H) * kDim);
      zero(p.dk, ti, int64_t(p.H) * kDim);
    }
  }
}

// dA_log[hv] and ddt_bias[hv, k]: sums over the partial rows in increasing order (deterministic, and the
// same bits on every GPU: the rows follow the shapes, not the SM count).
__global__ void kda_training_backward_param_finish_kernel(const TrainingBackwardParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(p.HV) * kDim) return;
  const int64_t hv = idx / kDim, k = idx % kDim;
  float acc = 0.f;
  for (int64_t r = 0; r < p.partial_rows; ++r) acc += p.ddt_partial[(r * p.HV + hv) * kDim + k];
  p.ddt_bias[idx] = acc;
  if (k == 0) {
    float a = 0.f;
    for (int64_t r = 0; r < p.partial_rows; ++r) a += p.dA_partial[r * p.HV + hv];
    p.dA_log[hv] = a;
  }
}

constexpr int kScanThreads = 1024;

// Rows of one sequence of L tokens: ceil(L / chunk) - first, at least 0.
__device__ __forceinline__ int64_t rows_of(int64_t L, int chunk, int first) {
  const int64_t r = (L + chunk - 1) / chunk - first;
  return r > 0 ? r : 0;
}

__global__ void __launch_bounds__(kScanThreads) kda_tape_cu_starts_kernel(const void* cu, bool i64, int64_t N,
                                                                          int64_t T, int chunk, int first,
                                                                          int64_t* out) {
  __shared__ int64_t part[kScanThreads];
  const int tid = threadIdx.x;
  const int64_t per = (N + kScanThreads - 1) / kScanThreads;
  const int64_t beg = tid * per;
  const int64_t end = beg + per < N ? beg + per : N;
  int64_t local = 0;
  for (int64_t n = beg; n < end; ++n) local += rows_of(seq_range(cu, i64, T, n).len, chunk, first);
  part[tid] = local;
  __syncthreads();
  if (tid == 0) {
    int64_t run = 0;
    for (int i = 0; i < kScanThreads; ++i) {
      const int64_t x = part[i];
      part[i] = run;
      run += x;
    }
    out[0] = 0;
  }
  __syncthreads();
  int64_t run = part[tid];
  for (int64_t n = beg; n < end; ++n) {
    run += rows_of(seq_range(cu, i64, T, n).len, chunk, first);
    out[n + 1] = run;
  }
}

__global__ void __launch_bounds__(256) kda_zero_rows_past_kernel(float* x, int64_t rows, int64_t row_elems,
                                                                  const int64_t* starts, int64_t N) {
  const int64_t first = starts[N] < 0 ? 0 : starts[N];
  for (int64_t r = first + blockIdx.y; r < rows; r += gridDim.y) {
    float4* row = reinterpret_cast<float4*>(x + r * row_elems);
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < row_elems / 4;
         i += int64_t(gridDim.x) * blockDim.x)
      row[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

}  // namespace

int64_t training_backward_smem_bytes() {
  return training_backward_use_chunked() ? training_backward_chunked_smem_bytes()
                                         : static_cast<int64_t>(sizeof(BwdSmem));
}

bool training_backward_use_chunked() {
  static const bool chunked = [] {
    const char* e = std::getenv("KDA_TRAINING_BACKWARD");
    return !(e != nullptr && std::strcmp(e, "serial") == 0);
  }();
  return chunked;
}

cudaError_t launch_training_backward(const TrainingBackwardParams& p, cudaStream_t stream) {
  const int smem = static_cast<int>(sizeof(BwdSmem));
  cudaError_t err =
      cudaFuncSetAttribute(kda_training_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  // fused_qk (the sweep writes dq/dk itself) needs the chunked sweep and no GQA group: the token-serial sweep
  // writes per-head dq/dk to the workspace, and with HV > H several value heads would write one dq row.
  if (p.fused_qk && (!training_backward_use_chunked() || p.HV != p.H)) return cudaErrorInvalidValue;
  if (p.cu_seqlens != nullptr && p.B * p.T > 0) {  // the fixed layout covers every token
    if (p.B != 1) return cudaErrorInvalidValue;     // packed calls have B = 1
    const int64_t blocks = std::min<int64_t>(p.T, 512);  // (blocks past the uncovered tokens exit at once)
    kda_training_backward_zero_uncovered_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.grid > 0) {
    if (training_backward_use_chunked()) {
      if (p.partial_rows != p.n_slots) return cudaErrorInvalidValue;  // one partial row per task slot
      err = launch_training_backward_chunked_sweep(p, stream);
      if (err != cudaSuccess) return err;
    } else if (p.N * p.HV > 0) {
      if (p.partial_rows != p.N) return cudaErrorInvalidValue;  // one partial row per sequence
      kda_training_backward_kernel<<<p.grid, kBwdThreads, smem, stream>>>(p);
    }
  }
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const int64_t warps = p.B * p.T * p.H * 2;
  if (warps > 0 && !p.fused_qk) {
    const int64_t blocks = (warps * 32 + 255) / 256;
    kda_training_backward_qk_finish_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (p.HV > 0) {
    const int64_t threads = int64_t(p.HV) * kDim;
    kda_training_backward_param_finish_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

cudaError_t launch_tape_cu_starts(const void* cu_seqlens, bool cu_seqlens_int64, int64_t N, int64_t T,
                                  int64_t* tape_cu_starts, cudaStream_t stream, int chunk, int first) {
  if (chunk <= 0 || first < 0) return cudaErrorInvalidValue;
  kda_tape_cu_starts_kernel<<<1, kScanThreads, 0, stream>>>(cu_seqlens, cu_seqlens_int64, N, T, chunk, first,
                                                            tape_cu_starts);
  return cudaGetLastError();
}

cudaError_t launch_zero_rows_past(float* x, int64_t rows, int64_t row_elems, const int64_t* starts, int64_t N,
                                  cudaStream_t stream) {
  if (rows <= 0 || row_elems <= 0) return cudaSuccess;
  if (row_elems % 4 != 0) return cudaErrorInvalidValue;
  // blockIdx.y strides over rows, blockIdx.x over a row: rows past the sequences are few (at most about N)
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((row_elems / 4 + 255) / 256, 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 16)));
  kda_zero_rows_past_kernel<<<grid, 256, 0, stream>>>(x, rows, row_elems, starts, N);
  return cudaGetLastError();
}

}  // namespace kda
