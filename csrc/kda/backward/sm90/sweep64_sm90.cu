// The Hopper (sm_90a) chunk-parallel backward sweep of the CUDA training backward: one CTA task per (64-token tape
// chunk, value head), the state products on wgmma at M = 64. The algebra is chunk_backward_blocked of
// kda_ops/reference_chunked_backward.py (a 64-token chunk in 16-token blocks, every exponent factored so that no
// factor exceeds 1 outside the diagonal blocks); the earlier sweep (sweep.cu) walks the four 16-token sub-chunks of
// the same task one after the other and needs the chain's dS every 16 tokens, this one needs S_0 (the state
// entering the chunk: initial_state or a tape row) and dS_C (the chain gradient at the chunk's end, every 64
// tokens: BackwardChainParams::dstate_every = 64, rows = the task slots) only.
//
// Per task (q̂ = q ρ_q · scale, k̂ = k ρ_k; γ, σ the inclusive prefix and exclusive suffix of the log-decay a within
// each 16-token block, T_b the block totals, P_I = Σ_{b<I} T_b, Q_J = Σ_{b>J} T_b, D_IJ = e^{Σ_{J<b<I} T_b}):
//   K⁺ = k̂ e^{γ+P}, Kr = k̂ e^{σ+Q}, g_C = e^{Σ T_b};
//   L, Mqk (64 x 64, 3xTF32 mma.sync): off-diagonal blocks (k̂_i e^{γ_i} D_IJ)·(k̂_j e^{σ_j}); diagonal blocks with
//     the block's middle-token reference (each factor <= e^{40}) or, in a "wide" block of an unbounded gate, exact
//     pairwise exponents on CUDA cores (as sweep.cu);
//   INV = (I + diag(β) L)^{-1} in fp32 (diagonal blocks by substitution, then the off-diagonal ones);
//   Xᵀ = S_0 K⁺ᵀ, dRᵀ = dS_C Krᵀ + dOᵀ Mqk: wgmma with the state rows as the register A operand (WG w: value
//     rows [64w, 64w + 64)), both operands split into bf16 hi + lo parts (three products: ~16-bit operands, as
//     dβ = dY · (V - X) of a cancelling one-token sequence needs); dOᵀ Mqk SS (dO exact, Mqk hi + lo tiles);
//   Rᵀ = Yᵀ INVᵀ, dYᵀ = dRᵀ INV: RS wgmma, the accumulators as the register A operands, INV as hi + lo tiles read
//     K-major and MN-major; then R and dY as hi + lo bf16 tiles;
//   dA = -stril(dY Rᵀ), dMqk = tril(dO Rᵀ): SS wgmma, each warpgroup 32 of the 64 token columns;
//   dQ⁺ᵀ = S_0ᵀ dOᵀ, dK⁺ᵀ = -S_0ᵀ (β dY)ᵀ, dKrᵀ = dS_Cᵀ Rᵀ: wgmma with the transposed state as the A operand
//     (WG w: channels [64w, 64w + 64)), every operand but dO (exact) split hi/lo;
//   the pair terms on wgmma, folded into the dQ⁺ / dK⁺ / dKr accumulators by a Horner walk over the 16-token blocks
//     (every step's factor <= 1; operands bf16 hi + lo; pairwise on CUDA cores in wide diagonal blocks), dq, dk, dΓ
//     per element, dβ, the L2-norm backward, da = reverse cumsum of dΓ and the gate's chain rule (dv comes with dY).
// The state is read from global memory (L2) straight into the wgmma A fragments (no shared-memory copy of it).
// No atomics: every sum has a fixed order; the parameter partials are one row per task (as sweep.cu).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include "kda/backward/backward_common.cuh"
#include "kda/backward/backward_params.h"
#include "kda/backward/tf32_mma.cuh"
#include "kda/common/cuda_check.h"
#include "kda/common/device_info.h"
#include "kda/common/gmma_swizzle.cuh"
#include "kda/common/ptx.cuh"
#include "kda/common/recurrent_rules.h"  // kL2NormEps
#include "kda/route/knobs.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDA_SWEEP64_DEVICE 1
#endif

namespace kda {
namespace sweep64 {
namespace {
using namespace cute;
using namespace ::kda::bwd;
using bf16_t = cutlass::bfloat16_t;

constexpr int kT = kTapeChunk;  // tokens per task
constexpr int kD = kBwdDim;     // K = V = 128
constexpr int kB = 16;          // tokens per block
constexpr int kNB = kT / kB;
constexpr int kThreads = 256;  // two warpgroups
constexpr int kLDF = kD + 4;   // fp32 [token][channel] rows
constexpr int kLDH = kD + 8;   // bf16 [token][channel] rows (272 bytes: 16-byte aligned)
static_assert(kT == 64 && kD == 128 && kNB == 4, "the layouts below assume 64-token tasks and 128 channels");
// The widest |γ| of a lower-bound gate block that takes the middle-token reference: 16 |λ| for the contract's
// λ >= -5 (each factor then <= e^{40}, e^{γ} >= e^{-80} a normal fp32 number); wider only if λ < -5 reached the kernel.
constexpr float kLowerBoundSpan = 80.f;

// wgmma operand tiles: [64 tokens][128], K-major, 128-byte swizzle (16 KB, 1024-byte aligned).
using LayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_64, _128>{}));
static_assert(cosize_v<LayoutTile> == kT * kD, "tile size");
using MmaRS = SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
using MmaSS = SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;  // dA, dMqk: N halves
// 64 x 64 token-by-token operands (Mqk, INV) as bf16 tiles [row][column], 128-byte swizzle (8 KB): read as K-major
// (element (n, k) = tile[n][k]) or, the same bytes, as MN-major (element (mn, k) = tile[k][mn]).
using LayoutSq = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_64, _64>{}));
using LayoutSqT = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16_t>{}, Shape<_64, _64>{}));
static_assert(cosize_v<LayoutSq> == kT * kT && cosize_v<LayoutSqT> == kT * kT, "square tile size");
using MmaRSt = SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>;   // dY = dR INV
using MmaSSt = SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::MN>;  // dOᵀ Mqk; columns
using MmaSSr = SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<GMMA::Major::MN, GMMA::Major::K>;   // the pair terms' rows

// 64 x 64 lower-block-triangular matrices: the 16 x 16 blocks (I, J), I >= J, packed row by row.
__host__ __device__ constexpr int tri_block(int I, int J) {
  return I * (I + 1) / 2 + J;
}
constexpr int kTriFloats = tri_block(kNB, 0) * kB * kB;
__device__ __forceinline__ int tri(int i, int j) {
  return (tri_block(i >> 4, j >> 4) << 8) + ((i & 15) << 4) + (j & 15);
}
// m(i, j), 0 in the blocks above the diagonal (never stored)
__device__ __forceinline__ float tri_at(const float* m, int i, int j) {
  return (j >> 4) > (i >> 4) ? 0.f : m[tri(i, j)];
}

// Where a task's data lives: its sequence n (-1: an unused slot), its chunk c within the sequence, the sequence's
// token range and the state rows S_0 and dS_C (null: zeros). (An L2 prefetch of the next task's states and token
// rows made the sweep slower: 13.0 ms with it, 12.2 without, at H=96 T=8192 on an H100.)
struct TaskRef {
  int64_t n, c;
  SeqRange s;
  const float* S0;
  const float* dS;
};

struct alignas(1024) Smem {
  // (in order of use within a task; the pair terms' operands after dKr)
  bf16_t kp_hi[kT * kD];  // K⁺, Kr (hi parts); R's lo part; Kσ hi; Kgβ lo; with kp_lo, the fp32 dq̂ scratch [64][128]
  bf16_t kp_lo[kT * kD];  // K⁺, Kr (lo parts); dY's lo part; Kσ lo
  bf16_t r[kT * kD];   // raw gate rows; Mqk (hi, lo: LayoutSq); R [t][v] (hi); dMqk (hi, lo); with dy, the dk̂ scratch
  bf16_t dy[kT * kD];  // INV (hi, lo: LayoutSq); dY [t][v] (hi part); dA (hi, lo)
  bf16_t dO[kT * kD];  // dO [t][v]; Kgβ hi
  __nv_bfloat16 q[kT * kLDH], k[kT * kLDH];             // raw q, k (0 past the chunk's end)
  float eg[kT * kLDF];                                  // e^{γ}; dΓ at the end
  float es[kT * kLDF];                                  // e^{σ}; the Qg tiles (hi, lo) in the pair terms
  float L[kTriFloats], M[kTriFloats], INV[kTriFloats];  // M: Mqk, then dMqk; INV: INV, then dA
  union {
    float tmp[3 * kB * kB];  // D_IJ of the six off-diagonal block pairs [6][128] (L, Mqk); the inverse's blocks
    struct {
      float ext[kD];  // extra dΓ of the last token
      float part[2][kD];
    } fin;  // (after the inverse)
  };
  float beta[kT], rq[kT], rq0[kT], rk[kT];  // β; ρ_q · scale, ρ_q, ρ_k
  float etb[kNB][kD];                       // e^{T_b}
  float ep[kNB][kD], eq[kNB][kD];           // e^{P_I}, e^{Q_J}
  float iem[kNB][kD];                       // e^{-γ_mid} of each block (narrow blocks)
  float dbp[8][kT];                         // dY · (V - X) partial sums per warp
  TaskRef ref[2];  // the task's own (ref[cur]) and the CTA's next task's (ref[cur ^ 1]), written by thread 0
  int issued;      // the task's token loads were issued during the da walk of the task before
};
// the pair terms' Qg tiles (hi, lo: two 16 KB wgmma tiles) over e^{σ}
static_assert(offsetof(Smem, es) % 1024 == 0 && sizeof(Smem::es) >= 2 * sizeof(Smem::kp_hi), "Qg tiles over e^{σ}");
// (227 KiB per block on sm_90: the launcher adds 1024 bytes to align the tiles)
static_assert(sizeof(Smem) + 1024 <= 227 * 1024, "shared memory per block");
static_assert(sizeof(Smem::tmp) >= 6 * kD * sizeof(float), "D_IJ of six block pairs in tmp");

__device__ __forceinline__ float kh(const Smem& sm, int t, int c) {
  return __bfloat162float(sm.k[t * kLDH + c]) * sm.rk[t];
}
__device__ __forceinline__ float qh(const Smem& sm, int t, int c) {
  return __bfloat162float(sm.q[t * kLDH + c]) * sm.rq[t];
}
__device__ __forceinline__ float egv(const Smem& sm, int t, int c) {
  return sm.eg[t * kLDF + c];
}
__device__ __forceinline__ float esv(const Smem& sm, int t, int c) {
  return sm.es[t * kLDF + c];
}
// Four consecutive columns c0..c0+3 (c0 a multiple of 4) of the rows above, by 16-byte (fp32) or 8-byte (bf16) loads:
// a warp reading consecutive pieces of a row is then conflict-free. Products elementwise, left to right.
struct F4 {
  float v[4];
};
__device__ __forceinline__ F4 f4(float4 a) {
  return {{a.x, a.y, a.z, a.w}};
}
__device__ __forceinline__ F4 ld4(const float* p) {
  return f4(*reinterpret_cast<const float4*>(p));
}
__device__ __forceinline__ F4 operator*(F4 a, const F4& b) {
#pragma unroll
  for (int e = 0; e < 4; ++e) a.v[e] *= b.v[e];
  return a;
}
__device__ __forceinline__ F4 operator*(float a, F4 b) {
#pragma unroll
  for (int e = 0; e < 4; ++e) b.v[e] = a * b.v[e];
  return b;
}
__device__ __forceinline__ F4 bf16x4(const __nv_bfloat16* p) {  // (8-byte aligned)
  const uint2 u = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&u.y));
  return {{a.x, a.y, b.x, b.y}};
}
__device__ __forceinline__ F4 kh4(const Smem& sm, int t, int c0) {
  const float r = sm.rk[t];
  return bf16x4(sm.k + t * kLDH + c0) * F4{{r, r, r, r}};
}
__device__ __forceinline__ F4 qh4(const Smem& sm, int t, int c0) {
  const float r = sm.rq[t];
  return bf16x4(sm.q + t * kLDH + c0) * F4{{r, r, r, r}};
}
__device__ __forceinline__ F4 eg4(const Smem& sm, int t, int c0) {
  return ld4(sm.eg + t * kLDF + c0);
}
__device__ __forceinline__ F4 es4(const Smem& sm, int t, int c0) {
  return ld4(sm.es + t * kLDF + c0);
}
// m(i, j0..j0+3) of a packed lower-block-triangular matrix (j0 a multiple of 4: one block), 0 above the diagonal blocks
__device__ __forceinline__ F4 tri4(const float* m, int i, int j0) {
  return (j0 >> 4) > (i >> 4) ? F4{{0.f, 0.f, 0.f, 0.f}} : ld4(m + tri(i, j0));
}

