// Declaration of the per-tile launch function; each combination is instantiated in its own
// instantiations/recurrent_k<K>_<state>_nr<NR>.cu beside it so nvcc compiles them in parallel.
#pragma once
#include <cuda_runtime_api.h>

#include "kda/params.h"

namespace kda::decode {

constexpr int kCarveoutUntouched = -2;  // leave the function's shared-memory carveout preference alone
constexpr int kCarveoutMin = -3;        // the smallest carveout that holds the chosen blocks per SM

// Kernel flags (the kernel's second argument, RecurrentLaunch::flags). kFlagNoL1Prefetch is a schedule
// choice that leaves the results unchanged (a prefetch is only a hint); it is set by default because on
// H200 the prefetches cost more than they saved at large batch (bench_decode, B=256/1024: 5-8% faster
// without). The kDiag* switches (KDA_EXPERIMENT=recurrent_diag=n) are for benchmarks that take one stage out to see
// what it costs: they break the results on purpose and are never set in normal use.
constexpr int kDiagNoStateStore = 1;  // skip writing states back to the pool
constexpr int kDiagNoMath = 2;        // skip the token math (the state passes through unchanged)
constexpr int kFlagNoL1Prefetch = 4;  // skip the L1 prefetch of the next items' token inputs
// Speculative verify (disable_state_update): the outputs of every token are computed as usual but no pool
// slot is written (neither the final write of decode nor the per-token columns of speculative decode).
constexpr int kFlagNoStateUpdate = 8;
// Kernel flags of the ring kernel only. kFlagRingDtBiasGlobal: dt_bias is not 16-byte aligned (cannot be
// bulk-copied); the math warps read it from global memory instead. kFlagRingStateFirst
// (KDA_EXPERIMENT=ring_state_first=1, a schedule choice): the producer issues the state tile's copy before the
// token rows' (its slot is resolved two items ahead, so the large transfer need not queue behind four small
// ones).
constexpr int kFlagRingDtBiasGlobal = 16;
constexpr int kFlagRingStateFirst = 32;
// kFlagRingProducerDiverged (KDA_EXPERIMENT=ring_producer_diverged=1, a schedule choice): the producer lanes run
// their math warps' rings independently instead of in step (see the producer loop).
constexpr int kFlagRingProducerDiverged = 64;

// How to launch: chosen by csrc/kda/decode/recurrent_launch.cu (benchmark knobs come from the environment).
struct RecurrentLaunch {
  int warps_per_block = 4;
  int num_sms = 132;
  int max_blocks_per_sm = 0;            // 0: as many as fit
  int carveout_percent = kCarveoutMin;  // or kCarveoutUntouched, -1 (driver default), 0..100
  int flags = 4;                        // kernel flags: kFlagNoL1Prefetch (the default), kDiag* (benchmarks only)
  bool pdl = false;                     // programmatic dependent launch (kda/common/pdl.cuh)
};

// K: head dim (K == V, 64 or 128). StateT: pool storage type (float or __nv_bfloat16). NR: state rows
// per lane (1, 2, 4, 8); a warp owns NR * (32 / (K / 8)) value rows x all K of one (sequence, value head).
// Launches a persistent grid: at most as many blocks as fit on the SMs.
template <int K, typename StateT, int NR>
void run_recurrent_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream);

// The warp-specialised variant (recurrent_ring_kernel.cuh, sm_90+): a producer warp streams each item's
// state tile and first-token inputs into per-warp mbarrier rings by bulk copies, math warps consume them
// and store the tile back by bulk copy. Same bits as run_recurrent_. kVariant: the block shape (math warps,
// stages, blocks per SM: RingShape in recurrent_ring_kernel.cuh). Instantiated for bf16 tiles: K=128 NR 4
// and 8, K=64 NR 4 in shape 0 (instantiations/recurrent_ring_k<K>_bf16_nr<NR>.cu), and K=128 NR 8 in
// shape 1 (..._nr8_v1.cu; shapes 0, 2 and 3 in experiments builds); for fp32 tiles K=128 NR 4 in shape 1
// (recurrent_ring_k128_f32_nr4_v1.cu). Serial tiles NR 1 and 2 are experiments too.
template <int K, typename StateT, int NR, int kVariant>
void run_recurrent_ring_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream);

}  // namespace kda::decode
