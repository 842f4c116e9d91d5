// The CUDA routes of the spine (route.h): the forward family, the backward chain and the training sweep. Host
// code only; the facts of each kernel (what it covers, its shared memory) come from the kernel's own launcher.
#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "kda/backward/backward_params.h"
#include "kda/chunked/chunked_launch.h"
#include "kda/chunked/sm90/chunked_sm90.h"
#include "kda/common/device_info.h"
#include "kda/route/route.h"

namespace kda {

DeviceFacts current_device_facts() {
  DeviceFacts f;
  f.sms = cached_device_attribute<cudaDevAttrMultiProcessorCount>(132);
  f.cc = cached_device_attribute<cudaDevAttrComputeCapabilityMajor>(0) * 10 +
         cached_device_attribute<cudaDevAttrComputeCapabilityMinor>(0);
  f.smem_optin = cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(227 * 1024);
  return f;
}

const char* kernel_name(ForwardKernel k) {
  switch (k) {
    case ForwardKernel::kSerial:
      return "serial";
    case ForwardKernel::kRing:
      return "ring";
    case ForwardKernel::kChunkedMma:
      return "chunked_mma";
    case ForwardKernel::kChunkedSm90:
      return "chunked_sm90";
  }
  return "?";
}

const char* sweep_name(SweepKernel s) {
  switch (s) {
    case SweepKernel::kSweep64:
      return "wgmma64";
    case SweepKernel::kSub16:
      return "sub16";
    case SweepKernel::kSmall:
      return "small";
    case SweepKernel::kHost:
      return "host";
  }
  return "?";
}

namespace {

// The token-serial tile: 8 rows per lane (the per-token prep amortised over the most rows) once there are enough
// warps for 8 per SM; below that (small batch, latency-bound) 4 rows per lane spread the few (sequence, head)
// pairs over more warps. Measured on an H200 (bench_decode, HV=32, K=128): NR=8 best from B=8 up, NR=4 at B=1;
// NR=1, 2 slower everywhere (kept in the experiments build).
int heuristic_rows_per_lane(const RecurrentParams& p, int sms) {
  const int rows_per_pass = 32 / (p.K / 8);
  return p.N * p.HV * (p.K / (8 * rows_per_pass)) >= int64_t(sms) * 8 ? 8 : 4;
}

// The ring kernel bulk-copies the first token's q, k, g rows and v values: they must start 16-byte aligned (the
// recurrent_kda path guarantees it; other callers are checked here), and it needs sm_90+ (cp.async.bulk, mbarrier
// transaction counts).
bool ring_supported(const RecurrentParams& p, const DeviceFacts& f) {
  if (f.cc < 90) return false;
  auto ok = [&](const TokenTensor& t, int heads) {
    return reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0 && (p.B <= 1 || t.batch_stride % 8 == 0) &&
           (p.T <= 1 || t.token_stride % 8 == 0) && (heads <= 1 || t.head_stride % 8 == 0);
  };
  return ok(p.q, p.H) && ok(p.k, p.H) && ok(p.g, p.HV) && ok(p.v, p.HV);
}

// Token-serial: the ring kernel where the grid is bandwidth-bound (the 8-rows tile: on an H200 bf16 decode moved
// from 2.3-2.4 to 3.5-3.7 TB/s at B=256/1024), the serial kernel where it is latency-bound (B=1: 5.1 us a step
// serial against 7.0 us on the ring). fp32 pools: the ring kernel's 4-rows tile (4 KB of fp32 state per item fill
// a stage as the bf16 8-rows tile does) on bandwidth-bound grids at K=128, else serial.
ForwardRoute route_token_serial(const RecurrentParams& p, const DeviceFacts& f, const LaunchKnobs& k) {
  ForwardRoute r;
  const int heuristic = heuristic_rows_per_lane(p, f.sms);
  const int nr = k.exp.rows_per_lane != 0 ? k.exp.rows_per_lane : heuristic;
  const bool latency_bound = heuristic == 4;  // (whatever tile an experiment forces)
  const DType tile =
      p.state != nullptr ? p.state_dtype : (p.state_source != nullptr ? p.state_source_dtype : DType::kFloat32);
  const bool ring =
      k.decode != DecodePin::kSerial && (k.decode == DecodePin::kRing || !latency_bound) && ring_supported(p, f);
  r.rows_per_lane = nr;
  if (ring && tile == DType::kBFloat16 && (nr == 4 || nr == 8)) {
    r.kernel = ForwardKernel::kRing;
    r.rows_per_lane = p.K == 128 ? nr : 4;  // (K=64: NR=4 only, its NR=8 tile spills under the ring's cap)
    r.ring_shape = p.K == 128 && nr == 8 ? k.exp.ring_shape : 0;
  } else if (ring && k.exp.ring_fp32 && tile == DType::kFloat32 && p.K == 128 &&
             (k.exp.rows_per_lane == 0 || k.exp.rows_per_lane == 4)) {
    r.kernel = ForwardKernel::kRing;
    r.rows_per_lane = 4;
    r.ring_shape = 1;
  } else {
    r.kernel = ForwardKernel::kSerial;
  }
  return r;
}

// Chunked: the Hopper kernel where it covers the call (auto / sm90), on any grid for the forward (on grids of
// N·HV <= SMs / 2, where the mma.sync kernel splits the value rows over two CTAs per head, it was measured faster
// too: 1.07 against 1.14-1.15 ms at H = 32 and 64, T = 8192); the backward chain keeps the mma.sync kernel on
// those grids under auto. Else the mma.sync kernel: two CTAs per head (64 value rows each) when the heads fill at
// most half of the SMs (the chain is latency-bound: two CTAs halve its per-chunk work at the cost of repeating
// the prep), the shallow pipeline where a block gets less shared memory (sm_120).
ForwardRoute route_chunked(const RecurrentParams& p, const DeviceFacts& f, const LaunchKnobs& k, bool bwd) {
  ForwardRoute r;
  // (batch-invariant: the large-grid choices on every grid)
  const bool small_grid = !k.batch_invariant && p.N * p.HV * 2 <= int64_t(f.sms);
  bool hopper = false;
  if (k.exp.chunked_diag != 0 && !bwd)
    hopper = false;  // (an experiment's diagnostic mask exists in the mma.sync kernel only)
  else if (k.chunked == ChunkedPin::kSm90)
    hopper = chunked_sm90_supported(p);
  else if (k.chunked == ChunkedPin::kAuto)
    hopper = !(bwd && small_grid) && chunked_sm90_supported(p);
  if (hopper) {
    r.kernel = ForwardKernel::kChunkedSm90;
    // (The backward chain has designs 1, 2 and, in an experiments build, 5; designs 5-8 serve forward calls with an
    // output: state-only calls take design 3's state-only instantiation.)
    const int v = !bwd && k.exp.sm90_variant >= 5 && p.out == nullptr ? 3 : k.exp.sm90_variant;
    r.sm90_variant = bwd ? (v == 1 || v == 5 ? v : 2) : v;
    // state-only calls (no output) of designs 3 and 4: that design's state-only instantiation (the same state
    // bits as its call with an output)
    r.state_only = !bwd && p.out == nullptr && (v == 3 || v == 4) && k.exp.sm90_state_only;
    return r;
  }
  r.kernel = ForwardKernel::kChunkedMma;
  r.state_only = !bwd && p.out == nullptr;
  int vb = small_grid ? 64 : 128;
  if (k.chunked == ChunkedPin::kMma64) vb = 64;
  if (k.chunked == ChunkedPin::kMma128) vb = 128;
  const bool force_small = k.chunked == ChunkedPin::kMmaSmall;
  if ((vb == 128 && chunked_mma_smem_bytes(128, false) > f.smem_optin) || force_small) vb = 64;
  r.value_rows = vb;
  r.small_pipeline = vb == 64 && (force_small || chunked_mma_smem_bytes(64, false) > f.smem_optin);
  return r;
}

void print_forward(const char* family, const RecurrentParams& p, const ForwardRoute& r, const DeviceFacts& f) {
  char detail[96];
  switch (r.kernel) {
    case ForwardKernel::kSerial:
      std::snprintf(detail, sizeof(detail), "rows_per_lane=%d", r.rows_per_lane);
      break;
    case ForwardKernel::kRing:
      std::snprintf(detail, sizeof(detail), "rows_per_lane=%d shape=%d", r.rows_per_lane, r.ring_shape);
      break;
    case ForwardKernel::kChunkedMma:
      std::snprintf(detail, sizeof(detail), "value_rows=%d pipeline=%s%s", r.value_rows,
                    r.small_pipeline ? "small" : "deep", r.state_only ? " state_only" : "");
      break;
    case ForwardKernel::kChunkedSm90:
      std::snprintf(detail, sizeof(detail), "variant=%d%s", r.sm90_variant, r.state_only ? " state_only" : "");
      break;
  }
  std::fprintf(stderr, "kda route: %s kernel=%s %s | N=%lld HV=%d T=%lld B=%lld K=%d sm_%d sms=%d\n", family,
               kernel_name(r.kernel), detail, static_cast<long long>(p.N), p.HV, static_cast<long long>(p.T),
               static_cast<long long>(p.B), p.K, f.cc, f.sms);
}

}  // namespace

ForwardRoute route_forward(const RecurrentParams& p, Backend backend, bool disable_state_update) {
  const LaunchKnobs& k = launch_knobs();
  const DeviceFacts f = current_device_facts();
  bool chunked = false;
  const char* why = nullptr;
  if (backend == Backend::kChunked) {
    if (!chunked_supported(p, &why)) {
      ForwardRoute r;
      r.error = why;
      return r;
    }
    if (disable_state_update) {
      ForwardRoute r;
      r.error = "the chunked kernel does not support disable_state_update=True";
      return r;
    }
    chunked = true;
  } else if (backend == Backend::kAuto) {
    // a verify pass writes no pool slot: only the token-serial kernels have that mode. Batch-invariant: chunked for
    // every packed call and every fixed-layout call of more than one token per sequence (the usual rule looks at
    // the mean length, which other sequences of the batch change)
    if (k.batch_invariant)
      chunked = !disable_state_update && (p.cu_seqlens != nullptr || p.T > 1) && chunked_supported(p, nullptr);
    else
      chunked = !disable_state_update && chunked_preferred(p);
  }
  const ForwardRoute r = chunked ? route_chunked(p, f, k, false) : route_token_serial(p, f, k);
  if (k.verbose) print_forward("forward", p, r, f);
  return r;
}

ForwardRoute route_backward_chain(const RecurrentParams& chain) {
  const LaunchKnobs& k = launch_knobs();
  const DeviceFacts f = current_device_facts();
  const ForwardRoute r = route_chunked(chain, f, k, true);
  if (k.verbose) print_forward("backward_chain", chain, r, f);
  return r;
}

// On sm_90a the Hopper 64-token sweep for the lower-bound and softplus gates, whose log-decays are <= 0 by
// construction (a precomputed g may hold positive ones, whose cross-block factors the 64-token sweep cannot take:
// those keep the 16-token sweep); elsewhere the 16-token sweep where a block gets its ~223 KiB of shared memory,
// the small one (S and dS in a global scratch, ~92 KiB) where it gets less (sm_120: ~99 KiB; the backward chain's
// shallow pipeline must fit too), the CPU op on host copies where even that does not fit.
SweepKernel route_training_sweep(int gate_mode) {
  const LaunchKnobs& k = launch_knobs();
  const DeviceFacts f = current_device_facts();
  SweepKernel s = SweepKernel::kHost;
  const bool fits16 = training_backward_chunked_smem_bytes(false) <= f.smem_optin;
  const bool fits_small =
      std::max(training_backward_chunked_smem_bytes(true), chunked_small_pipeline_smem_bytes()) <= f.smem_optin;
  switch (k.sweep) {
    case SweepPin::kHost:
      s = SweepKernel::kHost;
      break;
    case SweepPin::kSweep64:
      s = training_backward_sweep64_supported() ? SweepKernel::kSweep64
                                                : (fits16 ? SweepKernel::kSub16 : SweepKernel::kSmall);
      break;
    case SweepPin::kSmall:
      s = fits_small ? SweepKernel::kSmall : SweepKernel::kHost;
      break;
    case SweepPin::kSub16:
    case SweepPin::kAuto:
      if (k.sweep == SweepPin::kAuto && gate_mode != 0 && training_backward_sweep64_supported())
        s = SweepKernel::kSweep64;
      else if (fits16)
        s = SweepKernel::kSub16;
      else if (fits_small)
        s = SweepKernel::kSmall;
      break;
  }
  if (s == SweepKernel::kSmall && !fits_small) s = SweepKernel::kHost;
  if (k.verbose)
    std::fprintf(stderr, "kda route: training_backward sweep=%s | gate_mode=%d sm_%d smem_optin=%d\n", sweep_name(s),
                 gate_mode, f.cc, f.smem_optin);
  return s;
}

}  // namespace kda
