// Plain-old-data parameters of the CUDA training backward (docs/contract.md, Recurrence and API) and its
// launchers.
// No torch types: csrc/api/training_cuda.cpp fills these from tensors. Offsets and strides are in
// ELEMENTS and 64-bit. K == V == 128 (kBwdDim), bf16 token tensors; every gate mode (gate_mode), logit or plain
// beta, L2 norm on or off.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kda/common/token_coverage.h"
#include "kda/params.h"
#include "kda/tape_rows.h"

namespace kda {

constexpr int kBwdDim = 128;  // K == V this backward handles

struct TrainingBackwardParams {
  // Problem size (as RecurrentParams): fixed N = B sequences of T tokens; packed B = 1, N = len(cu)-1.
  int64_t B = 0, T = 0, N = 0;
  int H = 0, HV = 0;  // K = V = kBwdDim

  TokenTensor q, k;  // [B, T, H, 128] bf16
  TokenTensor v, g;  // [B, T, HV, 128] bf16 (g: raw gate input)
  TokenTensor beta;  // [B, T, HV] bf16 logits
  TokenTensor dout;  // [B, T, HV, 128] bf16: dL/do

  const float* A_log = nullptr;    // [HV]; null with the precomputed gate
  const float* dt_bias = nullptr;  // [HV, 128], may be null (0; always null with the precomputed gate)

  // Tapes: fp32 [n_tape_rows, HV, state_dim, state_dim], compact; row tape_row(tape_cu_starts, n, c) holds the state of
  // sequence n before its token 64*c, for c >= 1 (kda/tape_rows.h; the checkpoint rule with every =
  // kTapeChunk and checkpoint_first = 1); the state before token 0 is initial_state.
  const float* tapes = nullptr;
  int64_t n_tape_rows = 0;
  const int64_t* tape_cu_starts = nullptr;  // [N+1]
  const float* initial_state = nullptr;     // [N, HV, state_dim, state_dim] compact fp32; null = zeros
  // The sweep's tasks are (slot, value head), one slot per 64-token chunk of every sequence, slot
  // slot_cu_starts[n] + c for chunk c of sequence n (launch_tape_cu_starts with first = 0); n_slots rows
  // (an upper bound from shapes: B ceil(T/64) fixed, T/64 + N packed; unused slots write zero partials).
  const int64_t* slot_cu_starts = nullptr;  // [N+1]
  int64_t n_slots = 0;

  const void* cu_seqlens = nullptr;  // [N+1] int32 / int64; null for the fixed layout
  bool cu_seqlens_int64 = false;

  const float* dfinal_state = nullptr;  // [N, HV, 128, 128] compact fp32; null = zeros

  float scale = 0.f;        // q scale (> 0)
  float lower_bound = 0.f;  // λ in [-5, 0) of the lower-bound gate (unused by the other gates)
  // Modes (the gate: gate_mode, the last field): β = sigmoid(beta) or beta itself; q, k L2-normalised in the op or
  // taken as given (then no norm chain in the backward).
  bool beta_is_logit = true;
  bool use_qk_l2norm = true;

  // Outputs written by the sweep (all compact; tokens outside covered_tokens are zeroed by the launcher).
  void* dv = nullptr;     // [B, T, HV, 128] bf16
  void* dg = nullptr;     // [B, T, HV, 128] bf16
  void* dbeta = nullptr;  // [B, T, HV] bf16
  // (dinitial_state is written by the backward chain, launch_chunked_backward_chain, not by these kernels.)

  // Workspace (caller-allocated, fp32).
  float* dq_head = nullptr;  // [B*T, HV, 128] dL/d(normalised q) per value head (covered tokens only)
  float* dk_head = nullptr;  // [B*T, HV, 128] dL/d(normalised k) per value head (covered tokens only)
  // Parameter-gradient partials, one row per task slot (fully written): partial_rows = n_slots.
  int64_t partial_rows = 0;
  float* ddt_partial = nullptr;  // [partial_rows, HV, 128] ddt_bias sums
  float* dA_partial = nullptr;   // [partial_rows, HV] dA_log sums
  // The chain gradient dL/dS at the END of every 16-token chunk, [n_dstate_rows, HV, 128,
  // 128] fp32, row dstate_cu_starts[n] + j for the j-th 16-token chunk of sequence n (launch_tape_cu_starts
  // with chunk 16); written by the backward chain, launch_chunked_backward_chain, which also writes
  // dinitial_state. With sweep64: at the end of every 64-token chunk, one row per task slot (dstate_cu_starts =
  // slot_cu_starts).
  const float* dstates = nullptr;
  const int64_t* dstate_cu_starts = nullptr;  // [N+1]
  int64_t n_dstate_rows = 0;
  int grid = 0;  // CTAs of the sweep (persistent over its tasks)

  // HV == H (no GQA group to sum): the sweep does the L2-norm backward itself and writes
  // dq, dk (zeroed by the launcher outside covered_tokens); dq_head, dk_head unused, no qk finishing kernel.
  bool fused_qk = false;

