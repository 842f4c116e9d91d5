// Host entry of the chunked tensor-core kernel (csrc/kda/chunked/chunked_kernel.cuh): multi-token
// prefill of recurrent_kda in 16-token chunks. Included by csrc/api/recurrent_cuda.cpp; no torch types.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda {

// Whether the chunked kernel covers `p`: K == V == 128, no speculative decode, checkpoint interval a
// multiple of 16 (the Python API guarantees it). `why` names the first unmet condition.
bool chunked_supported(const RecurrentParams& p, const char** why);

// The automatic backend choice for a call the chunked kernel supports: chunked when the sequences are
// long enough on average (T >= 16 N) to fill chunks, token-serial otherwise (decode-heavy batches).
bool chunked_preferred(const RecurrentParams& p);

// Launches the chunked kernel on `stream`: one CTA per (sequence, value head, value-row part), no host
// sync and no allocation (CUDA-graph capturable). Preconditions as launch_recurrent (bf16 token tensors,
// 16-byte aligned q/k/g/v rows with strides that are multiples of 8 elements, aligned state buffers).
// KDA_CHUNKED_VB=64|128 (benchmarks) forces the value rows per CTA; KDA_CHUNKED_PIPELINE=small the
// shallow pipeline that GPUs with ~100 KB of shared memory per block get (sm_120); results do not depend
// on either. Both are read once per process, at the first call (chunked_launch.cu).
cudaError_t launch_chunked(const RecurrentParams& p, cudaStream_t stream);

// The backward chain of the CUDA training backward on the same kernel (BWD mode): walks each sequence's
// chunks last to first carrying the chain gradient dS (kda_ops/reference_chunked_backward.py, chain_step).
// `p` as for a training forward with tapes, except: p.v = dO, p.state_source = dfinal_state (fp32; null =
// zeros), p.final_state = dinitial_state, and p.state_checkpoints receives dS at the END of every 16-token
// chunk: row (every / 16) checkpoint_cu_starts[n] + j for chunk j (the training backward: every = 16 with a
// 16-token row prefix). Needs the default pipeline's ~150-160 KB of shared memory per block.
cudaError_t launch_chunked_backward_chain(const RecurrentParams& p, cudaStream_t stream);

}  // namespace kda