// bf16 hi + lo split of x (x - hi exact in fp32), two values packed per 32-bit register (low half: first)
__device__ __forceinline__ void split2(float x0, float x1, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(x0, x1);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __floats2bfloat162_rn(x0 - hf.x, x1 - hf.y);
  hi = *reinterpret_cast<const uint32_t*>(&h);
  lo = *reinterpret_cast<const uint32_t*>(&l);
}

// The profile (KDA_EXPERIMENT=sweep64_profile=1, launch_training_backward_sweep64): clock cycles per phase, summed over
// CTA 0's tasks, measured by its thread 0 (so a phase includes its waits at the barriers); slot kProfSegs counts the
// tasks.
enum ProfSeg : int {
  kPfSetup,
  kPfLoadWait,
  kPfGate,
  kPfNorms,
  kPfPairMatrices,
  kPfXStart,
  kPfInverseDiag,
  kPfInverse,
  kPfXWaitKr,
  kPfDR,
  kPfRdY,
  kPfDaDmDqDk,
  kPfDKr,
  kPfPairTerms,
  kPfDGamma,
  kPfDBetaL2,
  kPfDa,
  kProfSegs
};
constexpr const char* kProfNames[kProfSegs] = {
    "setup", "load+wait",  "gate",        "norms", "L/Mqk+K+",   "X start", "inverse diag", "inverse rest", "X wait+Kr",
    "dR",    "R/dY/dbeta", "dA/dM/dQ/dK", "dKr",   "pair terms", "dgam",    "dbeta+l2",     "da+partials"};
__device__ unsigned long long kda_sweep64_prof[kProfSegs + 1];
// kOn: the kernel's profiling instantiation (KDA_EXPERIMENT=sweep64_profile=1); the other compiles the clocks out, so
// that their registers (a flag and a 64-bit time held across every phase) do not add to the production kernel's spills
// (ptxas -v of both: benchmarks/profiling/sweep64_code_size.py)
template <bool kOn>
struct Prof {
  bool on = false;
  long long t = 0;
  __device__ __forceinline__ void start(bool o) {
    if constexpr (kOn) {
      on = o;
      if (on) t = clock64(), kda_sweep64_prof[kProfSegs] += 1;
    }
  }
  __device__ __forceinline__ void mark(int seg) {
    if constexpr (kOn) {
      if (on) {
        const long long now = clock64();
        kda_sweep64_prof[seg] += static_cast<unsigned long long>(now - t);
        t = now;
      }
    }
  }
};

// Issues acc += A_hi·B_hi + A_hi·B_lo + A_lo·B_hi (not waited): the wgmma products of two operands split in
// bf16 hi + lo parts, A in registers (RS) or shared memory (SS).
template <class M, class TA1, class TA2, class TB1, class TB2, class TC>
__device__ __forceinline__ void split3(M& mma, TA1&& a_hi, TA2&& a_lo, TB1&& b_hi, TB2&& b_lo, TC& acc) {
  gemm(mma, a_hi, b_hi, acc);
  gemm(mma, a_hi, b_lo, acc);
  gemm(mma, a_lo, b_hi, acc);
}
// Clears the accumulators and fences them for the next wgmma batch.
template <class... TC>
__device__ __forceinline__ void clear_fenced(TC&... accs) {
  (clear(accs), ...);
  (warpgroup_fence_operand(accs), ...);
}
// Clears acc and opens a wgmma batch reading the register operands a_hi, a_lo.
template <class TA, class TC>
__device__ __forceinline__ void open_batch(TA& a_hi, TA& a_lo, TC& acc) {
  warpgroup_fence_operand(a_hi);
  warpgroup_fence_operand(a_lo);
  clear_fenced(acc);
  warpgroup_arrive();
}

struct Task {
  SeqRange s;
  int hv, hq;
  float A;          // exp(A_log[hv]) (0 for the precomputed gate)
  int64_t t0;       // the chunk's first token (index along T)
  int len;          // tokens of the chunk (1..64)
  const float* S0;  // the state entering the chunk, [sd][sd] (null: zeros)
  const float* dS;  // dS_C, [128][128] (null: zeros)
};

// The log-decay a of an unbounded gate from its input x (g + dt_bias), in nats. Not inlined: the call sites are in
// unrolled loops, and its code (softplus) at each of them made the kernel several times larger than the
// instruction cache. Scalars only (a reference to the kernel parameters would put them in local memory).
__device__ __noinline__ float unbounded_gate(bool softplus, float x, float A) {
  return unbounded_log_decay(softplus, x, A);
}
// The log-decay of input x (g + dt_bias) in nats: the lower-bound gate inline (two instructions' worth), the others
// through the call above.
__device__ __forceinline__ float gate_value(GateMode mode, float lower_bound, float A, float x) {
  if (mode == GateMode::kLowerBound) return lower_bound * sigmoidf_(A * x);
  return unbounded_gate(mode == GateMode::kSoftplus, x, A);
}
// The log-decay of token t (0 past the chunk's end, len tokens) of one channel's gate input column (g_col: the
// channel's element at the chunk's first token, token_stride apart), read from global memory: the wide blocks'
// pairwise paths (load_chunk reads the gate rows once, from shared memory). Not inlined, for the same reason; scalars
// only, as above.
__device__ __noinline__ float log_decay(const __nv_bfloat16* g_col, int64_t token_stride, int len, int t, float dtb,
                                        GateMode mode, float lower_bound, float A) {
  if (t >= len) return 0.f;
  return gate_value(mode, lower_bound, A, __bfloat162float(g_col[t * token_stride]) + dtb);
}
// log_decay of token t, channel c of a task.
__device__ __forceinline__ float log_decay_at(const TrainingBackwardParams& p, const Task& tk, int t, int c,
                                              float dtb) {
  return log_decay(p.g.row<__nv_bfloat16>(tk.s.batch, tk.t0, tk.hv) + c, p.g.token_stride, tk.len, t, dtb, p.gate_mode,
                   p.lower_bound, tk.A);
}
__device__ __forceinline__ float dt_bias_at(const TrainingBackwardParams& p, const Task& tk, int c) {
  return p.dt_bias != nullptr ? p.dt_bias[tk.hv * kD + c] : 0.f;
}

__device__ TaskRef resolve_task(const TrainingBackwardParams& p, int64_t task) {
  TaskRef r{};
  const int64_t slot = task / p.HV;
  const int hv = static_cast<int>(task % p.HV);
  r.n = slot_sequence(p.slot_cu_starts, p.N, slot);
  if (r.n < 0) return r;
  r.c = slot - p.slot_cu_starts[r.n];
  r.s = seq_range(p.cu_seqlens, p.cu_seqlens_int64, p.T, r.n);
  if (r.c < 0 || r.c * kT >= r.s.len) {
    r.n = -1;
    return r;
  }
  r.S0 = tape_state(p, r.n, r.c, hv);
  r.dS = slot < p.n_dstate_rows ? p.dstates + (slot * p.HV + hv) * kD * kD : nullptr;
  return r;
}

// resolve_task, not inlined: it runs rarely (a CTA's first task, after an unused slot, where the next task starts
// another sequence), so its search loop stays out of the task body's code. The fields it reads as scalars (a
// reference to the kernel parameters would put them in local memory).
__device__ __noinline__ TaskRef resolve_task_call(int64_t task, int64_t B, int64_t T, int64_t N, int HV,
                                                  const int64_t* slot_cu_starts, const void* cu_seqlens, bool cu64,
                                                  const float* initial_state, int state_dim, const float* tapes,
                                                  int64_t n_tape_rows, const int64_t* tape_cu_starts,
                                                  const float* dstates, int64_t n_dstate_rows) {
  TrainingBackwardParams q;
  q.B = B, q.T = T, q.N = N, q.HV = HV;
  q.slot_cu_starts = slot_cu_starts, q.cu_seqlens = cu_seqlens, q.cu_seqlens_int64 = cu64;
  q.initial_state = initial_state, q.state_dim = state_dim;
  q.tapes = tapes, q.n_tape_rows = n_tape_rows, q.tape_cu_starts = tape_cu_starts;
  q.dstates = dstates, q.n_dstate_rows = n_dstate_rows;
  return resolve_task(q, task);
}
__device__ __forceinline__ TaskRef resolve_task_of(const TrainingBackwardParams& p, int64_t task) {
  return resolve_task_call(task, p.B, p.T, p.N, p.HV, p.slot_cu_starts, p.cu_seqlens, p.cu_seqlens_int64,
                           p.initial_state, p.state_dim, p.tapes, p.n_tape_rows, p.tape_cu_starts, p.dstates,
                           p.n_dstate_rows);
}

// resolve_task of `task` given the CTA's current task (cur, of cur_task; cur.n >= 0): sequence n's slots are
// slot_cu_starts[n] + [0, ceil(len / 64)) (launch_tape_cu_starts with first = 0), so a slot of the same sequence needs
// no search over slot_cu_starts and no cu_seqlens reads (only the tape row's start, when c > 0).
__device__ TaskRef resolve_next(const TrainingBackwardParams& p, int64_t task, const TaskRef& cur, int64_t cur_task) {
  const int64_t slot = task / p.HV, c = slot - (cur_task / p.HV - cur.c);
  if (c < 0 || c * kT >= cur.s.len) return resolve_task_of(p, task);
  const int hv = static_cast<int>(task % p.HV);
  TaskRef r = cur;
  r.c = c;
  r.S0 = tape_state(p, r.n, c, hv);
  r.dS = slot < p.n_dstate_rows ? p.dstates + (slot * p.HV + hv) * kD * kD : nullptr;
  return r;
}

// A task's fields from its TaskRef (ref.n >= 0).
__device__ Task make_task(const TrainingBackwardParams& p, const TaskRef& ref, int64_t task) {
  Task tk;
  tk.hv = static_cast<int>(task % p.HV);
  tk.s = ref.s;
  tk.hq = tk.hv / (p.HV / p.H);
  tk.A = p.A_log != nullptr ? __expf(p.A_log[tk.hv]) : 0.f;
  tk.t0 = tk.s.bos + ref.c * kT;
  tk.len = static_cast<int>(tk.s.len - ref.c * kT < kT ? tk.s.len - ref.c * kT : kT);
  tk.S0 = ref.S0;
  tk.dS = ref.dS;
  return tk;
}

