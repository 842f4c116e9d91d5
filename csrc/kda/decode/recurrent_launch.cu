// Host dispatch of the token-serial kernel: picks the tile (rows per lane) and warps per block from the
// problem size and the device's SM count, then the template instantiation (csrc/instantiations/).
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kda/decode/recurrent_instantiations.h"
#include "kda/common/device_info.h"
#include "kda/decode/recurrent_launch.h"
#include "kda/static_switch.h"

namespace kda {
namespace {

int num_sms_of_current_device() { return cached_device_attribute<cudaDevAttrMultiProcessorCount>(132); }

}  // namespace

int recurrent_rows_per_lane(const RecurrentParams& p, int num_sms) {
  // The largest tile (8 rows per lane: the per-token prep of norms and gates amortised over the most rows)
  // once there are enough warps for 8 per SM; below that (small batch, latency-bound) 4 rows per lane
  // spread the few (sequence, head) pairs over more warps. Measured on H200 (bench_decode, HV=32, K=128):
  // NR=8 is best from B=8 up, NR=4 at B=1; NR=1, 2 were slower everywhere.
  const int rows_per_pass = 32 / (p.K / 8);
  const int64_t units = p.N * p.HV;
  return units * (p.K / (8 * rows_per_pass)) >= int64_t(num_sms) * 8 ? 8 : 4;
}

cudaError_t launch_recurrent(const RecurrentParams& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  decode::RecurrentLaunch cfg;
  cfg.num_sms = num_sms_of_current_device();
  int nr = recurrent_rows_per_lane(p, cfg.num_sms);
  // Benchmark/test knobs (read per call; none changes the results except KDA_RECURRENT_DIAG):
  //   KDA_RECURRENT_ROWS_PER_LANE=1|2|4|8, KDA_RECURRENT_BLOCKS_PER_SM=n (cap), KDA_RECURRENT_CARVEOUT=min|default|max,
  //   KDA_RECURRENT_L1_PREFETCH=1 (prefetch the next items' token inputs into L1), KDA_RECURRENT_DIAG=1|2|3.
  if (const char* env = std::getenv("KDA_RECURRENT_ROWS_PER_LANE")) {
    const int v = std::atoi(env);
    if (v == 1 || v == 2 || v == 4 || v == 8) nr = v;
  }
  if (const char* env = std::getenv("KDA_RECURRENT_BLOCKS_PER_SM")) cfg.max_blocks_per_sm = std::atoi(env);
  if (const char* env = std::getenv("KDA_RECURRENT_CARVEOUT")) {  // min (default) | default (driver) | max
    const std::string v(env);
    cfg.carveout_percent = v == "default" ? -1 : v == "max" ? 100 : decode::kCarveoutMin;
  }
  if (const char* env = std::getenv("KDA_RECURRENT_L1_PREFETCH")) cfg.flags = std::atoi(env) == 1 ? 0 : 4;
  if (const char* env = std::getenv("KDA_RECURRENT_DIAG")) cfg.flags |= std::atoi(env) & 3;
  // Bulk-copy kernel (recurrent_bulk_kernel.cuh): KDA_RECURRENT_BULK=1 (start state + first-token q/k/g +
  // dt_bias by 1-D bulk copies into an mbarrier ring, pool written from registers) or 2 (the same, and the
  // pool write is a bulk store from the ring), KDA_RECURRENT_BULK_STAGES=3..8 (ring depth, default 3).
  // KDA_RECURRENT_WARPS_PER_BLOCK=1|2|4 caps the block shape (all kernels).
  int bulk = 0;
  if (const char* env = std::getenv("KDA_RECURRENT_BULK")) bulk = std::atoi(env);
  // One-item-per-warp kernel (recurrent_single_kernel.cuh): KDA_RECURRENT_SINGLE=1 uses it when the items fit
  // in 8 warps per SM (small batch), 2 for any size (tests). Tiles NR 2, 4, 8; it takes precedence over BULK.
  int single = 0;
  if (const char* env = std::getenv("KDA_RECURRENT_SINGLE")) single = std::atoi(env);
  if (const char* env = std::getenv("KDA_RECURRENT_BULK_STAGES")) cfg.bulk_stages = std::atoi(env);
  // KDA_RECURRENT_BULK_L2_AHEAD=D: the bulk kernel also prefetches into L2 the state of the item D past its
  // ring (0 = off, the default; clamped to 16 - stages).
  if (const char* env = std::getenv("KDA_RECURRENT_BULK_L2_AHEAD")) cfg.bulk_l2_ahead = std::atoi(env);
  int max_wpb = 4;
  if (const char* env = std::getenv("KDA_RECURRENT_WARPS_PER_BLOCK")) {
    const int v = std::atoi(env);
    if (v == 1 || v == 2 || v == 4) max_wpb = v;
  }
  cfg.warps_per_block = max_wpb;
  const int rows_per_warp = nr * (32 / (p.K / 8));
  const int64_t warps = p.N * p.HV * (p.K / rows_per_warp);
  // Up to 4 warps (one head's neighbouring tiles) per block, fewer when that would leave SMs idle.
  while (cfg.warps_per_block > 1 && warps / cfg.warps_per_block < cfg.num_sms) cfg.warps_per_block /= 2;
  if ((warps + cfg.warps_per_block - 1) / cfg.warps_per_block > INT_MAX) return cudaErrorInvalidConfiguration;
  const DType tile_dtype =
      p.state != nullptr ? p.state_dtype : (p.state_source != nullptr ? p.state_source_dtype : DType::kFloat32);
  const bool use_single = (nr == 2 || nr == 4 || nr == 8) &&
                          (single == 2 || (single == 1 && warps <= int64_t(cfg.num_sms) * 8));
  if (use_single) {
    KDA_HEADDIM_SWITCH(p.K, kK, [&] {
      KDA_STATE_DTYPE_SWITCH(tile_dtype, StateT, [&] {
        if (nr == 8)
          decode::run_recurrent_single_<kK, StateT, 8>(p, cfg, stream);
        else if (nr == 4)
          decode::run_recurrent_single_<kK, StateT, 4>(p, cfg, stream);
        else
          decode::run_recurrent_single_<kK, StateT, 2>(p, cfg, stream);
      });
    });
    return cudaGetLastError();
  }
  // The bulk kernel needs sm_90+ (cp.async.bulk, mbarrier tx counts), an instantiated tile (NR 4 or 8) and a
  // 16-byte aligned dt_bias (its rows are bulk-copied); anything else runs the cp.async-ring kernel, which
  // gives the same bits. (The pool, q, k, g alignment it needs is the launcher's precondition already.)
  const bool use_bulk = (bulk == 1 || bulk == 2) && (nr == 4 || nr == 8) &&
                        cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(0) >= 9 &&
                        reinterpret_cast<uintptr_t>(p.dt_bias) % 16 == 0;
  if (use_bulk) {
    if (bulk == 2) cfg.flags |= decode::kFlagBulkStore;
    KDA_HEADDIM_SWITCH(p.K, kK, [&] {
      KDA_STATE_DTYPE_SWITCH(tile_dtype, StateT, [&] {
        if (nr == 8)
          decode::run_recurrent_bulk_<kK, StateT, 8>(p, cfg, stream);
        else
          decode::run_recurrent_bulk_<kK, StateT, 4>(p, cfg, stream);
      });
    });
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