  // Outputs of the finishing kernels.
  void* dq = nullptr;         // [B, T, H, 128] bf16 compact
  void* dk = nullptr;         // [B, T, H, 128] bf16 compact
  float* dA_log = nullptr;    // [HV] (scratch with the precomputed gate: zeros)
  float* ddt_bias = nullptr;  // [HV, 128] (scratch without dt_bias)

  // The gate (docs/contract.md, Recurrence): kLowerBound a = λ σ(exp(A_log) (g + dt_bias)); kSoftplus
  // a = -exp(A_log) softplus(g + dt_bias); kPrecomputed a = g. (Last, so that the other fields keep their offsets
  // in the lower-bound kernel's parameter block.)
  GateMode gate_mode = GateMode::kLowerBound;

  // The small sweep's state scratch, [grid, 2, 128, 132] fp32 (training_backward_sweep_state_floats() per CTA):
  // S and dS of each CTA in global memory, for GPUs whose blocks get less shared memory than the default sweep
  // needs (sm_120); null: the default sweep, S and dS in shared memory.
  float* sweep_state = nullptr;

  // V = K of the tapes and initial_state: kBwdDim, or 64 in the zero-padded K == V == 64 call (csrc/api/
  // training_cuda.cpp), whose sweep reads each as the leading 64 x 64 block of its 128 x 128 state, zeros elsewhere.
  int state_dim = kBwdDim;

  // The Hopper 64-token sweep (training_backward_sweep64_supported; sm90/sweep64_sm90.cu) instead of the 16-token
  // one: dstates then hold dS every 64 tokens, one row per task slot.
  bool sweep64 = false;
  bool profile = false;  // (the 64-token sweep's phase clocks: KDA_EXPERIMENT=sweep64_profile, set by its launcher)
};

// The state of sequence n, value head hv, before its token 64 c: initial_state for c == 0, else tape row
// tape_cu_starts[n] + c - 1. Null means zeros: no initial_state, or a row outside the tapes (a broken
// tape_cu_starts contract never reads out of bounds).
KDA_HD const float* tape_state(const TrainingBackwardParams& p, int64_t n, int64_t c, int hv) {
  const int64_t kState = int64_t(p.state_dim) * p.state_dim;  // (p.state_dim x p.state_dim compact rows)
  if (c == 0) return p.initial_state != nullptr ? p.initial_state + (n * p.HV + hv) * kState : nullptr;
  const int64_t row = tape_row(p.tape_cu_starts, n, c);
  return row >= 0 && row < p.n_tape_rows ? p.tapes + (row * p.HV + hv) * kState : nullptr;
}

// The packed tokens some sweep task certainly writes the gradients of: the covered span of
// kda/common/token_coverage.h (every token of the fixed layout), empty when the sweep's slots exceed their
// bound (a broken contract: some slots would not run). The launcher zeroes the gradients of the tokens
// outside it before the sweep.
KDA_HD CoveredTokens covered_tokens(const TrainingBackwardParams& p) {
  if (p.cu_seqlens != nullptr && p.slot_cu_starts != nullptr && p.slot_cu_starts[p.N] > p.n_slots) return {0, 0};
  return covered_span(p.cu_seqlens, p.cu_seqlens_int64, p.T, p.N);
}

// Dynamic shared memory of the reverse sweep launch_training_backward runs, bytes (the caller needs no
// opt-in: the launcher does it; the device must allow that much per block): the default sweep (~223 KiB) or
// the small one (small: S and dS in p.sweep_state, ~92 KiB).
int64_t training_backward_chunked_smem_bytes(bool small);
// Floats of p.sweep_state per CTA of the small sweep.
int64_t training_backward_sweep_state_floats();

// The reverse sweep alone (sweep.cu), after the backward chain has written
// dstates: writes dv, dg, dbeta, dq_head, dk_head, ddt_partial, dA_partial (one partial row per task slot).
cudaError_t launch_training_backward_chunked_sweep(const TrainingBackwardParams& p, cudaStream_t stream);

// The Hopper (sm_90a) 64-token sweep (sm90/sweep64_sm90.cu): whether the current device runs it (compute
// capability 9.0 and its shared memory), its dynamic shared memory, and the launch (the 16-token sweep's outputs,
// from dS every 64 tokens: p.sweep64).
bool training_backward_sweep64_supported();
int64_t training_backward_sweep64_smem_bytes();
cudaError_t launch_training_backward_sweep64(const TrainingBackwardParams& p, cudaStream_t stream);

// Zeroing of the uncovered tokens + reverse sweep + GQA/L2-norm finishing + ordered parameter-gradient
// reduction (finish.cu), on `stream` (the sweep needs the backward chain to have run first on the same
// stream).
// No host synchronisation, no allocation (CUDA-graph capturable).
cudaError_t launch_training_backward(const TrainingBackwardParams& p, cudaStream_t stream);

// tape_cu_starts[0] = 0, tape_cu_starts[n+1] = tape_cu_starts[n] + chunk_rows(L_n, chunk, first) (rows.cu;
// kda/tape_rows.h), with L_n the sequence lengths of seq_range (cu_seqlens clamped to [0, T]; fixed: T).
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
