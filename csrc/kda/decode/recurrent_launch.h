// Host entry of the token-serial ("recurrent") KDA kernel family: decode (T=1), speculative decode
// (1+S tokens, per-token slot writes) and token-serial prefill (any T, checkpoints, final state).
// Included by the torch-facing csrc/api/recurrent_cuda.cpp; no torch types, no device code here.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"
#include "kda/route/route.h"

namespace kda {

// Launches the token-serial kernel of route `r` (route_forward: kSerial or kRing, with its tile) for `p` on
// `stream` (no host sync, no allocation: CUDA-graph capturable).
// Preconditions checked by the caller: bf16 token tensors; K == V in {64, 128}; state, source and
// checkpoint dtypes fp32 or bf16; 16-byte aligned state/source/checkpoint/final-state pointers and slot
// strides; q, k, g 16-byte aligned with strides that are multiples of 8 elements.
// Returns the launch error (cudaSuccess when nothing was launched because N == 0).
// disable_state_update: a verify pass: every token's output is computed by the same rules (slots, inactive
// sequences and tokens, checkpoints, final_state) but no pool slot is written.
cudaError_t launch_recurrent(const RecurrentParams& p, const ForwardRoute& r, cudaStream_t stream,
                             bool disable_state_update = false);

}  // namespace kda