// A task's token rows into shared memory, issued as one cp.async group (load_chunk waits for it): raw q, k rows
// (padded), the dO tile and the raw gate rows (in the R tile, free until R is formed), 16-byte pieces, zeros past the
// end. Issued by the CTA's task before (the dO tile after its pair terms, the rest in its da walk, where those tiles
// are dead), so that their latency hides behind it; by the task itself when it is the CTA's first or follows an unused
// slot.
// kParts: the tensors to load, bit i for q, k, dO, g (kAllRows: all four).
constexpr int kRowsQ = 1, kRowsK = 2, kRowsDO = 4, kRowsG = 8, kAllRows = 15;
template <int kParts>
__device__ void issue_token_loads(Smem& sm, const TrainingBackwardParams& p, const Task& tk) {
  const int tid = threadIdx.x;
  __nv_bfloat16* const graw = reinterpret_cast<__nv_bfloat16*>(sm.r);  // [64][128]
  {
    // thread: 16-byte piece tid % 16 of tokens tid / 16 + 16 u of each tensor, from the tensors' rows at the chunk's
    // first token (row pointers and token strides formed once; a token past the end reads nothing)
    const int piece = tid & 15, t_lo = tid >> 4;
    const __nv_bfloat16* const base[4] = {p.q.row<__nv_bfloat16>(tk.s.batch, tk.t0, tk.hq) + 8 * piece,
                                          p.k.row<__nv_bfloat16>(tk.s.batch, tk.t0, tk.hq) + 8 * piece,
                                          p.dout.row<__nv_bfloat16>(tk.s.batch, tk.t0, tk.hv) + 8 * piece,
                                          p.g.row<__nv_bfloat16>(tk.s.batch, tk.t0, tk.hv) + 8 * piece};
    const int64_t ts[4] = {p.q.token_stride, p.k.token_stride, p.dout.token_stride, p.g.token_stride};
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const int which = j >> 2, t = t_lo + 16 * (j & 3);
      if (!((kParts >> which) & 1)) continue;
      const bool ok = t < tk.len;
      const __nv_bfloat16* src = base[which] + (ok ? t : 0) * ts[which];
      void* dst = which == 0   ? static_cast<void*>(sm.q + t * kLDH + 8 * piece)
                  : which == 1 ? static_cast<void*>(sm.k + t * kLDH + 8 * piece)
                  : which == 2 ? static_cast<void*>(sm.dO + swz_offset(LayoutTile{}, t, 8 * piece))
                               : static_cast<void*>(graw + t * kD + 8 * piece);
      ptx::cp_async_16(dst, src, ok);
    }
  }
  ptx::cp_async_commit();
}

// The wide flags of a task's four blocks as bits of one register (a bool array indexed in rolled loops lived in
// local memory)
struct WideBlocks {
  unsigned bits = 0;
  __device__ __forceinline__ bool operator[](int b) const { return (bits >> b) & 1u; }
};

// Gate, β, norms, the block factors, once the task's token loads (issue_token_loads) are in. Returns the wide flags of
// the four blocks (CTA-uniform): an unbounded gate's block with some |γ| > kNarrowSpan (or NaN) takes the pairwise
// exponents.
template <class P>
__device__ void load_chunk(Smem& sm, const TrainingBackwardParams& p, const Task& tk, WideBlocks& wide, P& prof) {
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const __nv_bfloat16* const graw = reinterpret_cast<const __nv_bfloat16*>(sm.r);  // [64][128]
  if (tid < kT) {
    float b = 0.f;
    if (tid < tk.len) {
      const float x = ld_bf16(p.beta.ptr, p.beta.offset(tk.s.batch, tk.t0 + tid, tk.hv));
      b = p.beta_is_logit ? sigmoidf_(x) : x;
    }
    sm.beta[tid] = b;
  }
  const float dtb = dt_bias_at(p, tk, tid & 127);
  ptx::cp_async_wait<0>();
  __syncthreads();
  prof.mark(kPfLoadWait);
  // gate: thread (channel c, blocks 2h and 2h + 1): γ by prefix sums, σ by suffix sums (no cancellation)
  unsigned w2 = 0;  // bit bb: block 2h + bb is wide
  {
    const int c = tid & 127, h = tid >> 7;
#pragma unroll 1
    for (int bb = 0; bb < 2; ++bb) {  // (rolled: this code runs once per task, and its size costs fetch time)
      const int b = 2 * h + bb;
      float av[kB], gam[kB], run = 0.f;
#pragma unroll
      for (int u = 0; u < kB; ++u) av[u] = __bfloat162float(graw[(kB * b + u) * kD + c]);
      if (p.gate_mode == GateMode::kLowerBound) {
#pragma unroll
        for (int u = 0; u < kB; ++u) av[u] = p.lower_bound * sigmoidf_(tk.A * (av[u] + dtb));
      } else {
#pragma unroll
        for (int u = 0; u < kB; ++u) av[u] = unbounded_gate(p.gate_mode == GateMode::kSoftplus, av[u] + dtb, tk.A);
      }
#pragma unroll
      for (int u = 0; u < kB; ++u) av[u] = kB * b + u < tk.len ? av[u] : 0.f;
#pragma unroll
      for (int u = 0; u < kB; ++u) run += av[u], gam[u] = run;
      float suf = 0.f;
      bool w = false, wl = false;
#pragma unroll
      for (int u = kB - 1; u >= 0; --u) {
        const int o = (kB * b + u) * kLDF + c;
        sm.eg[o] = __expf(gam[u]);
        sm.es[o] = __expf(suf);
        suf += av[u];
        w = w || !(fabsf(gam[u]) <= kNarrowSpan);
        wl = wl || !(fabsf(gam[u]) <= kLowerBoundSpan);
      }
      sm.etb[b][c] = __expf(run);
      sm.iem[b][c] = __expf(-gam[kB / 2]);
      // (the lower-bound gate's blocks are narrow for λ >= -5, |γ| < 80; wider only for a λ the op refuses)
      w2 |= unsigned(p.gate_mode != GateMode::kLowerBound ? w : wl) << bb;
    }
  }
  wide.bits = 0;
#pragma unroll
  for (int b = 0; b < kNB; ++b)
    wide.bits |= unsigned(__syncthreads_or((tid >> 7) == (b >> 1) && ((w2 >> (b & 1)) & 1u)) != 0) << b;
  prof.mark(kPfGate);
  // norms: warp per token
#pragma unroll 2
  for (int t = warp; t < kT; t += kThreads / 32) {  // (two tokens' shuffles interleaved)
    float sk = 0.f, sq = 0.f;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float kx = __bfloat162float(sm.k[t * kLDH + 4 * lane + e]),
                  qx = __bfloat162float(sm.q[t * kLDH + 4 * lane + e]);
      sk = fmaf(kx, kx, sk);
      sq = fmaf(qx, qx, sq);
    }
    sk = warp_sum32(sk);
    sq = warp_sum32(sq);
    if (lane == 0) {
      const float rk = p.use_qk_l2norm ? rsqrtf(sk + kL2NormEps) : 1.f;
      const float r0 = p.use_qk_l2norm ? rsqrtf(sq + kL2NormEps) : 1.f;
      sm.rk[t] = rk, sm.rq0[t] = r0, sm.rq[t] = r0 * p.scale;
    }
  }
  if (tid < kD) {  // e^{P_I}, e^{Q_J} as products of block factors (each <= 1)
    const int c = tid;
    float pre = 1.f, post = 1.f;
    for (int b = 0; b < kNB; ++b) {
      sm.ep[b][c] = pre;
      pre *= sm.etb[b][c];
      sm.eq[kNB - 1 - b][c] = post;
      post *= sm.etb[kNB - 1 - b][c];
    }
    // D_IJ = Π_{J<b<I} e^{T_b} of the off-diagonal block pairs o = (1,0), (2,0), (2,1), (3,0), (3,1), (3,2), for L and
    // Mqk (in tmp until the inverse)
    const float e1 = sm.etb[1][c], e2 = sm.etb[2][c];
    const float d[6] = {1.f, e1, 1.f, e1 * e2, e2, 1.f};
#pragma unroll
    for (int o = 0; o < 6; ++o) sm.tmp[o * kD + c] = d[o];
  }
  __syncthreads();
}

// L and Mqk (packed lower blocks): the narrow diagonal blocks and every off-diagonal block on tensor cores
// (3xTF32 mma.sync, the middle-token reference in the diagonal blocks); wide_pair_matrices does the rest.
__device__ void narrow_pair_matrices(Smem& sm, WideBlocks wide) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // units: (job, n-tile), job 0-3 the diagonal blocks, 4-9 the off-diagonal pairs o = job - 4 (load_chunk's order)
#pragma unroll 1
  for (int u = warp; u < 20; u += kThreads / 32) {
    const int job = u >> 1, nt = u & 1, o = job - 4;
    const int Io = 1 + (o >= 1) + (o >= 3);
    const int I = job < 4 ? job : Io, J = job < 4 ? job : o - Io * (Io - 1) / 2;
    if (I == J && wide[I]) continue;
    const int i0 = kB * I, j0 = kB * J, mid = i0 + kB / 2;
    float dl[4] = {0.f, 0.f, 0.f, 0.f}, dm[4] = {0.f, 0.f, 0.f, 0.f};
    // the row factor: e^{γ_i - γ_mid} (diagonal) or e^{γ_i} D_IJ, per channel
    const float* const rf = I == J ? sm.iem[I] : sm.tmp + o * kD;
    const auto rowf = [&](int i, int c) { return egv(sm, i, c) * rf[c]; };
    const auto colf = [&](int j, int c) {  // the column operand: k̂_j e^{γ_mid - γ_j} or k̂_j e^{σ_j}
      return I == J ? kh(sm, j, c) * (egv(sm, mid, c) / egv(sm, j, c)) : kh(sm, j, c) * esv(sm, j, c);
    };
    // (two products share the column operand: rows k̂ for L, q̂ for Mqk)
    const int lg = lane >> 2, lq = lane & 3;
#pragma unroll 1
    for (int k0 = 0; k0 < kD; k0 += 8) {
      float akf[4], aqf[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = i0 + lg + 8 * (e & 1), c = k0 + lq + 4 * (e >> 1);
        const float f = rowf(i, c);
        akf[e] = kh(sm, i, c) * f;
        aqf[e] = qh(sm, i, c) * f;
      }
      const int j = j0 + 8 * nt + lg;
      const float b0 = colf(j, k0 + lq), b1 = colf(j, k0 + lq + 4);
      const uint32_t bh0 = tf32_hi(b0), bh1 = tf32_hi(b1);
      const uint32_t bl0 = tf32(b0 - __uint_as_float(bh0)), bl1 = tf32(b1 - __uint_as_float(bh1));
      uint32_t kh_[4], kl_[4], qh_[4], ql_[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        kh_[e] = tf32_hi(akf[e]), kl_[e] = tf32(akf[e] - __uint_as_float(kh_[e]));
        qh_[e] = tf32_hi(aqf[e]), ql_[e] = tf32(aqf[e] - __uint_as_float(qh_[e]));
      }
      mma_tf32(dl, kl_, bh0, bh1);
      mma_tf32(dl, kh_, bl0, bl1);
      mma_tf32(dl, kh_, bh0, bh1);
      mma_tf32(dm, ql_, bh0, bh1);
      mma_tf32(dm, qh_, bl0, bl1);
      mma_tf32(dm, qh_, bh0, bh1);
    }
    frag_each(dl, 8 * nt, [&](int il, int jl, float x) {
      const int i = i0 + il, j = j0 + jl;
      sm.L[tri(i, j)] = (I > J || j < i) ? x : 0.f;
    });
    frag_each(dm, 8 * nt, [&](int il, int jl, float x) {
      const int i = i0 + il, j = j0 + jl;
      sm.M[tri(i, j)] = (I > J || j <= i) ? x : 0.f;
    });
  }
}

// The wide diagonal blocks of L and Mqk, pairwise on CUDA cores (the caller synchronises after it).
__device__ void wide_pair_matrices(Smem& sm, const TrainingBackwardParams& p, const Task& tk, WideBlocks wide) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  // wide diagonal blocks: warp per column (two per warp), lane: channels [4 lane, +4), exponents summed from the
  // column's own token upward (every factor <= 1; masked pairs never formed)
