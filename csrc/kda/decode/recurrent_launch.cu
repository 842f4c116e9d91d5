// Host dispatch of the token-serial kernel: picks the tile (rows per lane) and warps per block from the
// problem size and the device's SM count, then the template instantiation (csrc/instantiations/).
#include <cctype>
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

// Benchmark/test knobs, read from the environment once per process (the first launch) so that a decode
// step costs no getenv and concurrent callers see one consistent choice. None changes the results except
// KDA_RECURRENT_DIAG (benchmarks only):
//   KDA_RECURRENT_ROWS_PER_LANE=1|2|4|8 (the tile), KDA_RECURRENT_BLOCKS_PER_SM=n (cap),
//   KDA_RECURRENT_CARVEOUT=min|default|max, KDA_RECURRENT_L1_PREFETCH=1 (prefetch the next items' token
//   inputs into L1), KDA_RECURRENT_WARPS_PER_BLOCK=1|2|4 (cap), KDA_RECURRENT_DIAG=1|2|3;
//   KDA_DECODE_KERNEL=ring|serial: the kernel for bf16 tiles on sm_90+. Unset: the ring kernel where the
//   grid is bandwidth-bound (the 8-rows-per-lane heuristic tile: on H200 it moved bf16 decode from 2.3-2.4
//   to 3.5-3.7 TB/s at B=256/1024) and the serial kernel where it is latency-bound (the 4-rows tile, small
//   batches: B=1 took 5.1 us a step serial against 7.0 us on the ring); `ring` forces the ring kernel
//   wherever it applies, `serial` turns it off. The same bits either way. fp32 tiles take the serial
//   kernel on latency-bound grids and at K=64, the ring kernel's 4-rows tile otherwise (below);
//   KDA_DECODE_RING_VARIANT=0..3: the ring kernel's block shape for the K=128 NR=8 tile (default 1; RingShape in
//   recurrent_ring_kernel.cuh; other tiles use shape 0); KDA_DECODE_RING_STATE_FIRST=1: the producer
//   issues the state copy before the token rows; KDA_DECODE_RING_DT_BIAS=stage|global: dt_bias bulk-copied
//   into each stage (default) or read by the math warps from global memory (L1);
//   KDA_DECODE_RING_PRODUCER=converged|diverged: the producer lanes in step (default) or each on its own;
//   KDA_DECODE_RING_FP32=0: fp32 pools stay serial;
//   KDA_DECODE_PDL=0|1 (default 1 on sm_90+): programmatic dependent launch (kda/common/pdl.cuh), so
//   back-to-back decode steps overlap one's launch with the other's run (H200, B=1 bf16 per step in a graph
//   5.2 -> 4.6 us, a one-step graph replay 15.0 -> 9.6 us, an eager call 16.4 -> 10.5 us; large batches
//   unchanged).
struct Knobs {
  int rows_per_lane = 0;  // 0: the heuristic
  int max_blocks_per_sm = 0;
  int carveout_percent = decode::kCarveoutMin;
  int flags = decode::kFlagNoL1Prefetch;
  int max_warps_per_block = 4;
  bool ring = true;  // KDA_DECODE_KERNEL=serial turns it off
  bool ring_forced = false;  // KDA_DECODE_KERNEL=ring: also on latency-bound grids
  bool pdl = true;  // KDA_DECODE_PDL=0 turns it off
  int ring_variant = 1;  // 5 math warps x 4 stages: on H200 the fastest shape at B=256, B=1024 and spec decode
  bool ring_fp32 = true;  // KDA_DECODE_RING_FP32=0: fp32 pools keep the serial kernel everywhere
};

std::string lower(const char* s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return r;
}

const Knobs& knobs() {
  static const Knobs k = [] {
    Knobs r;
    if (const char* env = std::getenv("KDA_RECURRENT_ROWS_PER_LANE")) {
      const int v = std::atoi(env);
      if (v == 1 || v == 2 || v == 4 || v == 8) r.rows_per_lane = v;
    }
    if (const char* env = std::getenv("KDA_RECURRENT_BLOCKS_PER_SM")) r.max_blocks_per_sm = std::atoi(env);
    if (const char* env = std::getenv("KDA_RECURRENT_CARVEOUT")) {  // min (default) | default (driver) | max
      const std::string v(env);
      r.carveout_percent = v == "default" ? -1 : v == "max" ? 100 : decode::kCarveoutMin;
    }
    if (const char* env = std::getenv("KDA_RECURRENT_L1_PREFETCH"))
      r.flags = std::atoi(env) == 1 ? 0 : decode::kFlagNoL1Prefetch;
    if (const char* env = std::getenv("KDA_RECURRENT_DIAG")) r.flags |= std::atoi(env) & 3;
    if (const char* env = std::getenv("KDA_RECURRENT_WARPS_PER_BLOCK")) {
      const int v = std::atoi(env);
      if (v == 1 || v == 2 || v == 4) r.max_warps_per_block = v;
    }
    if (const char* env = std::getenv("KDA_DECODE_KERNEL")) {
      const std::string v = lower(env);
      r.ring = v != "serial";
      r.ring_forced = v == "ring";
    }
    if (const char* env = std::getenv("KDA_DECODE_RING_VARIANT")) {
      const int v = std::atoi(env);
      if (v >= 0 && v < 4) r.ring_variant = v;
    }
    if (const char* env = std::getenv("KDA_DECODE_PDL")) {
      const std::string v = lower(env);
      r.pdl = !(v == "0" || v == "false" || v == "off" || v == "no");
    }
    if (const char* env = std::getenv("KDA_DECODE_RING_FP32")) {  // off: 0/false/off/no, as KDA_DECODE_PDL
      const std::string v = lower(env);
      r.ring_fp32 = !(v == "0" || v == "false" || v == "off" || v == "no");
    }
    if (const char* env = std::getenv("KDA_DECODE_RING_DT_BIAS")) {  // stage (default) | global
      if (lower(env) == "global") r.flags |= decode::kFlagRingDtBiasGlobal;
    }
    if (const char* env = std::getenv("KDA_DECODE_RING_PRODUCER")) {  // converged (default) | diverged
      if (lower(env) == "diverged") r.flags |= decode::kFlagRingProducerDiverged;
    }
    if (const char* env = std::getenv("KDA_DECODE_RING_STATE_FIRST"))
      if (std::atoi(env) == 1) r.flags |= decode::kFlagRingStateFirst;
    return r;
  }();
  return k;
}

