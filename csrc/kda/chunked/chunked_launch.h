// Host entry of the chunked tensor-core kernel (csrc/kda/chunked/chunked_kernel.cuh): multi-token
// prefill of recurrent_kda in 16-token chunks. Included by csrc/api/recurrent_cuda.cpp; no torch types.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"
#include "kda/route/route.h"

namespace kda {

// Whether the chunked kernel covers `p`: K == V == 128, no speculative decode, checkpoint interval a
// multiple of 16 (the Python API guarantees it). `why` names the first unmet condition.
bool chunked_supported(const RecurrentParams& p, const char** why);

// The automatic backend choice for a call the chunked kernel supports: chunked when the sequences are
// long enough on average (T >= 16 N) to fill chunks, token-serial otherwise (decode-heavy batches).
bool chunked_preferred(const RecurrentParams& p);

// Launches the chunked kernel of route `r` (route_forward: kChunkedMma or kChunkedSm90) on `stream`: one CTA per
// (sequence, value head, value-row part), no host sync and no allocation (CUDA-graph capturable). Preconditions
// as launch_recurrent (bf16 token tensors, 16-byte aligned q/k/g/v rows with strides that are multiples of 8
// elements, aligned state buffers).
cudaError_t launch_chunked(const RecurrentParams& p, const ForwardRoute& r, cudaStream_t stream);

// Dynamic shared memory of the mma.sync kernel with `value_rows` per CTA and the default pipeline, or its
// shallow pipeline (`small`), bytes (the route compares them with the device's opt-in limit).
int64_t chunked_mma_smem_bytes(int value_rows, bool small);

// Dynamic shared memory of the chunked kernel's shallow pipeline (64 value rows, 2 operand stages, 2-deep raw ring),
// bytes: what a GPU must give a block for the chunked kernel at all (sm_120: ~94 KB of its ~99 KB).
int64_t chunked_small_pipeline_smem_bytes();

// The arguments of the backward chain of the CUDA training backward, named for what they carry
// (every gate mode, K == V == 128, bf16 token tensors with 16-byte aligned rows and
// strides that are multiples of 8 elements; the training contract). The chunked kernel reads them through
// RecurrentParams' fields in BWD mode; chain_as_recurrent (chunked_launch.cu) is the one place that maps them.
struct BackwardChainParams {
  int64_t B = 0, T = 0, N = 0;       // as RecurrentParams: fixed N = B; packed B = 1, N = len(cu_seqlens) - 1
  int H = 0, HV = 0;                 // K = V = 128
  TokenTensor q, k;                  // [B, T, H, 128]
  TokenTensor g;                     // [B, T, HV, 128] raw gate input
  TokenTensor beta;                  // [B, T, HV] logits (or β, beta_is_logit = false)
  TokenTensor dout;                  // [B, T, HV, 128] dL/do
  const float* A_log = nullptr;      // [HV]; null with the precomputed gate
  const float* dt_bias = nullptr;    // [HV, 128], may be null (0)
  const void* cu_seqlens = nullptr;  // [N+1] int32 / int64; null for the fixed layout
  bool cu_seqlens_int64 = false;
  GateMode gate_mode = GateMode::kLowerBound;
  float scale = 0.f, lower_bound = 0.f;  // (lower_bound: the lower-bound gate's λ)
  bool beta_is_logit = true;             // beta holds logits (else β itself)
  bool use_qk_l2norm = true;             // q, k L2-normalised in the op
  const float* dfinal_state = nullptr;   // [N, HV, 128, 128] compact fp32, 16-byte aligned; null = zeros
  float* dinitial_state = nullptr;       // out: [N, HV, 128, 128] compact fp32
  // out: the chain gradient dS at the END of every dstate_every-token chunk (16 or 64; the sequence's last chunk
  // ends at its last token), fp32 [n_dstate_rows, HV, 128, 128], row dstate_cu_starts[n] + j for chunk j of
  // sequence n (launch_tape_cu_starts with chunk dstate_every, first 0); rows at or past n_dstate_rows are never
  // written.
  float* dstates = nullptr;
  const int64_t* dstate_cu_starts = nullptr;  // [N+1]
  int64_t n_dstate_rows = 0;
  int dstate_every = 16;  // 16: the 16-token sweep (sweep.cu); 64: the Hopper 64-token sweep (sm90/sweep64_sm90.cu)
};

// The backward chain's arguments as the chunked kernel reads them in BWD mode (v carries dO, the read-only start
// state dfinal_state, final_state receives dinitial_state, the checkpoints dS at the end of its chunks).
RecurrentParams chain_as_recurrent(const BackwardChainParams& c);

// The backward chain on the chunked kernel of route `r` (route_backward_chain of chain_as_recurrent(c)): walks
// each sequence's chunks last to first carrying the chain gradient dS (kda_ops/reference_chunked_backward.py,
// chain_step), writing dstates and dinitial_state. Needs the default pipeline's ~150-160 KB of shared memory per
// block (the shallow one on ~99 KiB GPUs).
cudaError_t launch_chunked_backward_chain(const RecurrentParams& chain, const ForwardRoute& r, cudaStream_t stream);

}  // namespace kda
