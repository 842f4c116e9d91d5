// Host entry of the token-serial ("recurrent") KDA kernel family: decode (T=1), speculative decode
// (1+S tokens, per-token slot writes) and token-serial prefill (any T, checkpoints, final state).
// Included by the torch-facing csrc/api/recurrent_cuda.cpp; no torch types, no device code here.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda {

// Launches the kernel for `p` on `stream` (no host sync, no allocation: CUDA-graph capturable).
// Preconditions checked by the caller: bf16 token tensors; K == V in {64, 128}; state, source and
// checkpoint dtypes fp32 or bf16; 16-byte aligned state/source/checkpoint/final-state pointers and slot
// strides; q, k, g 16-byte aligned with strides that are multiples of 8 elements.
// Returns the launch error (cudaSuccess when nothing was launched because N == 0).
//
// Environment knobs for benchmarks and tests, read once per process (see recurrent_launch.cu):
// KDA_RECURRENT_ROWS_PER_LANE (1, 2, 4 or 8: the tile), KDA_RECURRENT_BLOCKS_PER_SM, KDA_RECURRENT_CARVEOUT,
// KDA_RECURRENT_L1_PREFETCH, KDA_RECURRENT_WARPS_PER_BLOCK only change the schedule (results are
// bit-identical for every choice); KDA_RECURRENT_DIAG skips work on purpose.
// disable_state_update: a verify pass: every token's output is computed by the same rules (slots, inactive
// sequences and tokens, checkpoints, final_state) but no pool slot is written.
cudaError_t launch_recurrent(const RecurrentParams& p, cudaStream_t stream, bool disable_state_update = false);

// The tile the launcher would pick: state rows per lane (1, 2, 4, 8). Exposed for tests and benchmarks.
int recurrent_rows_per_lane(const RecurrentParams& p, int num_sms);

}  // namespace kda
