// Plain-old-data parameters of the CUDA training backward (SPEC §2.1, §3.2-3.3) and its launchers.
// No torch types: csrc/api/training_cuda.cpp fills these from tensors. Offsets and strides are in
// ELEMENTS and 64-bit. Fast path only: K == V == 128 (kBwdDim), bf16 token tensors, L2 norm on,
// lower-bound gate, logit beta (the training contract).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kda/params.h"

namespace kda {

constexpr int kBwdDim = 128;        // K == V this backward handles
constexpr int kBwdSubBlock = 8;     // token-serial sweep: tokens between the in-chunk recompute checkpoints
constexpr int kBwdSubBlocksPerChunk = kTapeChunk / kBwdSubBlock;
constexpr int kBwdThreads = 256;    // one CTA per (sequence, value head) task
// fp32 elements of per-CTA scratch of the token-serial sweep: the state at every sub-block start of the chunk
// being reversed (the chunked sweep needs none).
constexpr int64_t kBwdScratchPerCta = int64_t(kBwdSubBlocksPerChunk) * kBwdDim * kBwdDim;

struct TrainingBackwardParams {
  // Problem size (as RecurrentParams): fixed N = B sequences of T tokens; packed B = 1, N = len(cu)-1.
  int64_t B = 0, T = 0, N = 0;
  int H = 0, HV = 0;  // K = V = kBwdDim

  TokenTensor q, k;   // [B, T, H, 128] bf16
  TokenTensor v, g;   // [B, T, HV, 128] bf16 (g: raw gate input)
  TokenTensor beta;   // [B, T, HV] bf16 logits
  TokenTensor dout;   // [B, T, HV, 128] bf16: dL/do

  const float* A_log = nullptr;    // [HV]
  const float* dt_bias = nullptr;  // [HV, 128], may be null (0)

  // Tapes: fp32 [n_tape_rows, HV, 128, 128], compact; row tape_cu_starts[n] + c - 1 holds the state of
  // sequence n before its token 64*c, for c >= 1 (the checkpoint rule with every = kTapeChunk and
  // checkpoint_first = 1); the state before token 0 is initial_state.
  const float* tapes = nullptr;
  int64_t n_tape_rows = 0;
  const int64_t* tape_cu_starts = nullptr;  // [N+1]
  const float* initial_state = nullptr;     // [N, HV, 128, 128] compact fp32; null = zeros
  // Chunked sweep: its tasks are (slot, value head), one slot per 64-token chunk of every sequence, slot
  // slot_cu_starts[n] + c for chunk c of sequence n (launch_tape_cu_starts with first = 0); n_slots rows
  // (an upper bound from shapes: B ceil(T/64) fixed, T/64 + N packed; unused slots write zero partials).
  const int64_t* slot_cu_starts = nullptr;  // [N+1]
  int64_t n_slots = 0;

  const void* cu_seqlens = nullptr;  // [N+1] int32 / int64; null for the fixed layout
  bool cu_seqlens_int64 = false;

  const float* dfinal_state = nullptr;  // [N, HV, 128, 128] compact fp32; null = zeros

  float scale = 0.f;        // q scale (> 0)
  float lower_bound = 0.f;  // λ in [-5, 0)

  // Outputs written by the sweep (all compact; tokens outside covered_tokens are zeroed by the launcher).
  void* dv = nullptr;               // [B, T, HV, 128] bf16
  void* dg = nullptr;               // [B, T, HV, 128] bf16
  void* dbeta = nullptr;            // [B, T, HV] bf16
  float* dinitial_state = nullptr;  // [N, HV, 128, 128] (token-serial sweep; the backward chain otherwise)

  // Workspace (caller-allocated, fp32).
  float* dq_head = nullptr;      // [B*T, HV, 128] dL/d(normalised q) per value head (covered tokens only)
  float* dk_head = nullptr;      // [B*T, HV, 128] dL/d(normalised k) per value head (covered tokens only)
  // Parameter-gradient partials, one row per task (fully written): the token-serial sweep's tasks are the
  // (sequence, value head) pairs (partial_rows = N), the chunked one's the (slot, value head) pairs
  // (partial_rows = n_slots).
  int64_t partial_rows = 0;
  float* ddt_partial = nullptr;  // [partial_rows, HV, 128] ddt_bias sums
  float* dA_partial = nullptr;   // [partial_rows, HV] dA_log sums
  // Chunked sweep only: the chain gradient dL/dS at the END of every 16-token chunk, [n_dstate_rows, HV, 128,
  // 128] fp32, row dstate_cu_starts[n] + j for the j-th 16-token chunk of sequence n (launch_tape_cu_starts
  // with chunk 16); written by the backward chain, launch_chunked_backward_chain, which also writes
  // dinitial_state.
  const float* dstates = nullptr;
  const int64_t* dstate_cu_starts = nullptr;  // [N+1]
  int64_t n_dstate_rows = 0;
  float* scratch = nullptr;      // token-serial sweep only: [grid, kBwdScratchPerCta]
  int grid = 0;                  // CTAs of the reverse kernel (persistent over its tasks)