#pragma unroll 1
  for (int I = 0; I < kNB; ++I) {
    if (!wide[I]) continue;
    const int c0 = 4 * lane;
    float dtb[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) dtb[e] = dt_bias_at(p, tk, c0 + e);
#pragma unroll 1
    for (int jj = warp; jj < kB; jj += kThreads / 32) {
      const int j = kB * I + jj;
      float kj[4], ex[4] = {0.f, 0.f, 0.f, 0.f}, vl[kB], vm[kB];
#pragma unroll
      for (int e = 0; e < 4; ++e) kj[e] = kh(sm, j, c0 + e);
#pragma unroll
      for (int ii = 0; ii < kB; ++ii) {
        vl[ii] = vm[ii] = 0.f;
        if (ii >= jj) {
          const int i = kB * I + ii;
          float sl = 0.f, sq = 0.f;
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            if (ii > jj) ex[e] += log_decay_at(p, tk, i, c0 + e, dtb[e]);
            const float w = kj[e] * __expf(ex[e]);
            sl = fmaf(kh(sm, i, c0 + e), w, sl);
            sq = fmaf(qh(sm, i, c0 + e), w, sq);
          }
          vl[ii] = sl, vm[ii] = sq;
        }
      }
      pair_column_store(vl, lane, [&](int ii, float x) { sm.L[tri(kB * I + ii, j)] = ii > jj ? x : 0.f; });
      pair_column_store(vm, lane, [&](int ii, float x) { sm.M[tri(kB * I + ii, j)] = ii >= jj ? x : 0.f; });
    }
  }
}

// INV = (I + diag(β) L)^{-1}, unit lower triangular, fp32: the diagonal blocks by forward substitution (thread per
// column), then the off-diagonal blocks by distance d = I - J: INV_IJ = -INV_II Σ_{J<=K<I} diag(β_I) L_IK INV_KJ.
// Starts and ends synchronised (the caller's wgmma may run meanwhile: it touches none of these arrays).
template <class P>
__device__ void unit_lower_inverse(Smem& sm, P& prof) {
  const int tid = threadIdx.x;
  if (tid < kT) {
    const int I = tid >> 4, jj = tid & 15, i0 = kB * I;
    float x[kB];
#pragma unroll
    for (int ii = 0; ii < kB; ++ii) {
      float s = 0.f;
#pragma unroll
      for (int m = 0; m < ii; ++m) s = fmaf(sm.L[tri(i0 + ii, i0 + m)], x[m], s);
      x[ii] = ii < jj ? 0.f : (ii == jj ? 1.f : -sm.beta[i0 + ii] * s);
    }
#pragma unroll
    for (int ii = 0; ii < kB; ++ii) sm.INV[tri(i0 + ii, i0 + jj)] = x[ii];
  }
  __syncthreads();
  prof.mark(kPfInverseDiag);
#pragma unroll 1
  for (int d = 1; d < kNB; ++d) {
    const int pairs = kNB - d;
    for (int e = tid; e < pairs * kB * kB; e += kThreads) {
      const int J = e >> 8, I = J + d, il = (e >> 4) & 15;
      float s = 0.f;
      for (int mb = J; mb < I; ++mb) {  // m = 16 mb + mm ascending: row il of L_I,mb, column of INV_mb,J
        const float* const lrow = sm.L + (tri_block(I, mb) << 8) + (il << 4);
        const float* const icol = sm.INV + (tri_block(mb, J) << 8) + (e & 15);
#pragma unroll
        for (int mm = 0; mm < kB; ++mm) s = fmaf(lrow[mm], icol[mm << 4], s);
      }
      sm.tmp[e] = sm.beta[kB * I + il] * s;
    }
    __syncthreads();
    for (int e = tid; e < pairs * kB * kB; e += kThreads) {
      const int J = e >> 8, I = J + d, il = (e >> 4) & 15, jl = e & 15;
      float s = 0.f;
#pragma unroll
      for (int m = 0; m < kB; ++m) s = fmaf(sm.INV[tri(kB * I + il, kB * I + m)], sm.tmp[(J << 8) + (m << 4) + jl], s);
      sm.INV[tri(kB * I + il, kB * J + jl)] = -s;
    }
    __syncthreads();
  }
}

// Writes the [64][kCols] matrix as bf16 tiles of layout L (hi, and lo = x - hi when lo is given), f(row, c0) giving
// columns c0..c0+3: 4 columns per thread and 8-byte store (a warp's lanes read consecutive 4-column pieces of the
// source rows: conflict-free 16-byte fp32 reads). write_tile: [64 tokens][128 channels] (LayoutTile); write_sq:
// 64 x 64 (LayoutSq).
template <class L, int kCols, class F>
__device__ __forceinline__ void write_split(bf16_t* hi, bf16_t* lo, F f) {
  constexpr int kPieces = kCols / 4, kShift = kPieces == 32 ? 5 : 4;
  static_assert(kPieces == 1 << kShift, "4-column pieces per row: 16 or 32");
#pragma unroll 1
  for (int i = threadIdx.x; i < kT * kPieces; i += kThreads) {
    const int r = i >> kShift, c0 = (i & (kPieces - 1)) * 4;
    const F4 x = f(r, c0);
    uint32_t h[2], l[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) split2(x.v[2 * e], x.v[2 * e + 1], h[e], l[e]);
    const int o = swz_offset(L{}, r, c0);  // (4 elements within one 16-byte chunk: contiguous after the swizzle)
    *reinterpret_cast<uint2*>(hi + o) = make_uint2(h[0], h[1]);
    if (lo != nullptr) *reinterpret_cast<uint2*>(lo + o) = make_uint2(l[0], l[1]);
  }
}
template <class F>
__device__ __forceinline__ void write_tile(bf16_t* hi, bf16_t* lo, F f) {
  write_split<LayoutTile, kD>(hi, lo, f);
}
template <class F>
__device__ __forceinline__ void write_sq(bf16_t* hi, bf16_t* lo, F f) {
  write_split<LayoutSq, kT>(hi, lo, f);
}

// The pair terms of a wide diagonal block I (an unbounded gate's block with some |γ| > kNarrowSpan) for this warp's
// 16 channel rows (c = c0 + row) and the block's 16 token columns, in the accumulator layout (element (n, e): row
// g + 8 (e >> 1), column 16 I + 8n + 2q + (e & 1)): exact pairwise exponents summed outward from each element's own
// token (every factor <= 1), on CUDA cores. wide_log_decays: the block's log-decays of the thread's two rows;
// wide_diag_element, one element at a time (so that the caller holds five more values, not forty, beside its
// accumulators): rm, rl, the row terms of dq and dk (W_M = dMqk, W_L = β_i dA); cm, cl, the column terms of dk;
// esig, e^{σ_t} (the block's column factor, from the same log-decays).
__device__ __forceinline__ void wide_log_decays(const Smem& sm, const TrainingBackwardParams& p, const Task& tk, int c0,
                                                int I, float (&av)[2][kB]) {
  const int g = (threadIdx.x & 31) >> 2;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = c0 + g + 8 * h;
    const float dtb = dt_bias_at(p, tk, c);
#pragma unroll 1
    for (int u = 0; u < kB; ++u) av[h][u] = log_decay_at(p, tk, kB * I + u, c, dtb);
  }
}
__device__ __noinline__ void wide_diag_element(const Smem& sm, int c0, int I, int n, int e, const float (&av)[2][kB],
                                               float& rm, float& rl, float& cm, float& cl, float& esig) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3, i0 = kB * I;
  const auto wl = [&](int i, int j) { return sm.beta[i] * tri_at(sm.INV, i, j); };
  const auto wm = [&](int i, int j) { return tri_at(sm.M, i, j); };
  const int h = e >> 1, c = c0 + g + 8 * h, tl = 8 * n + 2 * q + (e & 1), t = i0 + tl;
  float ex = 0.f, sm_ = 0.f, sl_ = 0.f;
  for (int jl = tl; jl >= 0; --jl) {  // row terms: j <= t
    const int j = i0 + jl;
    const float w = kh(sm, j, c) * __expf(ex);
    sm_ = fmaf(wm(t, j), w, sm_);
    sl_ = fmaf(wl(t, j), w, sl_);
    ex += av[h][jl];
  }
  rm = sm_, rl = sl_;
  ex = 0.f;
  float scm = 0.f, scl = 0.f;
  for (int il = tl; il < kB; ++il) {  // column terms: i >= t
    if (il > tl) ex += av[h][il];
    const int i = i0 + il;
    const float w = __expf(ex);
    scm = fmaf(wm(i, t), qh(sm, i, c) * w, scm);
    scl = fmaf(wl(i, t), kh(sm, i, c) * w, scl);
  }
  cm = scm, cl = scl;
  esig = __expf(ex);  // (ex = σ_t: the log-decays of the block's tokens after t)
}

// A shared-memory pointer the compiler must treat as new at each use: the wgmma descriptors built from it are formed
// where they are used instead of once before the task loop (29 of them, two registers each, were hoisted out of the
// loop and spilled, and reloaded from local memory in every task).
template <class T>
__device__ __forceinline__ T* fresh(T* ptr) {
  asm volatile("" : "+l"(ptr));
  return ptr;
}

