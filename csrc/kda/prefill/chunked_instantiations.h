// Declaration of the per-shape launch function of the chunked kernel; each VB (value rows per CTA) is
// instantiated in its own csrc/instantiations/chunked_vb<VB>.cu so nvcc compiles them in parallel.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda::prefill {

// Sets the shared-memory opt-in once per device and launches N * HV * (128 / VB) CTAs.
template <int VB>
cudaError_t run_chunked_(const RecurrentParams& p, bool out_vec16, int diag, cudaStream_t stream);

}  // namespace kda::prefill
