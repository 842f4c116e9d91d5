// The launch knobs: every environment switch the C++ layer reads, read once per process (docs/env.md).
// No torch; host-only. The per-call path reads launch_knobs(), a snapshot that never changes under a call;
// reload_launch_knobs() (tests and benchmarks, through kda_ops._C) re-reads the environment and publishes a
// new snapshot.
#pragma once
#include <cstdint>
#include <string>

namespace kda {

// KDA_DECODE_KERNEL: the token-serial kernel family. auto: the ring kernel on bandwidth-bound grids (bf16
// tiles; fp32 K=128 tiles), the serial kernel on latency-bound ones; ring / serial pin one (same bits).
enum class DecodePin : int8_t { kAuto, kRing, kSerial };
// KDA_CHUNKED_KERNEL: the chunked prefill kernel family. auto: the Hopper kernel where it covers the call
// (sm_90a), else the mma.sync kernel with its value rows chosen from the grid; sm90 pins the Hopper kernel
// where it covers the call (the backward chain included on every grid); mma pins the mma.sync kernel; mma64 /
// mma128 also pin its value rows per CTA; mma_small its shallow pipeline of ~99 KiB GPUs (sm_120), anywhere.
enum class ChunkedPin : int8_t { kAuto, kSm90, kMma, kMma64, kMma128, kMmaSmall };
// KDA_TRAINING_SWEEP: the chunk-parallel sweep of the CUDA training backward. auto: the 64-token wgmma sweep
// on sm_90a for the softplus and lower-bound gates, else the 16-token sweep where its shared memory fits, else
// the small sweep, else the host route; wgmma64 / sub16 / small / host pin one (where it is built / fits).
enum class SweepPin : int8_t { kAuto, kSweep64, kSub16, kSmall, kHost };
// KDA_SEQUENCE_SPLIT: the exact sequence split of long sequences (kda_ops/_split.py). auto: when the cost
// model says it pays (CUDA only); off: never; on: whenever a sequence is longer than one segment.
enum class SplitPin : int8_t { kAuto, kOff, kOn };

// The experiment knobs (KDA_EXPERIMENT="key=value,..."): schedule and design variants kept for A/B work.
// Only a build with KDA_BUILD_EXPERIMENTS=1 reads them; elsewhere every field keeps its default (the product's
// choice) and a set KDA_EXPERIMENT is an error at import.
struct ExperimentKnobs {
  // Hopper chunked prefill: design 1..8 (Cfg in chunked_sm90_kernel.cuh), schedule bits (-1: the default),
  // the profile instantiation, state-only instantiation on/off.
  int sm90_variant = 3;
  int sm90_schedule = -1;
  bool sm90_profile = false;
  bool sm90_state_only = true;
  // Hopper 64-token backward sweep: the phase-clock instantiation and its grid (0: the product's grid).
  bool sweep64_profile = false;
  int sweep64_profile_grid = 0;
  // Token-serial kernels: the tile (rows per lane, 0: the heuristic), blocks per SM cap, shared-memory
  // carveout (-3: the smallest that fits, -1: the driver's, 100: max), L1 prefetch, warps per block cap,
  // PDL, the ring kernel's block shape for K=128 NR=8 and its flags (decode::kFlag*), fp32 pools on the ring.
  int rows_per_lane = 0;
  int blocks_per_sm = 0;
  int carveout = -3;
  bool l1_prefetch = false;
  int warps_per_block = 4;
  bool pdl = true;
  int ring_shape = 1;
  int ring_flags = 0;
  bool ring_fp32 = true;
  // Diagnostics that break results on purpose (benchmarks only): recurrent kDiag* bits, chunked kDiagNo* mask.
  int recurrent_diag = 0;
  int chunked_diag = 0;
};

struct LaunchKnobs {
  bool verbose = false;  // KDA_VERBOSE=1: one stderr line per call naming its route
  // KDA_BATCH_INVARIANT=1: every route is chosen without looking at the batch (sequence count, lengths, grid
  // size), and the sequence split is off, so a sequence's results do not depend on what else is in the call
  // (route_cuda.cu, route.cpp; docs/env.md)
  bool batch_invariant = false;
  DecodePin decode = DecodePin::kAuto;
  ChunkedPin chunked = ChunkedPin::kAuto;
  SweepPin sweep = SweepPin::kAuto;
  SplitPin split = SplitPin::kAuto;
  int64_t split_tokens = 0;  // KDA_SEQUENCE_SPLIT_TOKENS: forced segment length (a multiple of 64; 0: planned)
  ExperimentKnobs exp;
  std::string error;  // the first invalid value read (empty: all valid; invalid values keep their default)
};

// Whether this build compiles the experiment variants (KDA_BUILD_EXPERIMENTS=1).
constexpr bool kExperimentsBuilt =
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
    true;
#else
    false;
#endif

// The current snapshot (read from the environment at the first call in the process).
const LaunchKnobs& launch_knobs();
// Re-reads the environment; returns the new snapshot's error (empty when every value was valid). Snapshots
// are never freed, so a reference a concurrent call holds stays valid.
std::string reload_launch_knobs();

// The value names of the pins, as the environment spells them (for the verbose lines and errors).
const char* pin_name(DecodePin p);
const char* pin_name(ChunkedPin p);
const char* pin_name(SweepPin p);
const char* pin_name(SplitPin p);

}  // namespace kda
