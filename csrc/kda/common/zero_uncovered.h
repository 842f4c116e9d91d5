// Zeroing of the output tokens no packed sequence covers (token_coverage.h), for an output that
// recurrent_kda allocated itself (torch.empty): such tokens must read as zero, not as stale memory, even
// under a broken cu_seqlens contract. A caller's `output` keeps those tokens as they were and never
// comes here. Host-only declaration, no torch.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda {

// Writes +0.0 to out[0, t, hv, :] for every token t outside every sequence of p (p.cu_seqlens non-null,
// p.B == 1). Reads cu_seqlens on the device: no host sync, capturable in a CUDA graph. With the caller
// contract (every token covered) each block reads cu_seqlens once and writes nothing. Independent of
// the recurrent/chunked kernels; order on `stream` does not matter (they write disjoint tokens).
cudaError_t launch_zero_uncovered_tokens(const RecurrentParams& p, cudaStream_t stream);

}  // namespace kda