// kProfile: the instantiation that keeps the phase clocks (KDA_EXPERIMENT=sweep64_profile=1 in an experiments build;
// Prof)
template <bool kProfile>
__global__ void __launch_bounds__(kThreads, 1) kda_training_backward_sweep64_kernel(const TrainingBackwardParams p) {
#if defined(KDA_SWEEP64_DEVICE)
  extern __shared__ char smem_raw[];
  const uint32_t smem_a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw + ((1024u - (smem_a & 1023u)) & 1023u));
  const int tid = threadIdx.x, wg = tid >> 7, wtid = tid & 127, warp = tid >> 5, lane = tid & 31;
  const int wq = wtid >> 5;  // warp within the warpgroup
  const int64_t tasks = p.n_slots * p.HV;

  auto mma_rs = make_tiled_mma(MmaRS{});
  auto mma_ss = make_tiled_mma(MmaSS{});
  auto thr = mma_rs.get_slice(wtid);
  auto thr_ss = mma_ss.get_slice(wtid);
  // the wgmma operands in shared memory, as functions: each use forms its descriptors
  const auto tile = [](bf16_t* ptr) { return make_tensor(make_smem_ptr(fresh(ptr)), LayoutTile{}); };  // [64][128]
  const auto bKh = [&] { return thr.partition_fragment_B(tile(sm.kp_hi)); };                           // (MMA, 1, 8)
  const auto bKl = [&] { return thr.partition_fragment_B(tile(sm.kp_lo)); };
  const auto bR = [&] { return thr.partition_fragment_B(tile(sm.r)); };
  const auto bY = [&] { return thr.partition_fragment_B(tile(sm.dy)); };
  const auto bO = [&] { return thr.partition_fragment_B(tile(sm.dO)); };
  // 64 x 64 tiles read K-major (sq) or MN-major (sq_t, the transpose)
  const auto sq = [](bf16_t* ptr) { return make_tensor(make_smem_ptr(fresh(ptr)), LayoutSq{}); };
  const auto sq_t = [](bf16_t* ptr) { return make_tensor(make_smem_ptr(fresh(ptr)), LayoutSqT{}); };
  // this warpgroup's 64-column half of a [64][128] tile, MN-major (the [t][c] tile's transpose)
  const auto half_sq = [&](bf16_t* ptr) { return sq_t(ptr + wg * kT * kT); };
  // dR's dOᵀ Mqk (SS, both MN-major) and R = INV Y, dY = INVᵀ dR (RS): the square tiles in the R and dY tiles' space
  auto mma_sst = make_tiled_mma(MmaSSt{});
  auto mma_rst = make_tiled_mma(MmaRSt{});
  auto thr_sst = mma_sst.get_slice(wtid);
  auto thr_rst = mma_rst.get_slice(wtid);
  const auto aOt = [&] { return thr_sst.partition_fragment_A(half_sq(sm.dO)); };
  const auto bMh = [&] { return thr_sst.partition_fragment_B(sq_t(sm.r)); };
  const auto bMl = [&] { return thr_sst.partition_fragment_B(sq_t(sm.r + kT * kT)); };
  const auto bIh = [&] { return thr.partition_fragment_B(sq(sm.dy)); };
  const auto bIl = [&] { return thr.partition_fragment_B(sq(sm.dy + kT * kT)); };
  const auto bIth = [&] { return thr_rst.partition_fragment_B(sq_t(sm.dy)); };
  const auto bItl = [&] { return thr_rst.partition_fragment_B(sq_t(sm.dy + kT * kT)); };
  // the pair terms (SS; the k-blocks are the four 16-token blocks): rows A = Kσ (MN-major: this warpgroup's channel
  // half of the [t][c] tile), B = dMqk, dA [t][j] K-major; columns A = Qg, Kgβ, B = the same tiles MN-major (dMqk
  // through bMh / bMl, which read the R tiles' space MN-major for dR's Mqk as well)
  auto mma_ssr = make_tiled_mma(MmaSSr{});
  auto thr_ssr = mma_ssr.get_slice(wtid);
  bf16_t* const qg = reinterpret_cast<bf16_t*>(sm.es);  // Qg hi, lo: two [64][128] tiles over e^{σ}
  const auto aSh = [&] { return thr_ssr.partition_fragment_A(half_sq(sm.kp_hi)); };
  const auto aSl = [&] { return thr_ssr.partition_fragment_A(half_sq(sm.kp_lo)); };
  const auto bWmh = [&] { return thr_ssr.partition_fragment_B(sq(sm.r)); };
  const auto bWml = [&] { return thr_ssr.partition_fragment_B(sq(sm.r + kT * kT)); };
  const auto bWlh = [&] { return thr_ssr.partition_fragment_B(sq(sm.dy)); };
  const auto bWll = [&] { return thr_ssr.partition_fragment_B(sq(sm.dy + kT * kT)); };
  const auto aQgh = [&] { return thr_sst.partition_fragment_A(half_sq(qg)); };
  const auto aQgl = [&] { return thr_sst.partition_fragment_A(half_sq(qg + kT * kD)); };
  const auto aKgh = [&] { return thr_sst.partition_fragment_A(half_sq(sm.dO)); };
  const auto aKgl = [&] { return thr_sst.partition_fragment_A(half_sq(sm.kp_hi)); };
  const auto bLth = [&] { return thr_sst.partition_fragment_B(sq_t(sm.dy)); };
  const auto bLtl = [&] { return thr_sst.partition_fragment_B(sq_t(sm.dy + kT * kT)); };
  // SS operands of dA / dMqk: R (hi: r, lo: kp_hi) as A; dY (hi: dy, lo: kp_lo) and dO as B, the warpgroup's half
  // of the tokens t in [32 wg, +32) (the same instructions in both warpgroups: no divergent wgmma)
  const auto half = [&](bf16_t* ptr) { return local_tile(tile(ptr), Shape<_32, _128>{}, make_coord(wg, _0{})); };
  const auto aRs = [&] { return thr_ss.partition_fragment_A(tile(sm.r)); };
  const auto aRls = [&] { return thr_ss.partition_fragment_A(tile(sm.kp_hi)); };
  const auto bYs = [&] { return thr_ss.partition_fragment_B(half(sm.dy)); };
  const auto bYls = [&] { return thr_ss.partition_fragment_B(half(sm.kp_lo)); };
  const auto bOs = [&] { return thr_ss.partition_fragment_B(half(sm.dO)); };
  Tensor aH = make_tensor<bf16_t>(partition_shape_A(mma_rs, Shape<_64, _128>{}));  // ((2, 2, 2), 1, 8)
  Tensor aL = make_tensor<bf16_t>(partition_shape_A(mma_rs, Shape<_64, _128>{}));
  Tensor cA = thr.partition_A(make_identity_tensor(Shape<_64, _128>{}));  // (row, k) of each A element
  Tensor cC = thr.partition_C(make_identity_tensor(Shape<_64, _64>{}));   // (row, column) of each accumulator
  static_assert(decltype(size(aH))::value == 64, "A fragment: 64 elements");

  // A operand of a state's fp32 rows (row m at base + m * kD, 8-byte aligned): the fragment's element pairs are one
  // row's consecutive k (tests/layout/sweep64_layout_check.cu), so one 8-byte load per pair; hi and lo bf16 parts
  const auto fill_a_rows = [&](const float* base) {
#pragma unroll
    for (int i = 0; i < size(aH); i += 2) {
      const float2 x = __ldg(reinterpret_cast<const float2*>(base + get<0>(cA(i)) * kD + get<1>(cA(i))));
      split2(x.x, x.y, recast<uint32_t>(aH)(i / 2), recast<uint32_t>(aL)(i / 2));
    }
  };
  // A operand from global memory: hi and lo bf16 parts of f(row, k), a pair of elements (one 32-bit register of
  // each part) at a time
  const auto fill_a = [&](auto f) {
#pragma unroll
    for (int i = 0; i < size(aH); i += 2)
      split2(f(get<0>(cA(i)), get<1>(cA(i))), f(get<0>(cA(i + 1)), get<1>(cA(i + 1))), recast<uint32_t>(aH)(i / 2),
             recast<uint32_t>(aL)(i / 2));
  };

  // each task's TaskRef in sm.ref[cur], resolved by thread 0 at the start of the CTA's task before (shared memory: no
  // registers held across a task), and sm.issued: its token loads were issued during that task's da walk
  int cur = 0;
  if (tid == 0) sm.ref[0] = resolve_task_of(p, blockIdx.x), sm.issued = 0;
  for (int64_t task = blockIdx.x; task < tasks; task += gridDim.x, cur ^= 1) {
    __syncthreads();  // the previous task is done with shared memory; sm.ref[cur] is this task's
    const int64_t next = task + gridDim.x;
    if (sm.ref[cur].n < 0) {  // an unused slot: zero partials
      if (tid < kD) p.ddt_partial[task * kD + tid] = 0.f;
      if (tid == 0) p.dA_partial[task] = 0.f;
      if (tid == 0) sm.ref[cur ^ 1] = next < tasks ? resolve_task_of(p, next) : TaskRef{-1}, sm.issued = 0;
      continue;
    }
    const Task tk = make_task(p, sm.ref[cur], task);
    if (!sm.issued) issue_token_loads<kAllRows>(sm, p, tk);
    if (tid == 0) sm.ref[cur ^ 1] = next < tasks ? resolve_next(p, next, sm.ref[cur], task) : TaskRef{-1};
    const int sd = p.state_dim;
    const auto s0_at = [&](int v, int k) { return tk.S0 != nullptr && v < sd && k < sd ? tk.S0[v * sd + k] : 0.f; };
    const auto ds_at = [&](int v, int k) { return tk.dS != nullptr ? tk.dS[v * kD + k] : 0.f; };
    // the unchecked forms (state rows as stored, 128 wide): constant offsets from one base, no selects
    const bool s0_full = tk.S0 != nullptr && sd == kD, ds_full = tk.dS != nullptr;
    const auto s0_raw = [&](int v, int k) { return tk.S0[v * kD + k]; };
    const auto ds_raw = [&](int v, int k) { return tk.dS[v * kD + k]; };

    Prof<kProfile> prof;
    prof.start(p.profile && blockIdx.x == 0 && tid == 0);
    prof.mark(kPfSetup);
    WideBlocks wide;
    load_chunk(sm, p, tk, wide, prof);
    prof.mark(kPfNorms);
    narrow_pair_matrices(sm, wide);
    wide_pair_matrices(sm, p, tk, wide);
    __syncthreads();
    // K⁺ = k̂ e^{γ + P} (hi, lo)
    write_tile(sm.kp_hi, sm.kp_lo,
               [&](int t, int c) { return kh4(sm, t, c) * eg4(sm, t, c) * ld4(&sm.ep[t >> 4][c]); });
    write_sq(sm.r, sm.r + kT * kT, [&](int s, int t) { return tri4(sm.M, s, t); });  // Mqk [s][t] (hi, lo)
    cutlass::arch::fence_view_async_shared();
    __syncthreads();

    prof.mark(kPfPairMatrices);

    // ---- Xᵀ = S_0 K⁺ᵀ (WG: value rows [64 wg, +64)), the inverse meanwhile; (V - X)ᵀ
    Tensor acc = partition_fragment_C(mma_rs, Shape<_64, _64>{});
    if (s0_full)
      fill_a_rows(tk.S0 + 64 * wg * kD);
    else
      fill_a([&](int m, int k) { return s0_at(64 * wg + m, k); });
    open_batch(aH, aL, acc);
    split3(mma_rs, aH, aL, bKh(), bKl(), acc);
    warpgroup_commit_batch();
    prof.mark(kPfXStart);
    unit_lower_inverse(sm, prof);
    write_sq(sm.dy, sm.dy + kT * kT, [&](int t, int s) { return tri4(sm.INV, t, s); });  // INV [t][s] (hi, lo)
    // (fenced and synchronised with the Kr tiles below)
    prof.mark(kPfInverse);
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    warpgroup_fence_operand(aH);  // (the A fragments are refilled below)
    warpgroup_fence_operand(aL);
    float vx[8][4];  // (V - X)ᵀ: row v, column t
    {
      // V[t][v] of this thread's elements, the 32 loads issued together: no branch per element (a token past the
      // chunk's end reads the chunk's first token row and counts as 0)
      const int64_t vts = p.v.token_stride;
      const __nv_bfloat16* const v0 = p.v.row<__nv_bfloat16>(tk.s.batch, tk.t0, tk.hv) + 64 * wg;
      __nv_bfloat16 raw[32];
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int t = get<1>(cC(i));
        raw[i] = __ldg(v0 + (t < tk.len ? t : 0) * vts + get<0>(cC(i)));
      }
#pragma unroll
      for (int i = 0; i < 32; ++i)
        vx[i >> 2][i & 3] = (get<1>(cC(i)) < tk.len ? __bfloat162float(raw[i]) : 0.f) - acc(i);
    }
    __syncthreads();  // both warpgroups are done with the K⁺ tiles
    // Kr = k̂ e^{σ + Q} (hi, lo)
    write_tile(sm.kp_hi, sm.kp_lo,
               [&](int t, int c) { return kh4(sm, t, c) * es4(sm, t, c) * ld4(&sm.eq[t >> 4][c]); });
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    prof.mark(kPfXWaitKr);

    // ---- dRᵀ = dS_C Krᵀ + dOᵀ Mqk: one accumulator; dOᵀ (exact bf16) is this warpgroup's half of the dO tile read
    // MN-major, Mqk [s][t] (hi + lo) MN-major
    if (ds_full)
      fill_a_rows(tk.dS + 64 * wg * kD);
    else
      fill_a([](int, int) { return 0.f; });
    open_batch(aH, aL, acc);
    split3(mma_rs, aH, aL, bKh(), bKl(), acc);
    gemm(mma_sst, aOt(), bMh(), acc);
    gemm(mma_sst, aOt(), bMl(), acc);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    warpgroup_fence_operand(aH);
    warpgroup_fence_operand(aL);
    prof.mark(kPfDR);
    // ---- Rᵀ = Yᵀ INVᵀ with Yᵀ = β (V - X)ᵀ (B(t, s) = INV[t][s]: K-major), dYᵀ = dRᵀ INV (B(t, s) = INV[s][t]:
    // the same tile MN-major); the accumulator values are the register A operand of the same (row, k) (the m64n64
    // accumulator and the K = 64 A fragment index their elements alike: tests/layout/sweep64_layout_check.cu)
    float r[8][4], dyv[8][4];
    {
      Tensor aYh = make_tensor<bf16_t>(partition_shape_A(mma_rs, Shape<_64, _64>{}));  // ((2, 2, 2), 1, 4)
      Tensor aYl = make_tensor<bf16_t>(partition_shape_A(mma_rs, Shape<_64, _64>{}));
      Tensor aDh = make_tensor<bf16_t>(partition_shape_A(mma_rs, Shape<_64, _64>{}));
      Tensor aDl = make_tensor<bf16_t>(partition_shape_A(mma_rs, Shape<_64, _64>{}));
      static_assert(decltype(size(aYh))::value == 32, "A fragment of K = 64: 32 elements");
#pragma unroll
      for (int i = 0; i < 32; i += 2) {  // (elements i, i + 1: one row, columns t, t + 1)
        const int t = get<1>(cC(i));
        split2(sm.beta[t] * vx[i >> 2][i & 3], sm.beta[t + 1] * vx[i >> 2][(i & 3) + 1], recast<uint32_t>(aYh)(i / 2),
               recast<uint32_t>(aYl)(i / 2));
        split2(acc(i), acc(i + 1), recast<uint32_t>(aDh)(i / 2), recast<uint32_t>(aDl)(i / 2));
      }
      Tensor accY = partition_fragment_C(mma_rs, Shape<_64, _64>{});
      Tensor accR_ = partition_fragment_C(mma_rs, Shape<_64, _64>{});
      warpgroup_fence_operand(aYh);
      warpgroup_fence_operand(aYl);
      clear_fenced(accR_);
      open_batch(aDh, aDl, accY);
      split3(mma_rs, aYh, aYl, bIh(), bIl(), accR_);
      split3(mma_rst, aDh, aDl, bIth(), bItl(), accY);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accR_);
      warpgroup_fence_operand(accY);
