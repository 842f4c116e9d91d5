// Declaration of the per-tile launch function; each combination is instantiated in its own
// csrc/instantiations/recurrent_k<K>_<state>_nr<NR>.cu so nvcc compiles them in parallel.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda::decode {

// K: head dim (K == V, 64 or 128). StateT: pool storage type (float or __nv_bfloat16). NR: state rows
// per lane (1, 2, 4, 8); a warp owns NR * (32 / (K / 8)) value rows x all K of one (sequence, value head).
// Launches a persistent grid: at most as many blocks of `warps_per_block` warps as fit on `num_sms` SMs.
template <int K, typename StateT, int NR>
void run_recurrent_(const RecurrentParams& p, int warps_per_block, int num_sms, cudaStream_t stream);

}  // namespace kda::decode
