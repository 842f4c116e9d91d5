// The routing spine: for each op family one function decides which kernel runs, and how, from the call's
// params, the device's properties and the launch knobs (knobs.h, read once per process). Launchers run the
// route they are given; they decide nothing. KDA_VERBOSE=1 prints every route in one stderr line.
//
//   family                                         function                  where
//   decode, speculative decode, prefill,           route_forward             route_cuda.cu (CUDA builds)
//     training forward (tapes)
//   backward chain of the training backward         route_backward_chain      route_cuda.cu
//   chunk-parallel sweep of the training backward  route_training_sweep      route_cuda.cu
//   exact sequence split (kda_ops/_split.py)       route_split               route.cpp (every build; Python
//                                                                             asks it through kda_ops._C)
// No torch types. A new route is added here, not in a launcher or in Python.
#pragma once
#include <cstdint>

#include "kda/params.h"
#include "kda/route/knobs.h"

namespace kda {

// The device facts a route depends on (of the current device, cached per device).
struct DeviceFacts {
  int sms = 132;
  int cc = 0;                   // compute capability, major * 10 + minor (90: H100 / H200)
  int smem_optin = 227 * 1024;  // the largest dynamic shared memory a block may opt into, bytes
};
DeviceFacts current_device_facts();  // (route_cuda.cu)

// ---- forward: decode, speculative decode, prefill, training forward ----------------------------------------
enum class ForwardKernel : int8_t {
  kSerial,       // token-serial kernel (kda/decode/recurrent_kernel.cuh): state rows in registers
  kRing,         // token-serial, warp-specialised (kda/decode/recurrent_ring_kernel.cuh, sm_90+)
  kChunkedMma,   // chunked prefill, mma.sync (kda/chunked/chunked_kernel.cuh): every CUDA arch
  kChunkedSm90,  // chunked prefill, TMA + wgmma (kda/chunked/sm90/chunked_sm90_kernel.cuh): sm_90a
};
struct ForwardRoute {
  ForwardKernel kernel = ForwardKernel::kSerial;
  int rows_per_lane = 4;        // token-serial tiles: state rows per lane (4 or 8; 1 and 2 in experiments)
  int ring_shape = 0;           // the ring kernel's block shape (RingShape)
  int value_rows = 128;         // chunked mma.sync: value rows per CTA (64: two CTAs per head)
  bool small_pipeline = false;  // chunked mma.sync: the shallow pipeline of ~99 KiB GPUs (sm_120)
  bool state_only = false;      // chunked: a state-only call (1-D empty output), no output product
  int sm90_variant = 3;         // chunked Hopper: the design (3 forward, 2 backward chain; others in experiments)
  const char* error = nullptr;  // a pinned backend that cannot run the call: the caller raises this
};
const char* kernel_name(ForwardKernel k);

// recurrent_kda (backend: auto / chunked / recurrent; disable_state_update: speculative verify) and the training
// forward (backend chunked when supported, else recurrent: the caller passes kAuto).
ForwardRoute route_forward(const RecurrentParams& p, Backend backend, bool disable_state_update);
// The backward chain (the chunked kernel in BWD mode on `chain`, chain_as_recurrent's params).
ForwardRoute route_backward_chain(const RecurrentParams& chain);

// ---- training backward: the chunk-parallel sweep --------------------------------------------------------------
enum class SweepKernel : int8_t {
  kSweep64,  // Hopper 64-token wgmma sweep (kda/backward/sm90/sweep64_sm90.cu): sm_90a, softplus / lower-bound
  kSub16,    // 16-token sweep (kda/backward/sweep.cu): ~223 KiB of shared memory per block
  kSmall,    // the same with S and dS in a global scratch (~92 KiB): sm_120
  kHost,     // the CPU op on host copies: GPUs that fit none of them (not capturable)
};
const char* sweep_name(SweepKernel s);
SweepKernel route_training_sweep(int gate_mode);

// ---- the exact sequence split ---------------------------------------------------------------------------------
struct SplitQuery {
  const int64_t* lens = nullptr;  // host lengths of the call's sequences; null: lengths only on the device
  int64_t n = 0;
  int64_t tokens = 0;  // (lens null) the call's token rows: planned as one sequence of them (route.cpp)
  int HV = 0;
  bool on_cuda = false;   // false: CPU (planned as for a 132-SM Hopper GPU; auto never splits there)
  int device_index = 0;   // CUDA device of the call
  bool training = false;  // the training split (its own threshold and cost model)
  int64_t multiple = 64;  // segment lengths are a multiple of this (64, or lcm(64, checkpoint period))
};
// The segment length of the split, or 0 (no split: the switch off, no sequence longer than one segment, or under
// auto the cost model says it does not pay).
int64_t route_split(const SplitQuery& q);
// Its two rules, exposed for tests and benchmarks: the shortest segment length (a multiple of `multiple`) whose
// chains Σ ceil(L / Ls) · HV fit the SMs; whether the split's passes beat the unsplit critical path.
// ---- the CPU ops ----------------------------------------------------------------------------------------------
// Every CPU op runs the token loop (csrc/cpu), whatever the backend argument; with KDA_VERBOSE=1 it says so in the
// route line's format, so the route of any call, on any device, is one stderr line.
void note_cpu_route(const char* family, int64_t N, int64_t HV, int64_t T, int64_t B, int64_t K);

int64_t plan_segments(const int64_t* lens, int64_t n, int HV, int sms, int64_t multiple);
bool split_pays(const int64_t* lens, int64_t n, int HV, int sms, int64_t Ls, double rows128_cost);

}  // namespace kda