#pragma unroll
      for (int i = 0; i < 32; ++i) r[i >> 2][i & 3] = accR_(i), dyv[i >> 2][i & 3] = accY(i);
    }
    {  // dβ partial Σ_v dY (V - X) per token (fixed order: rows, then lanes, then warps)
      float colsum[8][2];
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 2; ++e) colsum[j][e] = fmaf(dyv[j][e], vx[j][e], dyv[j][e + 2] * vx[j][e + 2]);
      // the sum over the warp's 8 row groups (lane / 4) by a halving exchange: at lane bit 4 k (k = 4, 2, 1) a lane
      // keeps the half of its column groups j whose bit matches its own and adds its partner's copy of that half (14
      // shuffles, not 48); lane l ends with column group j = l / 4 (columns 8 j + 2 (l % 4) + e)
#pragma unroll
      for (int k = 4; k >= 1; k >>= 1) {        // (k: the half's size in column groups)
        const bool up = (lane & (4 * k)) != 0;  // (the partner is lane ^ 4 k)
#pragma unroll
        for (int j = 0; j < k; ++j)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float give = up ? colsum[j][e] : colsum[j + k][e];
            const float keep = up ? colsum[j + k][e] : colsum[j][e];
            colsum[j][e] = keep + __shfl_xor_sync(0xffffffffu, give, 4 * k);
          }
      }
#pragma unroll
      for (int e = 0; e < 2; ++e) sm.dbp[warp][8 * (lane >> 2) + 2 * (lane & 3) + e] = colsum[0][e];
    }
    __syncthreads();  // both warpgroups are done with the Kr tiles
    // R and dY as hi + lo bf16 tiles [t][v]: R in r (hi) and kp_hi (lo), dY in dy (hi) and kp_lo (lo), by stmatrix
    // .trans: the accumulator's 8 x 8 blocks (rows v, columns t; this thread: row lane / 4, columns 2 (lane % 4) + e)
    // are stored transposed, 16-byte rows of 8 v per token. Per instruction q (tokens [16 q, +16)) four blocks k:
    // value rows 8 (k & 1) + [0, 8) of this warp's 16, tokens 16 q + 8 (k >> 1) + [0, 8), their registers the
    // accumulator elements 4 j + 2 (k & 1) + e with j = 2 q + (k >> 1) (tests/layout/sweep64_layout_check.cu); lane l
    // gives the address of block l / 8's token row l % 8. The token tile's swizzle repeats every 8 rows (512 elements
    // further), so q adds 1024 elements.
    {
      const int k = lane >> 3;
      const int o0 = swz_offset(LayoutTile{}, 8 * (k >> 1) + (lane & 7), 64 * wg + 16 * wq + 8 * (k & 1));
      // x (R or dY) as its hi and lo tiles
      const auto store = [&](const float(&x)[8][4], bf16_t* hi_tile, bf16_t* lo_tile) {
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t h[4], l[4];
#pragma unroll
          for (int b = 0; b < 4; ++b) {  // block b: j = 2 q + (b >> 1), elements 2 (b & 1) + {0, 1}
            const float x0 = x[2 * q + (b >> 1)][2 * (b & 1)], x1 = x[2 * q + (b >> 1)][2 * (b & 1) + 1];
            split2(x0, x1, h[b], l[b]);
          }
          SM90_U16x8_STSM_T::copy(h[0], h[1], h[2], h[3], *reinterpret_cast<uint128_t*>(hi_tile + o0 + 1024 * q));
          SM90_U16x8_STSM_T::copy(l[0], l[1], l[2], l[3], *reinterpret_cast<uint128_t*>(lo_tile + o0 + 1024 * q));
        }
      };
      store(r, sm.r, sm.kp_hi);
      store(dyv, sm.dy, sm.kp_lo);
    }
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    prof.mark(kPfRdY);

    // ---- dAᵀ, dMqkᵀ = R [dY | dO]ᵀ: [t'][t] = Σ_v R[t'][v] W[t][v], this warpgroup's tokens t; dQ⁺ᵀ, dK⁺ᵀ with S_0ᵀ
    // (R_lo lives in the kp_hi tile, dY_lo in kp_lo)
    Tensor accA = partition_fragment_C(mma_ss, Shape<_64, _32>{});
    Tensor accM = partition_fragment_C(mma_ss, Shape<_64, _32>{});
    clear_fenced(accA, accM);
    warpgroup_arrive();
    split3(mma_ss, aRs(), aRls(), bYs(), bYls(), accA);
    gemm(mma_ss, aRs(), bOs(), accM);
    gemm(mma_ss, aRls(), bOs(), accM);
    warpgroup_commit_batch();
    Tensor accQ = partition_fragment_C(mma_rs, Shape<_64, _64>{});
    Tensor accK = partition_fragment_C(mma_rs, Shape<_64, _64>{});
    if (s0_full)  // S_0ᵀ: row = channel, k = value row
      fill_a([&](int m, int k) { return s0_raw(k, 64 * wg + m); });
    else
      fill_a([&](int m, int k) { return s0_at(k, 64 * wg + m); });
    clear_fenced(accQ);
    open_batch(aH, aL, accK);
    gemm(mma_rs, aH, bO(), accQ);
    gemm(mma_rs, aL, bO(), accQ);
    split3(mma_rs, aH, aL, bY(), bKl(), accK);  // (dY lo in the kp_lo tile)
    warpgroup_commit_batch();
    {  // dv = β dY from the dY tiles (hi + lo; an infinite hi alone), while the products above run (they read the same
       // tiles): per step a thread's 16-byte piece, 8 values of one token, so a warp stores two whole token rows
       // (before: 32 scattered 2-byte stores per thread, unrolled)
      __nv_bfloat16* const dv0 = static_cast<__nv_bfloat16*>(p.dv) + ((tk.s.batch * p.T + tk.t0) * p.HV + tk.hv) * kD;
      const int64_t rows = int64_t(p.HV) * kD;  // (dv: [B, T, HV, 128] compact)
#pragma unroll 1
      for (int i = tid; i < kT * (kD / 8); i += kThreads) {
        const int t = i >> 4, v0 = 8 * (i & 15);
        if (t >= tk.len) break;                         // (t grows with i)
        const int o = swz_offset(LayoutTile{}, t, v0);  // (8 elements of one 16-byte chunk: contiguous)
        const uint4 hv = *reinterpret_cast<const uint4*>(sm.dy + o), lv = *reinterpret_cast<const uint4*>(sm.kp_lo + o);
        const uint32_t h[4] = {hv.x, hv.y, hv.z, hv.w}, l[4] = {lv.x, lv.y, lv.z, lv.w};
        uint32_t out[4];
        const float b = sm.beta[t];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 fh = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h[e]));
          const float2 fl = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&l[e]));
          const float x0 = isfinite(fh.x) ? fh.x + fl.x : fh.x, x1 = isfinite(fh.y) ? fh.y + fl.y : fh.y;
          const __nv_bfloat162 d = __floats2bfloat162_rn(b * x0, b * x1);
          out[e] = *reinterpret_cast<const uint32_t*>(&d);
        }
        *reinterpret_cast<uint4*>(dv0 + t * rows + v0) = make_uint4(out[0], out[1], out[2], out[3]);
      }
    }
    warpgroup_wait<1>();  // dA, dMqk (the first batch) are done
    warpgroup_fence_operand(accA);
    warpgroup_fence_operand(accM);
    // (t', t) -> dA(t, t') = -accA (t > t'), dMqk(t, t') = accM (t >= t'): element i of this thread is t' = 16 wq + g +
    // 8 h (g = lane / 4, h = (i >> 1) & 1) and t = 32 wg + 8 j + 2 q + e (j = i >> 2, q = lane % 4, e = i & 1;
    // tests/layout/sweep64_layout_check.cu), so t's 16-token block is 2 wg + (j >> 1) and t' lies in block wq: a block
    // pair is stored when wq <= that block (the same for the whole warp), at offsets from one base per block pair
    {
      const int g = lane >> 2, q = lane & 3;
#pragma unroll
      for (int jb = 0; jb < 2; ++jb) {
        const int I = 2 * wg + jb;  // the block of t
        if (wq > I) continue;       // (above the diagonal blocks: not stored)
        const bool diag = wq == I;
        const int base = (tri_block(I, wq) << 8) + 32 * q + g;  // tri(t, t') without t's and t''s own parts below
#pragma unroll
        for (int jj = 0; jj < 2; ++jj)
#pragma unroll
          for (int h = 0; h < 2; ++h)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const int i = 4 * (2 * jb + jj) + 2 * h + e, tl = 8 * jj + 2 * q + e, tpl = g + 8 * h;  // (in the block)
              const int o = base + 128 * jj + 16 * e + 8 * h;
              sm.INV[o] = !diag || tl > tpl ? -accA(i) : 0.f;
              sm.M[o] = !diag || tl >= tpl ? accM(i) : 0.f;
            }
      }
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(accQ);
    warpgroup_fence_operand(accK);
    warpgroup_fence_operand(aH);
    warpgroup_fence_operand(aL);
    prof.mark(kPfDaDmDqDk);
    // ---- dKrᵀ = dS_Cᵀ Rᵀ, and the S_0 decay term colsum(dS_C ⊙ S_0) of this thread's channel rows
    // (S_0ᵀ is still in the A fragments, in the same (channel, value row) layout as dS_Cᵀ: its hi + lo parts serve
    // the colsum, ~17 bits of each element, instead of a third read of S_0 from global memory)
    float cs[2] = {0.f, 0.f};
    const auto fill_dkr = [&](auto ds_f) {
#pragma unroll
      for (int i = 0; i < size(aH); i += 2) {  // (elements i, i + 1: one row m, value rows v, v + 1)
        const int m = get<0>(cA(i)), v = get<1>(cA(i)), cc = 64 * wg + m;
        const float x0 = ds_f(v, cc), x1 = ds_f(v + 1, cc);
        uint32_t& h = recast<uint32_t>(aH)(i / 2);
        uint32_t& l = recast<uint32_t>(aL)(i / 2);
        const float2 sh = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&h));
        const float2 sl = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&l));
        cs[(m >> 3) & 1] = fmaf(x1, sh.y + sl.y, fmaf(x0, sh.x + sl.x, cs[(m >> 3) & 1]));
        split2(x0, x1, h, l);
      }
    };
    if (ds_full)
      fill_dkr(ds_raw);
    else
      fill_dkr(ds_at);
    Tensor accR = partition_fragment_C(mma_rs, Shape<_64, _64>{});
    open_batch(aH, aL, accR);
    split3(mma_rs, aH, aL, bR(), bKh(), accR);  // (R lo in the kp_hi tile)
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accR);
    warpgroup_fence_operand(aH);  // (refilled by the next task)
    warpgroup_fence_operand(aL);
    prof.mark(kPfDKr);
    __syncthreads();  // dA, dMqk complete

    // ---- the pair terms on wgmma, in the transposed accumulators (row c = channel, column t = token), folded into
    // the state products by a Horner walk over the 16-token blocks (every step's factor <= 1; docs/design.md):
    //   rows (dq, dk_row):  acc = dQ⁺ᵀ (-S_0ᵀ dYᵀ: dK⁺ᵀ / β); for J = 0..3: columns of blocks > J *= e^{T_J}, block J
    //   *= ρ_J,
    //                       acc += Kσ_J W_Jᵀ (Kσ = k̂ e^{σ}, W = dMqk, dA; K = the block's 16 tokens j);
    //                       then column t *= e^{-σ_t} (ρ = e^{T}: narrow blocks) or e^{γ_t} (ρ = 1: wide blocks);
    //                       dk_row also *= β_t;
    //   columns (dk_col):   acc = dKrᵀ; for I = 3..0: columns of blocks < I *= e^{T_I}, block I *= ρ_I,
    //                       acc += Qg_I dMqk_I + Kgβ_I dA_I (Qg = q̂ e^{γ}, Kgβ = β k̂ e^{γ}; K = block I's tokens i);
    //                       then column t *= e^{-γ_t} (narrow) or e^{σ_t} (wide);
    // the wide diagonal blocks (zero in the W tiles) pairwise on CUDA cores. Operand tiles bf16 hi + lo: Kσ in the
    // K⁺/Kr tiles' space, dMqk in R's, dA in dY's, Qg in e^{σ}'s (dead once Kσ and the Kr factors are formed), Kgβ
    // hi in dO's and lo in Kσ hi's (after the row walk).
    float ext_part[2] = {0.f, 0.f};
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int m = get<0>(cC(i)), t = get<1>(cC(i)), cc = 64 * wg + m;  // (t >> 4 = i >> 3: static)
      const float er = esv(sm, t, cc) * sm.eq[i >> 3][cc];
      ext_part[(m >> 3) & 1] = fmaf(kh(sm, t, cc) * er, accR(i), ext_part[(m >> 3) & 1]);  // Kr · dKr
      accK(i) = -accK(i);
    }
    const auto wide_diag = [&](int t, int j) { return wide[t >> 4] && (t >> 4) == (j >> 4); };
    write_tile(sm.kp_hi, sm.kp_lo, [&](int t, int c) { return kh4(sm, t, c) * es4(sm, t, c); });
    const F4 zero4{{0.f, 0.f, 0.f, 0.f}};
    write_sq(sm.r, sm.r + kT * kT, [&](int t, int j) { return wide_diag(t, j) ? zero4 : tri4(sm.M, t, j); });
    write_sq(sm.dy, sm.dy + kT * kT, [&](int t, int j) { return wide_diag(t, j) ? zero4 : tri4(sm.INV, t, j); });
    write_tile(sm.dO, nullptr, [&](int t, int c) { return sm.beta[t] * kh4(sm, t, c) * eg4(sm, t, c); });
    __syncthreads();  // every read of e^{σ} is done
    write_tile(qg, qg + kT * kD, [&](int t, int c) { return qh4(sm, t, c) * eg4(sm, t, c); });
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
    // this thread's two channel rows (accumulator row g + 8h); the wide blocks as bits
    const int crow = 64 * wg + 16 * wq + (lane >> 2);
    const int wmask = int(wide.bits);
    // acc *= (block of t) > J ? e^{T_J} : (== J ? ρ_J : 1) (descending: < J); element i's block is i >> 3 (its token
    // 8 (i >> 2) + 2 (lane % 4) + (i & 1)), its row crow + 8 ((i >> 1) & 1): eight factors, then one product each
    const auto horner_scale = [&](auto& acc, int J, bool descending) {
      const bool rho1 = (wmask >> J) & 1;
      float f[kNB][2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float x = sm.etb[J][crow + 8 * h];
#pragma unroll
        for (int b = 0; b < kNB; ++b) f[b][h] = (descending ? b < J : b > J) || (b == J && !rho1) ? x : 1.f;
      }
#pragma unroll
      for (int i = 0; i < 32; ++i) acc(i) *= f[i >> 3][(i >> 1) & 1];
    };
    // one step of a walk: the previous step's products waited for (unconditionally, so that ptxas sees every stage
    // closed), the accumulators scaled for block J, the next products issued
    const auto horner_step = [&](int J, bool descending, auto issue, auto&... accs) {
      warpgroup_wait<0>();
      (warpgroup_fence_operand(accs), ...);
      (horner_scale(accs, J, descending), ...);
      (warpgroup_fence_operand(accs), ...);
      warpgroup_arrive();
      issue();
      warpgroup_commit_batch();
    };
