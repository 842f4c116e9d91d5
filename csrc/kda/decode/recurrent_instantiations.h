// Declaration of the per-tile launch function; each combination is instantiated in its own
// csrc/instantiations/recurrent_k<K>_<state>_nr<NR>.cu so nvcc compiles them in parallel.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda::decode {

constexpr int kCarveoutUntouched = -2;  // leave the function's shared-memory carveout preference alone
constexpr int kCarveoutMin = -3;        // the smallest carveout that holds the chosen blocks per SM

// Kernel flag of the bulk-copy kernel (KDA_RECURRENT_BULK=2): write the pool slot back with a bulk store from
// the ring stage instead of from registers. (The other flags, kDiag* and kFlagNoL1Prefetch, are in
// recurrent_kernel.cuh.)
constexpr int kFlagBulkStore = 8;

// How to launch: chosen by csrc/kda/decode/recurrent_launch.cu (benchmark knobs come from the environment).
struct RecurrentLaunch {
  int warps_per_block = 4;
  int num_sms = 132;
  int max_blocks_per_sm = 0;                    // 0: as many as fit
  int carveout_percent = kCarveoutMin;          // or kCarveoutUntouched, -1 (driver default), 0..100
  int flags = 4;  // kernel flags: kFlagNoL1Prefetch (the default), kDiag* (benchmarks only)
  int bulk_stages = 3;  // ring depth of the bulk-copy kernel (run_recurrent_bulk_), 3..8
  int bulk_l2_ahead = 0;  // bulk-copy kernel: items past the ring whose state is prefetched into L2 (0: none)
};

// K: head dim (K == V, 64 or 128). StateT: pool storage type (float or __nv_bfloat16). NR: state rows
// per lane (1, 2, 4, 8); a warp owns NR * (32 / (K / 8)) value rows x all K of one (sequence, value head).
// Launches a persistent grid: at most as many blocks as fit on the SMs.
template <int K, typename StateT, int NR>
void run_recurrent_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream);

// The bulk-copy variant (recurrent_bulk_kernel.cuh, sm_90+): same results bit for bit, start state and
// first-token inputs fetched with 1-D bulk copies into a per-warp mbarrier ring of cfg.bulk_stages stages.
// Instantiated for NR = 4 and 8 (the launcher routes other tiles to run_recurrent_).
template <int K, typename StateT, int NR>
void run_recurrent_bulk_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream);

// The one-item-per-warp variant (recurrent_single_kernel.cuh): a plain grid of one warp per item, no ring;
// token loads, slot lookup and state loads issued back to back (the small-batch latency path). Same bits.
// Instantiated for NR = 2, 4 and 8.
template <int K, typename StateT, int NR>
void run_recurrent_single_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream);

}  // namespace kda::decode
