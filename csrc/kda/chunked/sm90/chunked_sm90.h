// Host entry of the Hopper (sm_90a) chunked prefill kernel (csrc/kda/chunked/sm90/chunked_sm90_kernel.cuh):
// TMA loads, wgmma with the state as a register-resident fp32 accumulator, mbarrier pipelines between the TMA
// issue, prep warpgroups and two chain warpgroups. No torch types.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"
#include "kda/route/route.h"

namespace kda {

// Whether the Hopper kernel covers `p` on the current device: compute capability 9.0, a prefill (checkpoints
// every multiple of 16 tokens, tapes, start-state source and state-only calls included; no speculative decode;
// seq_order is followed), bf16 tokens with 16-byte aligned rows and strides that are multiples of 8 elements
// (TMA), K = V = 128.
bool chunked_sm90_supported(const RecurrentParams& p);

// Launches one CTA per (sequence, value head) on `stream` with the design of route `r` (route_forward /
// route_backward_chain); no host sync, no allocation. The TMA tensor maps are encoded on the host on every call
// (kernel parameters, so a CUDA graph captures them). backward_chain: `p` is the backward chain's
// (chain_as_recurrent, chunked_launch.h: p.v holds dO, the start state dfinal_state, final_state receives
// dinitial_state, the checkpoints dS every 16 tokens); the chunks run last first.
cudaError_t launch_chunked_sm90(const RecurrentParams& p, const ForwardRoute& r, cudaStream_t stream,
                                bool backward_chain);

}  // namespace kda
