// The slot, activity and gate rules of recurrent_kda (docs/contract.md, Recurrence and Slots), shared by the CPU loop
// and the CUDA kernels so both read the same contract. Host/device, no torch.
#pragma once
#include <cmath>
#include <cstdint>

#include "kda/host_device.h"
#include "kda/params.h"

namespace kda {

// Token range of sequence n: packed (cu_seqlens) or fixed (batch row n, tokens 0..T).
struct SeqRange {
  int64_t batch;  // row of B whose strides address the tokens (0 when packed)
  int64_t bos;    // first token (index along T)
  int64_t len;    // number of tokens (>= 0; a non-monotone cu_seqlens pair counts as empty)
};

KDA_HD SeqRange seq_range(const void* cu_seqlens, bool cu_seqlens_int64, int64_t T, int64_t n) {
  if (cu_seqlens == nullptr) return {n, 0, T};
  int64_t a, b;
  if (cu_seqlens_int64) {
    a = static_cast<const int64_t*>(cu_seqlens)[n];
    b = static_cast<const int64_t*>(cu_seqlens)[n + 1];
  } else {
    a = static_cast<const int32_t*>(cu_seqlens)[n];
    b = static_cast<const int32_t*>(cu_seqlens)[n + 1];
  }
  // Caller contract (docs/contract.md, Errors): 0 <= a <= b <= T. Clamp so a broken contract never reads out of bounds.
  a = a < 0 ? 0 : (a > T ? T : a);
  b = b < a ? a : (b > T ? T : b);
  return {0, a, b - a};
}
KDA_HD SeqRange seq_range(const RecurrentParams& p, int64_t n) {
  return seq_range(p.cu_seqlens, p.cu_seqlens_int64, p.T, n);
}

KDA_HD bool slot_in_pool(int64_t slot, int64_t n_pool) {
  return slot >= 0 && slot < n_pool;
}

// GQA: the q/k head of value head hv (contiguous groups of HV / H value heads). Without GQA (the common case)
// no integer division: in the decode kernels the two divisions cost ~45 instructions an item.
KDA_HD int qk_head(const RecurrentParams& p, int hv) {
  return p.HV == p.H ? hv : hv / (p.HV / p.H);
}

// Whether the output view takes 16-byte stores of 8 consecutive values: its base and its token, head and
// (fixed layout) batch strides are multiples of 16 bytes (bf16 output).
KDA_HD bool out_rows_vec16(const RecurrentParams& p) {
  return reinterpret_cast<uintptr_t>(p.out) % 16 == 0 && p.out_token_stride % 8 == 0 && p.out_head_stride % 8 == 0 &&
         (p.cu_seqlens != nullptr || p.out_batch_stride % 8 == 0);
}

// Pool slot that receives the state after token t of sequence n (-1 when there is no pool).
KDA_HD int64_t write_slot(const RecurrentParams& p, int64_t n, int64_t t) {
  if (p.state == nullptr) return -1;
  if (p.num_spec_tokens > 0) return p.ssm_state_indices[n * (p.num_spec_tokens + 1) + t];
  return p.ssm_state_indices ? p.ssm_state_indices[n] : n;
}

// Pool slot the start state is read from (speculative decode: column clamp(accepted-1, 0, S)).
KDA_HD int64_t read_slot(const RecurrentParams& p, int64_t n) {
  if (p.num_spec_tokens > 0) {
    int64_t c = p.num_accepted_tokens ? static_cast<int64_t>(p.num_accepted_tokens[n]) - 1 : 0;
    c = c < 0 ? 0 : (c > p.num_spec_tokens ? p.num_spec_tokens : c);
    return p.ssm_state_indices[n * (p.num_spec_tokens + 1) + c];
  }
  return write_slot(p, n, 0);
}

// Where sequence n's start state comes from. kind: 0 zeros, 1 pool slot, 2 source slot, -1 inactive.
struct StartState {
  int kind;
  int64_t slot;
};

KDA_HD StartState start_state(const RecurrentParams& p, int64_t n) {
  if (p.state_source != nullptr) {
    int64_t s = p.initial_state_indices ? p.initial_state_indices[n] : n;  // null: identity (training)
    if (!slot_in_pool(s, p.n_source)) return {-1, s};
    // Non-speculative: the results go to the write slot; an invalid one makes the sequence inactive.
    if (p.state != nullptr && p.num_spec_tokens == 0 && !slot_in_pool(write_slot(p, n, 0), p.n_pool)) return {-1, s};
    return {2, s};
  }
  if (p.state == nullptr) return {0, 0};
  int64_t s = read_slot(p, n);
  if (!slot_in_pool(s, p.n_pool)) return {-1, s};
  return {1, s};
}

// In speculative decode a token whose write slot is outside the pool is inactive: zero output and the
// state is not advanced. Otherwise every token of an active sequence is active.
// A token past the 1+S columns of ssm_state_indices (a sequence longer than the contract allows) is
// inactive too, so the index row is never read out of bounds.
KDA_HD bool token_active(const RecurrentParams& p, int64_t n, int64_t t) {
  if (p.num_spec_tokens == 0 || p.state == nullptr) return true;
  if (t > p.num_spec_tokens) return false;
  return slot_in_pool(write_slot(p, n, t), p.n_pool);
}

constexpr float kL2NormEps = 1e-6f;  // q, k L2 norm: x * rsqrt(|x|^2 + eps) (docs/contract.md, Recurrence, step 1)

template <typename T>
KDA_HD T kda_sigmoid(T x) {
  return T(1) / (T(1) + exp(-x));
}

// Log-decay a for one channel (docs/contract.md, Recurrence, step 2). A = exp(A_log[hv]); dtb = dt_bias[hv, k] (0 if
// none).
template <typename T>
KDA_HD T gate_log_decay(GateMode mode, T g, T A, T dtb, T lower_bound) {
  if (mode == GateMode::kPrecomputed) return g;
  T x = g + dtb;
  if (mode == GateMode::kSoftplus) return -A * (x > T(20) ? x : log1p(exp(x)));
  return lower_bound * kda_sigmoid(A * x);
}

}  // namespace kda