#pragma unroll 1
    for (int J = 0; J < kNB; ++J)
      horner_step(
          J, false,
          [&] {
            split3(mma_ssr, aSh()(_, _, J), aSl()(_, _, J), bWmh()(_, _, J), bWml()(_, _, J), accQ);
            split3(mma_ssr, aSh()(_, _, J), aSl()(_, _, J), bWlh()(_, _, J), bWll()(_, _, J), accK);
          },
          accQ, accK);
    warpgroup_wait<0>();
    warpgroup_fence_operand(accQ);
    warpgroup_fence_operand(accK);
    __syncthreads();                                   // both warpgroups are done with Kσ
    write_tile(sm.kp_hi, nullptr, [&](int t, int c) {  // Kgβ lo
      F4 x = sm.beta[t] * kh4(sm, t, c) * eg4(sm, t, c);
#pragma unroll
      for (int e = 0; e < 4; ++e) x.v[e] -= float(bf16_t(x.v[e]));
      return x;
    });
    cutlass::arch::fence_view_async_shared();
    __syncthreads();
#pragma unroll 1
    for (int I = kNB - 1; I >= 0; --I)
      horner_step(
          I, true,
          [&] {
            split3(mma_sst, aQgh()(_, _, I), aQgl()(_, _, I), bMh()(_, _, I), bMl()(_, _, I), accR);
            split3(mma_sst, aKgh()(_, _, I), aKgl()(_, _, I), bLth()(_, _, I), bLtl()(_, _, I), accR);
          },
          accR);
    warpgroup_wait<0>();
    warpgroup_fence_operand(accR);
    float dq[8][4], dkr[8][4], dkc[8][4];
    float rtb[kNB][2];  // 1 / e^{T_b} of this thread's two rows (1 in wide blocks)
#pragma unroll
    for (int b = 0; b < kNB; ++b)
#pragma unroll
      for (int h = 0; h < 2; ++h) rtb[b][h] = wide[b] ? 1.f : __fdividef(1.f, sm.etb[b][crow + 8 * h]);
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int t = get<1>(cC(i)), b = i >> 3, cc = 64 * wg + get<0>(cC(i));  // (b = t >> 4, cc = crow + 8 h: static)
      const float eg_ = egv(sm, t, cc);
      const float fr = eg_ * rtb[b][(i >> 1) & 1];
      dq[i >> 2][i & 3] = fr * accQ(i);
      dkr[i >> 2][i & 3] = sm.beta[t] * fr * accK(i);
      dkc[i >> 2][i & 3] = wide[b] ? accR(i) : __fdividef(accR(i), eg_);  // (wide: e^{σ} below)
    }
#pragma unroll
    for (int I = 0; I < kNB; ++I) {  // (unrolled: static indices of dq, dkr, dkc, which stay in registers)
      if (!wide[I]) continue;
      float av[2][kB];
      wide_log_decays(sm, p, tk, 64 * wg + 16 * wq, I, av);
#pragma unroll
      for (int n = 0; n < 2; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          float rm, rl, cm, cl, esig;
          wide_diag_element(sm, 64 * wg + 16 * wq, I, n, e, av, rm, rl, cm, cl, esig);  // (wide path)
          const int j = 2 * I + n;                                                      // (the element's column group)
          dq[j][e] += rm;                                                               // (wide path)
          dkr[j][e] += rl;                                                              // (wide path)
          dkc[j][e] = dkc[j][e] * esig + cm + cl;                                       // (wide path)
        }
    }
    {  // ext[c] = Σ_t Kr dKr + g_C colsum(dS_C ⊙ S_0): the four lanes of a row (q) hold its parts
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ext_part[h] += __shfl_xor_sync(0xffffffffu, ext_part[h], 1);
        ext_part[h] += __shfl_xor_sync(0xffffffffu, ext_part[h], 2);
        cs[h] += __shfl_xor_sync(0xffffffffu, cs[h], 1);
        cs[h] += __shfl_xor_sync(0xffffffffu, cs[h], 2);
      }
      if ((lane & 3) == 0)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int cc = 64 * wg + 16 * wq + (lane >> 2) + 8 * h;
          sm.fin.ext[cc] = ext_part[h] + sm.ep[kNB - 1][cc] * sm.etb[kNB - 1][cc] * cs[h];
        }
    }
    prof.mark(kPfPairTerms);
    float dgam[8][4];
    float* const sdq = reinterpret_cast<float*>(sm.kp_hi);  // [64][128] fp32 scratch (the dead K⁺/Kr tiles)
    float* const sdk = reinterpret_cast<float*>(sm.r);      // (the dead R and dY tiles)
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      const int t = get<1>(cC(i)), cc = 64 * wg + get<0>(cC(i));
      const float dkd = dkr[i >> 2][i & 3] - dkc[i >> 2][i & 3];
      dgam[i >> 2][i & 3] = fmaf(qh(sm, t, cc), dq[i >> 2][i & 3], kh(sm, t, cc) * dkd);
    }
    if (p.fused_qk) {  // dq̂, dk̂ to the scratch for the L2-norm backward below
      // (the scratch overlays the pair terms' operand tiles: the other warpgroup's last products may still read them;
      // warpgroup_wait above waits for this warpgroup's own only)
      __syncthreads();
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int o = get<1>(cC(i)) * kD + 64 * wg + get<0>(cC(i));
        sdq[o] = dq[i >> 2][i & 3] * p.scale;
        sdk[o] = dkr[i >> 2][i & 3] + dkc[i >> 2][i & 3];
      }
    } else {  // per value head ([B, T, HV, 128] fp32, compact), for the finishing kernel's GQA sum
      const int64_t o0 = ((tk.s.batch * p.T + tk.t0) * p.HV + tk.hv) * kD + 64 * wg, rows = int64_t(p.HV) * kD;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const int t = get<1>(cC(i));
        if (t < tk.len) {
          p.dq_head[o0 + t * rows + get<0>(cC(i))] = dq[i >> 2][i & 3] * p.scale;
          p.dk_head[o0 + t * rows + get<0>(cC(i))] = dkr[i >> 2][i & 3] + dkc[i >> 2][i & 3];
        }
      }
    }
    __syncthreads();  // every read of e^{γ} and e^{σ} is done (e^{σ}'s space: the Qg tiles)
