// Chunked ("WY form") KDA prefill on tensor cores, architecture-neutral (mma.sync m16n8k16 + ldmatrix +
// cp.async through CuTe's SM80/SM75 atoms: runs on every built arch, sm_90a and the Blackwell targets).
// The recurrence is docs/contract.md, Recurrence; the plan and the numerics are in docs/design.md ("Chunked
// form", "Chunked CUDA kernel").
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
// e^{80} factors), fp16 (2^-11) for the bounded R path, which keeps fp32 states within the 1e-3 of
// docs/contract.md, Tolerances.
//
// Raw q/k/g rows of the next chunk are copied with cp.async by the prep warps while they prepare the
// current one (kRawStages - 1 chunks ahead); each chain warp copies its own 16 columns of v as far ahead.
// Rows past the end of the
// sequence are zero-filled and their gate forced to 0, so padding never touches the state. Checkpoint
// rows are written at chunk starts that are multiples of the interval (intervals are multiples of 16).
// Slot, activity and gate rules come from kda/common/recurrent_rules.h.
//
// The kernel is composed of pieces, each in its own header with its own shared storage (CUTLASS style):
//   chunked_config.cuh    ChunkedConfig (sizes, warp roles, barrier ids), the operand stages shared by roles
//   chunked_prep.cuh      the prep role (G warps): PrepRaw ring, PrepScratch
//   chunked_solve.cuh     the solve role (W warp): SolveScratch
//   chunked_chain.cuh     the chain role (chain warps): ChainStorage
//   chunked_epilogue.cuh  checkpoint / output / final-state stores of the chain
// kda_chunked_kernel below picks the CTA's work item, handles inactive and empty sequences, and hands each
// warp to its role.
#pragma once
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "kda/chunked/chunked_chain.cuh"
#include "kda/chunked/chunked_config.cuh"
#include "kda/chunked/chunked_epilogue.cuh"
#include "kda/chunked/chunked_prep.cuh"
#include "kda/chunked/chunked_solve.cuh"
#include "kda/common/cuda_check.h"

namespace kda::prefill {

// Shared memory of one CTA: each role's storage and the stages between roles, in this order.
template <int VB, int kStages = 3, int kRawStages = 4>
struct ChunkedSmem {
  using Raw = PrepRaw;
  using Operands = ChunkedOperands<kStages>;
  alignas(16) Raw raw[kRawStages];                 // prep: cp.async ring of raw q/k/g tiles
  alignas(16) Operands op[kStages];                // prep/solve -> chain
  alignas(16) PrepToSolveTiles<kStages> tiles;     // prep -> solve
  alignas(16) PrepScratch prep;                    // prep only
  alignas(16) SolveScratch solve;                  // solve only
  alignas(16) ChainStorage<VB, kRawStages> chain;  // chain only
  alignas(16) int pairwise[kStages];               // prep -> solve: the chunk's mode
};

// BWD = false: the prefill (and the training forward with tapes). BWD = true: the backward chain of the
// training backward (kda_ops/reference_chunked_backward.py, chain_step), the same prep on the same chunks
// walked last to first, with the value rows of the chain gradient dS[V, K] in the chain warps' registers:
//   dRᵀ = dS Krᵀ + dOᵀ Mqk,  dXᵀ = -dRᵀ INVb,  dS = dS ⊙ γ_C + dOᵀ Q⁺ + dXᵀ K⁺   (all bf16 operands, fp32 acc)
// p.v carries dO, p.state_source dfinal_state (null: zeros), p.final_state receives dinitial_state and
// p.state_checkpoints receives dS at the END of every 16-token chunk (the chain gradient entering it from the
// right), row (every / 16) * checkpoint_cu_starts[n] + chunk: every / 16 sub-rows per checkpoint row.
template <int VB, int STAGES, int RAW_STAGES, bool BWD, bool kOut = true>
__global__ void __launch_bounds__(ChunkedConfig<VB, STAGES, RAW_STAGES>::NT, 1)
    kda_chunked_kernel(const RecurrentParams p, const bool out_vec16, const int diag) {
  using Cfg = ChunkedConfig<VB, STAGES, RAW_STAGES>;
  using Smem = ChunkedSmem<VB, STAGES, RAW_STAGES>;
  constexpr int K = Cfg::K, NW = Cfg::NW;
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
  ChunkedTask<BWD> task;
  task.n = n;
  task.part = part;
  task.hv = hv;
  task.h = hv / (p.HV / p.H);
  task.sr = seq_range(p, n);
  task.st = start_state(p, n);
  task.head_off = int64_t(hv) * K * K;
  task.inner = int64_t(p.HV) * K * K;
  task.n_chunks = (task.sr.len + kChunk - 1) / kChunk;
  const SeqRange& sr = task.sr;
  const StartState& st = task.st;
  const int v0 = part * VB + warp * 16;  // a chain warp's first value row
  const auto out_row = [&](int64_t t) { return chunked_out_row(p, sr, hv, v0, t); };

  if (st.kind < 0) {  // inactive: zero output, no state read or write (never in the backward chain)
    if (!BWD && kOut && warp < NW)
      for (int64_t t = lane; t < sr.len * 2; t += 32) {
        __nv_bfloat16* o = out_row(sr.bos + t / 2) + (t % 2) * 8;
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = __float2bfloat16_rn(0.f);
      }
    return;
  }
  if (sr.len == 0 && p.final_state == nullptr) return;  // a zero-length sequence leaves its slot untouched

  if (warp >= NW + kPrepWarps) {
    chunked_solve<Cfg, BWD>(sm, task.n_chunks, lane, diag);
    return;
  }
  if (warp >= NW) {
    chunked_prep<Cfg, BWD>(p, sm, task, tid, diag);
    return;
  }
  chunked_chain<Cfg, BWD, kOut>(p, sm, task, lane, warp, out_vec16, diag);
}

}  // namespace kda::prefill

namespace kda::prefill {

template <int VB, int STAGES, int RAW_STAGES, bool BWD, bool kOut>
cudaError_t run_chunked_(const RecurrentParams& p, bool out_vec16, int diag, cudaStream_t stream) {
  static_assert(kOut || !BWD, "the state-only kernel is a forward kernel");
  using Cfg = ChunkedConfig<VB, STAGES, RAW_STAGES>;
  auto kernel = kda_chunked_kernel<VB, STAGES, RAW_STAGES, BWD, kOut>;
  constexpr int smem = static_cast<int>(sizeof(ChunkedSmem<VB, STAGES, RAW_STAGES>));
  // The shared-memory opt-in, once per device. Concurrent first calls may both set it (the same value:
  // harmless); an atomic flag makes the check itself race-free.
  static std::atomic<bool> attr_set[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!attr_set[dev].load(std::memory_order_acquire)) {
    KDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    attr_set[dev].store(true, std::memory_order_release);
  }
  const int64_t blocks = p.N * p.HV * Cfg::kParts;
  if (blocks <= 0) return cudaSuccess;
  kernel<<<dim3(static_cast<unsigned>(blocks)), Cfg::NT, smem, stream>>>(p, out_vec16, diag);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace kda::prefill
