// Plain-old-data parameters handed from csrc/api (torch-facing) to the kernels (csrc/kda, csrc/cpu): the
// lowest layer with host_device.h and tape_rows.h, included by every other one and including none of them.
// No torch types here. Strides and offsets are in ELEMENTS and 64-bit (docs/contract.md, Errors: tensors
// past 2^31 elements work). Token tensors have a contiguous last dim; their batch/token/head strides are
// free (views of a fused projection work).
//
// The structs, one per family of calls:
//   RecurrentParams          the arguments of the recurrent_kda op (and of the training forward with tapes,
//                            which is that op with checkpoints): read by every backend of the op, the
//                            token-serial kernel (csrc/kda/decode), the chunked kernel (csrc/kda/chunked) and
//                            the CPU loop (csrc/cpu). Named after the op; every field means what it says here.
//   BackwardChainParams      the backward chain (csrc/kda/chunked/chunked_launch.h); the chunked kernel reads it
//                            through RecurrentParams fields in BWD mode, mapped in one place
//                            (chain_as_recurrent, chunked_launch.cu).
//   TrainingBackwardParams   the CUDA training backward's sweep and finishing kernels
//                            (csrc/kda/backward/backward_params.h).
#pragma once
#include <cstdint>

#include "kda/host_device.h"

namespace kda {

enum class GateMode : int { kPrecomputed = 0, kSoftplus = 1, kLowerBound = 2 };
enum class Backend : int { kAuto = 0, kChunked = 1, kRecurrent = 2 };
enum class DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat64 = 2, kFloat16 = 3 };

struct TokenTensor {
  const void* ptr = nullptr;  // [B, T, heads, dim] (beta: [B, T, heads]); dtype = Params::token_dtype
  int64_t batch_stride = 0;   // elements between rows of B (fixed layout; unused when packed)
  int64_t token_stride = 0;   // elements between consecutive tokens
  int64_t head_stride = 0;    // elements between heads

  // Element offset / typed pointer of the row (batch row, token index along T, head).
  KDA_HD int64_t offset(int64_t batch, int64_t tok, int64_t head) const {
    return batch * batch_stride + tok * token_stride + head * head_stride;
  }
  template <class E>
  KDA_HD const E* row(int64_t batch, int64_t tok, int64_t head) const {
    return static_cast<const E*>(ptr) + offset(batch, tok, head);
  }
};

// recurrent_kda: decode, speculative decode and prefill (docs/contract.md, API), and the training forward
// with tapes (checkpoints every kTapeChunk tokens, checkpoint_first = 1).
struct RecurrentParams {
  // Problem size. Fixed layout: N = B sequences of T tokens each. Packed: B = 1, N = len(cu_seqlens)-1,
  // T = total tokens.
  int64_t B = 0, T = 0, N = 0;
  int H = 0, HV = 0, K = 0, V = 0;
  DType token_dtype = DType::kBFloat16;  // q, k, v, g, beta, output share it

  TokenTensor q, k;     // [B, T, H, K]
  TokenTensor v;        // [B, T, HV, V]
  TokenTensor g;        // [B, T, HV, K]: raw gate input (or log-decay when precomputed)
  TokenTensor beta;     // [B, T, HV]: logits when beta_is_logit, else β itself
  void* out = nullptr;  // [B, T, HV, V], same strides rule as TokenTensor
  int64_t out_batch_stride = 0, out_token_stride = 0, out_head_stride = 0;

  const float* A_log = nullptr;    // [HV] fp32 (None for the precomputed gate)
  const float* dt_bias = nullptr;  // [HV, K] fp32, may be null (treated as 0)

  // State pool, updated in place: [n_pool, HV, V, K], K contiguous, inner [HV, V, K] compact,
  // slot stride `state_slot_stride` (>= HV*V*K). Null: start from zeros, write nothing to a pool.
  void* state = nullptr;
  DType state_dtype = DType::kFloat32;  // kFloat32 or kBFloat16 (kFloat64 on CPU for gradcheck)
  int64_t state_slot_stride = 0;
  int64_t n_pool = 0;

  // Read-only start states: state_source[initial_state_indices[n]] replaces the pool read.
  const void* state_source = nullptr;  // [n_source, HV, V, K], dtype state_source_dtype
  DType state_source_dtype = DType::kFloat32;
  int64_t source_slot_stride = 0;
  int64_t n_source = 0;
  const int32_t* initial_state_indices = nullptr;  // [N]; null with a source: slot n (training forward)

  // Packed input: sequence n owns tokens cu_seqlens[n] .. cu_seqlens[n+1]. Null for fixed layout.
  const void* cu_seqlens = nullptr;  // [N+1], int32 or int64
  bool cu_seqlens_int64 = false;

  // Slots: ssm_state_indices [N] (or [N, 1+S] in speculative decode, row stride = 1+S); null: slot n.
  const int32_t* ssm_state_indices = nullptr;
  int num_spec_tokens = 0;                       // S; 0 = not speculative
  const int32_t* num_accepted_tokens = nullptr;  // [N]; null means 1 everywhere
  const int32_t* seq_order = nullptr;            // [N] permutation, scheduling hint only

  // Final state per sequence, fp32 [N, HV, V, K]; only when `state` is null and a final state is asked.
  float* final_state = nullptr;

  // Checkpoints: row checkpoint_cu_starts[n] + j holds the state before token j*every of sequence n.
  void* state_checkpoints = nullptr;  // [C, HV, V, K], dtype checkpoint_dtype, compact
  DType checkpoint_dtype = DType::kFloat32;
  const int64_t* checkpoint_cu_starts = nullptr;  // [N+1]
  int64_t n_checkpoint_rows = 0;                  // C: rows at or past it are never written
  int checkpoint_every_n_tokens = 0;
  // First checkpoint written: the one before token checkpoint_first * every, at row checkpoint_cu_starts[n]
  // + j - checkpoint_first for the state before token j * every. 0 everywhere but the training tapes, which
  // skip the state before token 0 (the initial state, an input of the backward already): 1.
  int checkpoint_first = 0;

  float scale = 0.f;
  GateMode gate_mode = GateMode::kPrecomputed;
  float lower_bound = 0.f;
  bool use_qk_l2norm = true;
  bool beta_is_logit = false;
};

// The counts every param struct (and the api layer's TrainingShape) carries: B, T, N, H, HV. One copy rule
// where one struct is built from another.
template <class To, class From>
inline void copy_counts(To& to, const From& from) {
  to.B = from.B;
  to.T = from.T;
  to.N = from.N;
  to.H = from.H;
  to.HV = from.HV;
}

}  // namespace kda