#pragma unroll
    for (int i = 0; i < 32; ++i) sm.eg[get<1>(cC(i)) * kLDF + 64 * wg + get<0>(cC(i))] = dgam[i >> 2][i & 3];
    // the gate rows again, for da's chain rule at the end of the task: over the dead e^{σ} ([64][128] plain rows), by
    // cp.async behind dβ and the L2-norm backward (not 32 dependent global loads per thread in da's walk)
    __nv_bfloat16* const gs = reinterpret_cast<__nv_bfloat16*>(sm.es);
    {
      const int piece = tid & 15;
      const __nv_bfloat16* const g0 = p.g.row<__nv_bfloat16>(tk.s.batch, tk.t0, tk.hv) + 8 * piece;
#pragma unroll
      for (int u = 0; u < kT * kD / 8 / kThreads; ++u) {
        const int t = (tid >> 4) + 16 * u;
        const bool ok = t < tk.len;
        ptx::cp_async_16(gs + t * kD + 8 * piece, g0 + (ok ? t : 0) * p.g.token_stride, ok);
      }
      // the CTA's next task's dO tile too (dead here: Kgβ hi's last reads are done), so that fewer of its loads are
      // issued at once in da (q, k and the gate rows, whose tiles are read until the L2-norm backward)
      const TaskRef& nref = sm.ref[cur ^ 1];
      if (nref.n >= 0) issue_token_loads<kRowsDO>(sm, p, make_task(p, nref, task + gridDim.x));
      ptx::cp_async_commit();
    }
    __syncthreads();

    prof.mark(kPfDGamma);
    // ---- dβ: Σ_v dY (V - X) + Σ_j dA L; warp per token, lane j and j + 32 of the row (conflict-free rows of the
    // packed blocks; a fixed order: the lanes' tree, then the per-warp partials of dY (V - X))
#pragma unroll 2
    for (int t = warp; t < tk.len; t += kThreads / 32) {  // (two tokens' shuffles interleaved)
      float s = 0.f;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int j = lane + 32 * h;
        if (j < t) s = fmaf(sm.INV[tri(t, j)], sm.L[tri(t, j)], s);
      }
      s = warp_sum32(s);
      if (lane == 0) {
#pragma unroll
        for (int w = 0; w < 8; ++w) s += sm.dbp[w][t];
        const float b = sm.beta[t];
        st_bf16(p.dbeta, (tk.s.batch * p.T + tk.t0 + t) * p.HV + tk.hv, p.beta_is_logit ? s * b * (1.f - b) : s);
      }
    }
    // ---- the L2-norm backward (no GQA group): dx = ρ (dx̂ - (x̂ · dx̂) x̂); warp per token
    if (p.fused_qk) {
#pragma unroll 2
      for (int t = warp; t < tk.len; t += kThreads / 32) {  // (two tokens' shuffles interleaved)
        const int cc = 4 * lane;
        float dqh[4], dkh[4], qv[4], kv[4], dotq = 0.f, dotk = 0.f;
        const float4 dq4 = *reinterpret_cast<const float4*>(sdq + t * kD + cc);
        const float4 dk4 = *reinterpret_cast<const float4*>(sdk + t * kD + cc);
        dqh[0] = dq4.x, dqh[1] = dq4.y, dqh[2] = dq4.z, dqh[3] = dq4.w;
        dkh[0] = dk4.x, dkh[1] = dk4.y, dkh[2] = dk4.z, dkh[3] = dk4.w;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          qv[e] = __bfloat162float(sm.q[t * kLDH + cc + e]) * sm.rq0[t];
          kv[e] = __bfloat162float(sm.k[t * kLDH + cc + e]) * sm.rk[t];
          dotq = fmaf(qv[e], dqh[e], dotq);
          dotk = fmaf(kv[e], dkh[e], dotk);
        }
        dotq = p.use_qk_l2norm ? warp_sum32(dotq) : 0.f;
        dotk = p.use_qk_l2norm ? warp_sum32(dotk) : 0.f;
        const float rq = sm.rq0[t], rk = sm.rk[t];
        const int64_t oo = ((tk.s.batch * p.T + tk.t0 + t) * p.H + tk.hq) * kD + cc;
        const __nv_bfloat162 q01 = __floats2bfloat162_rn(rq * (dqh[0] - dotq * qv[0]), rq * (dqh[1] - dotq * qv[1]));
        const __nv_bfloat162 q23 = __floats2bfloat162_rn(rq * (dqh[2] - dotq * qv[2]), rq * (dqh[3] - dotq * qv[3]));
        const __nv_bfloat162 k01 = __floats2bfloat162_rn(rk * (dkh[0] - dotk * kv[0]), rk * (dkh[1] - dotk * kv[1]));
        const __nv_bfloat162 k23 = __floats2bfloat162_rn(rk * (dkh[2] - dotk * kv[2]), rk * (dkh[3] - dotk * kv[3]));
        *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.dq) + oo) =
            make_uint2(*reinterpret_cast<const uint32_t*>(&q01), *reinterpret_cast<const uint32_t*>(&q23));
        *reinterpret_cast<uint2*>(static_cast<__nv_bfloat16*>(p.dk) + oo) =
            make_uint2(*reinterpret_cast<const uint32_t*>(&k01), *reinterpret_cast<const uint32_t*>(&k23));
      }
    }
    prof.mark(kPfDBetaL2);
    // ---- da = reverse cumsum of dΓ (+ ext), the gate's chain rule; thread (channel c, tokens [32 h, +32)); the gate
    // rows from e^{σ}'s space (loaded above), dg written over them and stored as 16-byte pieces of token rows. The
    // CTA's next task's token loads are issued once q, k, dO and R's space are dead (below the first barrier), to
    // arrive while the walk runs.
    {
      const int cc = tid & 127, h = tid >> 7;
      float tot = 0.f;
      for (int t = 32 * h + 31; t >= 32 * h; --t)
        if (t < tk.len) tot += sm.eg[t * kLDF + cc];  // (padding tokens: dΓ = 0 unless something was not finite)
      sm.fin.part[h][cc] = tot;
      ptx::cp_async_wait<0>();
      __syncthreads();
      const TaskRef& nref = sm.ref[cur ^ 1];  // (resolved at this task's start)
      if (nref.n >= 0) issue_token_loads<kRowsQ | kRowsK | kRowsG>(sm, p, make_task(p, nref, task + gridDim.x));
      if (tid == 0) sm.issued = nref.n >= 0;  // (read after the barriers below)
      float run = sm.fin.ext[cc] + (h == 0 ? sm.fin.part[1][cc] : 0.f);
      const float dtb = dt_bias_at(p, tk, cc);
      float ddt_acc = 0.f, dA_acc = 0.f;
      const int t_end = tk.len < 32 * h + 32 ? tk.len : 32 * h + 32;
      // the serial walk, last token first, for one gate mode (the mode's branch outside the loop, so that the loop
      // holds one mode's code): step(x, run) is dg of a token with gate input x
      const auto walk = [&](auto step) {
#pragma unroll 4
        for (int t = t_end - 1; t >= 32 * h; --t) {
          run += sm.eg[t * kLDF + cc];
          __nv_bfloat16& x = gs[t * kD + cc];
          x = __float2bfloat16_rn(step(__bfloat162float(x) + dtb, run));
        }
      };
      if (p.gate_mode == GateMode::kLowerBound) {
        walk([&](float x, float r) {
          const float z = tk.A * x, sg = sigmoidf_(z);
          const float dz = p.lower_bound * r * sg * (1.f - sg);
          const float dgv = tk.A * dz;
          ddt_acc += dgv;
          dA_acc = fmaf(dz, z, dA_acc);
          return dgv;
        });
      } else {
        const bool softplus = p.gate_mode == GateMode::kSoftplus;
        walk([&](float x, float r) {
          const float a = unbounded_log_decay(softplus, x, tk.A);
          const float da = a < kNegligibleDecay ? 0.f : r;
          float dgv = da;
          if (softplus) {
            dgv = -tk.A * sigmoidf_(x) * da;
            ddt_acc += dgv;
            dA_acc = fmaf(da, a, dA_acc);
          }
          return dgv;
        });
      }
      __syncthreads();  // (part is reused; ext was read before the walk; dg complete in e^{σ}'s space)
      if (h == 1) sm.fin.part[0][cc] = ddt_acc, sm.fin.part[1][cc] = dA_acc;
      {  // dg ([B, T, HV, 128] compact): thread's 16-byte piece tid % 16 of tokens tid / 16 + 16 u
        const int piece = tid & 15;
        __nv_bfloat16* const dg0 =
            static_cast<__nv_bfloat16*>(p.dg) + ((tk.s.batch * p.T + tk.t0) * p.HV + tk.hv) * kD + 8 * piece;
        const int64_t rows = int64_t(p.HV) * kD;
#pragma unroll
        for (int u = 0; u < kT * kD / 8 / kThreads; ++u) {
          const int t = (tid >> 4) + 16 * u;
          if (t < tk.len)
            *reinterpret_cast<uint4*>(dg0 + t * rows) = *reinterpret_cast<const uint4*>(gs + t * kD + 8 * piece);
        }
      }
      __syncthreads();
      if (h == 0) {  // warps 0-3: channel cc's two token halves, then dA's sum over the channels (fixed order)
        p.ddt_partial[task * kD + cc] = ddt_acc + sm.fin.part[0][cc];
        const float a = warp_sum32(dA_acc + sm.fin.part[1][cc]);
        if (lane == 0) sm.fin.ext[warp] = a;
      }
      __syncthreads();
      if (tid == 0) p.dA_partial[task] = (sm.fin.ext[0] + sm.fin.ext[1]) + (sm.fin.ext[2] + sm.fin.ext[3]);
    }
    prof.mark(kPfDa);
  }
#endif
}

}  // namespace
}  // namespace sweep64

int64_t training_backward_sweep64_smem_bytes() {
  return static_cast<int64_t>(sizeof(sweep64::Smem)) + 1024;
}

bool training_backward_sweep64_supported() {
  return current_device_is_sm90() && training_backward_sweep64_smem_bytes() <=
                                         cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(48 * 1024);
}

cudaError_t launch_training_backward_sweep64(const TrainingBackwardParams& p, cudaStream_t stream) {
  if (p.dstates == nullptr || p.slot_cu_starts == nullptr) return cudaErrorInvalidValue;
  const int smem = static_cast<int>(training_backward_sweep64_smem_bytes());
  const auto kernel = sweep64::kda_training_backward_sweep64_kernel<false>;
  KDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (p.n_slots * p.HV <= 0) return cudaSuccess;
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
  // KDA_EXPERIMENT=sweep64_profile=1 (a diagnostic: synchronises, so never under graph capture): the cycles of CTA
  // 0 per phase, to stderr; sweep64_profile_grid=n runs that launch on n CTAs (the same results): with few CTAs a
  // task meets little traffic from the other SMs, so the two profiles show what the full grid costs. It runs the
  // kernel's profiling instantiation (the clocks compiled in: a few more spills than the other's).
  const ExperimentKnobs& x = launch_knobs().exp;
  if (x.sweep64_profile) {
    unsigned long long zero[sweep64::kProfSegs + 1] = {};
    KDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(sweep64::kda_sweep64_prof, zero, sizeof(zero)));
    TrainingBackwardParams q = p;
    q.profile = true;
    if (x.sweep64_profile_grid >= 1) q.grid = x.sweep64_profile_grid;
    const auto kernel_prof = sweep64::kda_training_backward_sweep64_kernel<true>;
    KDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel_prof, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    kernel_prof<<<q.grid, sweep64::kThreads, smem, stream>>>(q);
    KDA_CHECK_LAUNCH();
    KDA_RETURN_IF_ERROR(cudaStreamSynchronize(stream));
    unsigned long long prof[sweep64::kProfSegs + 1];
    KDA_RETURN_IF_ERROR(cudaMemcpyFromSymbol(prof, sweep64::kda_sweep64_prof, sizeof(prof)));
    const double tasks = prof[sweep64::kProfSegs] > 0 ? double(prof[sweep64::kProfSegs]) : 1.0;
    std::fprintf(stderr, "kda sweep64 profile: CTA 0 of %d, %llu tasks, cycles per task:", q.grid,
                 prof[sweep64::kProfSegs]);
    for (int i = 0; i < sweep64::kProfSegs; ++i)
      std::fprintf(stderr, " %s %.0f", sweep64::kProfNames[i], prof[i] / tasks);
    std::fprintf(stderr, "\n");
    return cudaSuccess;
  }
#endif
  kernel<<<p.grid, sweep64::kThreads, smem, stream>>>(p);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace kda
