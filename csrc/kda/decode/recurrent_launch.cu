// Host launch of the token-serial kernels on the route the spine chose (kda/route/route.h: kernel and tile): the
// warps per block from the problem size and the SM count, then the template instantiation (instantiations/).
#include <climits>
#include <cstdint>

#include "kda/decode/recurrent_instantiations.h"
#include "kda/common/device_info.h"
#include "kda/decode/recurrent_launch.h"
#include "kda/route/knobs.h"
#include "kda/static_switch.h"

namespace kda {
namespace {

int num_sms_of_current_device() {
  return cached_device_attribute<cudaDevAttrMultiProcessorCount>(132);
}

}  // namespace

cudaError_t launch_recurrent(const RecurrentParams& p, const ForwardRoute& r, cudaStream_t stream,
                             bool disable_state_update) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  // The schedule: defaults everywhere but in an experiments build (KDA_EXPERIMENT), where they may change how
  // the work is spread (never the results) or, with recurrent_diag, skip work on purpose.
  const ExperimentKnobs& x = launch_knobs().exp;
  decode::RecurrentLaunch cfg;
  cfg.num_sms = num_sms_of_current_device();
  cfg.max_blocks_per_sm = x.blocks_per_sm;
  cfg.carveout_percent = x.carveout;
  cfg.pdl = x.pdl && cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(0) >= 9;
  cfg.flags = (x.l1_prefetch ? 0 : decode::kFlagNoL1Prefetch) | (x.recurrent_diag & 3) | x.ring_flags |
              (disable_state_update ? decode::kFlagNoStateUpdate : 0);
  const int nr = r.rows_per_lane;
  cfg.warps_per_block = x.warps_per_block;
  const int rows_per_warp = nr * (32 / (p.K / 8));
  const int64_t warps = p.N * p.HV * (p.K / rows_per_warp);
  // Up to 4 warps (one head's neighbouring tiles) per block, fewer when that would leave SMs idle.
  while (cfg.warps_per_block > 1 && warps / cfg.warps_per_block < cfg.num_sms) cfg.warps_per_block /= 2;
  if ((warps + cfg.warps_per_block - 1) / cfg.warps_per_block > INT_MAX) return cudaErrorInvalidConfiguration;
  const DType tile_dtype =
      p.state != nullptr ? p.state_dtype : (p.state_source != nullptr ? p.state_source_dtype : DType::kFloat32);
  if (r.kernel == ForwardKernel::kRing) {
    if (tile_dtype == DType::kFloat32) {
      decode::run_recurrent_ring_<128, float, 4, 1>(p, cfg, stream);
    } else if (p.K == 64) {
      decode::run_recurrent_ring_<64, __nv_bfloat16, 4, 0>(p, cfg, stream);
    } else if (nr == 4) {
      decode::run_recurrent_ring_<128, __nv_bfloat16, 4, 0>(p, cfg, stream);
    } else if (r.ring_shape == 1) {
      decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 1>(p, cfg, stream);
    } else {
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
      switch (r.ring_shape) {  // (block shapes that lost to shape 1 on the H200: kept for A/B work)
        case 2:
          decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 2>(p, cfg, stream);
          break;
        case 3:
          decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 3>(p, cfg, stream);
          break;
        default:
          decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 0>(p, cfg, stream);
          break;
      }
#else
      return cudaErrorInvalidDeviceFunction;
#endif
    }
    return cudaGetLastError();
  }
  KDA_HEADDIM_SWITCH(p.K, kK, [&] {
    KDA_STATE_DTYPE_SWITCH(tile_dtype, StateT, [&] {
      KDA_ROWS_PER_LANE_SWITCH(nr, kNR, [&] { decode::run_recurrent_<kK, StateT, kNR>(p, cfg, stream); });
    });
  });
  return cudaGetLastError();
}

}  // namespace kda