  // Chunked sweep with HV == H (no GQA group to sum): the sweep does the L2-norm backward itself and writes
  // dq, dk (zeroed by the launcher outside covered_tokens); dq_head, dk_head unused, no qk finishing kernel.
  bool fused_qk = false;

  // Outputs of the finishing kernels.
  void* dq = nullptr;        // [B, T, H, 128] bf16 compact
  void* dk = nullptr;        // [B, T, H, 128] bf16 compact
  float* dA_log = nullptr;   // [HV]
  float* ddt_bias = nullptr; // [HV, 128]
};

// The state of sequence n, value head hv, before its token 64 c: initial_state for c == 0, else tape row
// tape_cu_starts[n] + c - 1. Null means zeros: no initial_state, or a row outside the tapes (a broken
// tape_cu_starts contract never reads out of bounds).
KDA_HD const float* tape_state(const TrainingBackwardParams& p, int64_t n, int64_t c, int hv) {
  constexpr int64_t kState = int64_t(kBwdDim) * kBwdDim;
  if (c == 0) return p.initial_state != nullptr ? p.initial_state + (n * p.HV + hv) * kState : nullptr;
  const int64_t row = p.tape_cu_starts[n] + c - 1;
  return row >= 0 && row < p.n_tape_rows ? p.tapes + (row * p.HV + hv) * kState : nullptr;
}

// The packed tokens some sweep task certainly writes the gradients of: [lo, hi). Every token of the fixed
// layout. Packed: [c_0, c_N) with c_i = cu_seqlens[i] clamped to [0, T] (seq_range's rule): sequence n covers
// [c_n, c_{n+1}) when c_{n+1} > c_n, so every token between c_0 and c_N is crossed by some sequence, even for
// a non-monotone cu_seqlens (which may cover tokens outside it too). Empty when c_N < c_0 or the chunked sweep's
// slots exceed their bound (broken contracts: some slots would not run). The launcher zeroes the gradients of
// the tokens outside it before the sweep.
struct CoveredTokens {
  int64_t lo, hi;
  KDA_HD bool contains(int64_t t) const { return t >= lo && t < hi; }
};
KDA_HD CoveredTokens covered_tokens(const TrainingBackwardParams& p) {
  if (p.cu_seqlens == nullptr) return {0, p.T};
  const auto clamped = [&](int64_t i) {
    const int64_t x = p.cu_seqlens_int64 ? static_cast<const int64_t*>(p.cu_seqlens)[i]
                                         : static_cast<const int32_t*>(p.cu_seqlens)[i];
    return x < 0 ? int64_t(0) : (x > p.T ? p.T : x);
  };
  if (p.slot_cu_starts != nullptr && p.slot_cu_starts[p.N] > p.n_slots) return {0, 0};
  const int64_t lo = clamped(0), hi = clamped(p.N);
  return hi >= lo ? CoveredTokens{lo, hi} : CoveredTokens{0, 0};
}

// Dynamic shared memory of the reverse sweep launch_training_backward will run (chunked or token-serial),
// bytes (the caller needs no opt-in: the launcher does it; the device must allow that much per block).
int64_t training_backward_smem_bytes();
int64_t training_backward_chunked_smem_bytes();

// Which reverse sweep launch_training_backward runs: the chunked one (default) or, with the environment
// variable KDA_TRAINING_BACKWARD=serial (read once), the token-serial one.
bool training_backward_use_chunked();

// The chunked reverse sweep alone (training_backward_chunked.cu), after the backward chain has written
// dstates: writes dv, dg, dbeta, dq_head, dk_head, ddt_partial, dA_partial (one partial row per task slot).
cudaError_t launch_training_backward_chunked_sweep(const TrainingBackwardParams& p, cudaStream_t stream);

// Reverse sweep + GQA/L2-norm finishing + ordered parameter-gradient reduction, on `stream` (the chunked
// sweep needs the backward chain to have run first on the same stream).
// No host synchronisation, no allocation (CUDA-graph capturable).
cudaError_t launch_training_backward(const TrainingBackwardParams& p, cudaStream_t stream);

// tape_cu_starts[0] = 0, tape_cu_starts[n+1] = tape_cu_starts[n] + max(ceil(L_n / chunk) - first, 0), with
// L_n the sequence lengths of RecurrentParams' rule (seq_range: cu_seqlens clamped to [0, T]; fixed: T).
// chunk = kTapeChunk, first = 1: the tape rows (no row for the state before token 0); chunk = kTapeChunk,
// first = 0: the chunked sweep's task slots (one per 64-token chunk); chunk = 16: the backward chain's dS rows.
cudaError_t launch_tape_cu_starts(const void* cu_seqlens, bool cu_seqlens_int64, int64_t N, int64_t T,
                                  int64_t* tape_cu_starts, cudaStream_t stream, int chunk, int first);

// Zeroes the rows [starts[N], rows) of a [rows, row_elems] fp32 tensor (row_elems a multiple of 4, 16-byte
// aligned): the tape rows past the sequences' (the bound from shapes exceeds what the sequences use), so the
// packed tapes need no zero-fill of their used rows, which the forward writes.
cudaError_t launch_zero_rows_past(float* x, int64_t rows, int64_t row_elems, const int64_t* starts, int64_t N,
                                  cudaStream_t stream);

}  // namespace kda
