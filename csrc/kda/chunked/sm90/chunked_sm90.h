// Host entry of the Hopper (sm_90a) chunked prefill kernel (csrc/kda/chunked/sm90/chunked_sm90_kernel.cuh):
// TMA loads, wgmma with the state as a register-resident fp32 accumulator, mbarrier pipelines between the TMA
// issue, prep warpgroups and two chain warpgroups. No torch types.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda {

// Which chunked kernel a call takes, KDA_CHUNKED_KERNEL (read on every call, so a test can compare the
// kernels in one process): 2 = unset, empty or `auto` (the default: the Hopper kernel for the forward calls it
// covers, on any grid: on grids of N·HV <= SMs / 2, where the mma.sync kernel splits the value rows over two
// CTAs per head, it was measured faster too, 1.07 against 1.14-1.15 ms at H = 32 and 64, T = 8192; the backward
// chain keeps the mma.sync kernel on those grids), 1 = `sm90` (the Hopper kernel for every call it covers),
// 0 = `mma` or anything else (the mma.sync kernel always).
int chunked_sm90_mode();

// Whether the Hopper kernel covers `p` on the current device: compute capability 9.0, a prefill (checkpoints
// every multiple of 16 tokens, tapes, start-state source and state-only calls included; no speculative decode;
// seq_order is followed), bf16 tokens with 16-byte aligned rows and strides that are multiples of 8 elements
// (TMA), K = V = 128.
bool chunked_sm90_supported(const RecurrentParams& p);

// Launches one CTA per (sequence, value head) on `stream`; no host sync, no allocation. The TMA tensor
// maps are encoded on the host on every call (kernel parameters, so a CUDA graph captures them).
// backward_chain: `p` is the backward chain's (chain_as_recurrent, chunked_launch.cu: p.v holds dO, the start
// state dfinal_state, final_state receives dinitial_state, the checkpoints dS every 16 tokens); the chunks run
// last first.
cudaError_t launch_chunked_sm90(const RecurrentParams& p, cudaStream_t stream, bool backward_chain = false);

}  // namespace kda
