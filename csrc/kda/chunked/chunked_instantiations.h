// Declaration of the per-shape launch function of the chunked kernel; each (VB, stages, raw stages, BWD, kOut) is
// instantiated in its own csrc/kda/chunked/instantiations/chunked_vb<VB>*.cu so nvcc compiles them in parallel:
// VB = 64 / 128 with 3 operand stages and a 4-deep raw ring (~150 KB of shared memory), and VB = 64 with
// 2 / 2 (~94 KB) for GPUs with less shared memory per block (sm_120).
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda::prefill {

// Sets the shared-memory opt-in once per device and launches N * HV * (128 / VB) CTAs.
// BWD = true: the backward chain of the training backward (kda_chunked_kernel's comment). kOut = false
// (forward only): the state-only kernel for calls without an output (p.out null: the sequence split's
// end-state passes), its own instantiation (..._state.cu) so that the usual kernel's code is unchanged.
template <int VB, int STAGES, int RAW_STAGES, bool BWD, bool kOut = true>
cudaError_t run_chunked_(const RecurrentParams& p, bool out_vec16, int diag, cudaStream_t stream);

}  // namespace kda::prefill