// The ring kernel bulk-copies the first token's q, k, g rows and v values: they must start 16-byte aligned
// (the recurrent_kda path guarantees it, vector_readable; other callers are checked here), and it needs
// sm_90+ (cp.async.bulk, mbarrier transaction counts).
bool ring_supported(const RecurrentParams& p) {
  if (cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(0) < 9) return false;
  auto ok = [&](const TokenTensor& t, int heads) {
    return reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0 && (p.B <= 1 || t.batch_stride % 8 == 0) &&
           (p.T <= 1 || t.token_stride % 8 == 0) && (heads <= 1 || t.head_stride % 8 == 0);
  };
  return ok(p.q, p.H) && ok(p.k, p.H) && ok(p.g, p.HV) && ok(p.v, p.HV);
}

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

cudaError_t launch_recurrent(const RecurrentParams& p, cudaStream_t stream, bool disable_state_update) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  const Knobs& kn = knobs();
  decode::RecurrentLaunch cfg;
  cfg.num_sms = num_sms_of_current_device();
  cfg.max_blocks_per_sm = kn.max_blocks_per_sm;
  cfg.carveout_percent = kn.carveout_percent;
  cfg.pdl = kn.pdl && cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(0) >= 9;
  cfg.flags = kn.flags | (disable_state_update ? decode::kFlagNoStateUpdate : 0);
  const int nr = kn.rows_per_lane != 0 ? kn.rows_per_lane : recurrent_rows_per_lane(p, cfg.num_sms);
  cfg.warps_per_block = kn.max_warps_per_block;
  const int rows_per_warp = nr * (32 / (p.K / 8));
  const int64_t warps = p.N * p.HV * (p.K / rows_per_warp);
  // Up to 4 warps (one head's neighbouring tiles) per block, fewer when that would leave SMs idle.
  while (cfg.warps_per_block > 1 && warps / cfg.warps_per_block < cfg.num_sms) cfg.warps_per_block /= 2;
  if ((warps + cfg.warps_per_block - 1) / cfg.warps_per_block > INT_MAX) return cudaErrorInvalidConfiguration;
  const DType tile_dtype =
      p.state != nullptr ? p.state_dtype : (p.state_source != nullptr ? p.state_source_dtype : DType::kFloat32);
  // The heuristic's 4-rows tile marks a latency-bound grid (whatever tile a knob forces): the serial
  // kernel's shorter chain wins there.
  const bool latency_bound = recurrent_rows_per_lane(p, cfg.num_sms) == 4;
  if (kn.ring && (kn.ring_forced || !latency_bound) && tile_dtype == DType::kBFloat16 && (nr == 4 || nr == 8) &&
      ring_supported(p)) {
    // Tiles: K=128 NR 4 or 8 as chosen; K=64 always NR=4 (its NR=8 tile spills under the ring's register cap).
    if (p.K == 128 && nr == 8) {
      switch (kn.ring_variant) {
        case 1: decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 1>(p, cfg, stream); break;
        case 2: decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 2>(p, cfg, stream); break;
        case 3: decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 3>(p, cfg, stream); break;
        default: decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 0>(p, cfg, stream); break;
      }
    } else if (p.K == 128) {
      decode::run_recurrent_ring_<128, __nv_bfloat16, 4, 0>(p, cfg, stream);
    } else {
      decode::run_recurrent_ring_<64, __nv_bfloat16, 4, 0>(p, cfg, stream);
    }
    return cudaGetLastError();
  }
  // fp32 pools: the ring kernel with the 4-rows tile, whose 4 KB of fp32 state per item fill a stage as the
  // bf16 8-rows tile does; K=128, on bandwidth-bound grids (everywhere with KDA_DECODE_KERNEL=ring). On H200,
  // serial -> ring in processes of the same position of a run: B=256 fp32 316.4 -> 310.6 us and 286.6 ->
  // 278.0 us, B=1024 1153 -> 1088 us. KDA_DECODE_RING_FP32=0: serial.
  if (kn.ring && kn.ring_fp32 && (kn.ring_forced || !latency_bound) && tile_dtype == DType::kFloat32 &&
      p.K == 128 && (kn.rows_per_lane == 0 || kn.rows_per_lane == 4) && ring_supported(p)) {
    decode::run_recurrent_ring_<128, float, 4, 1>(p, cfg, stream);
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
