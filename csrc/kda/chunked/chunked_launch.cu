// Host launch of the chunked prefill kernels on the route the spine chose (kda/route/route.h): the mma.sync
// kernel's instantiations here, the Hopper kernel through its own launcher (sm90/chunked_sm90_launch.cu).
#include <cstdint>

#include "kda/common/device_info.h"
#include "kda/chunked/chunked_instantiations.h"
#include "kda/chunked/chunked_kernel.cuh"  // (sizeof the shared-memory layouts only)
#include "kda/chunked/chunked_launch.h"
#include "kda/chunked/sm90/chunked_sm90.h"
#include "kda/common/recurrent_rules.h"  // out_rows_vec16
#include "kda/route/knobs.h"

namespace kda {
namespace {

// Largest dynamic shared memory one block may opt into (227 KB on sm_90/sm_100, 99 KB on sm_120).
int max_smem_optin() {
  return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(227 * 1024);
}

constexpr int kSmem64 = static_cast<int>(sizeof(prefill::ChunkedSmem<64, 3, 4>));
constexpr int kSmem128 = static_cast<int>(sizeof(prefill::ChunkedSmem<128, 3, 4>));
constexpr int kSmemSmall = static_cast<int>(sizeof(prefill::ChunkedSmem<64, 2, 2>));

}  // namespace

int64_t chunked_small_pipeline_smem_bytes() {
  return kSmemSmall;
}

int64_t chunked_mma_smem_bytes(int value_rows, bool small) {
  return small ? kSmemSmall : (value_rows == 128 ? kSmem128 : kSmem64);
}

bool chunked_supported(const RecurrentParams& p, const char** why) {
  const char* w = nullptr;
  if (p.K != 128 || p.V != 128)
    w = "the chunked kernel needs K == V == 128";
  else if (p.num_spec_tokens > 0)
    w = "the chunked kernel does not run speculative decode (num_spec_tokens > 0)";
  else if (p.checkpoint_every_n_tokens % 16 != 0)
    w = "the chunked kernel needs checkpoint_every_n_tokens to be a multiple of 16";
  else if (kSmemSmall > max_smem_optin())
    w = "the chunked kernel needs about 94 KB of shared memory per block, more than this GPU allows";
  if (why != nullptr) *why = w;
  return w == nullptr;
}

bool chunked_preferred(const RecurrentParams& p) {
  if (!chunked_supported(p, nullptr) || p.N <= 0) return false;
  const int64_t tokens = p.cu_seqlens != nullptr ? p.T : p.T * p.B;
  return tokens >= 16 * p.N;
}

cudaError_t launch_chunked(const RecurrentParams& p, const ForwardRoute& r, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  if (r.kernel == ForwardKernel::kChunkedSm90) return launch_chunked_sm90(p, r, stream, /*backward_chain=*/false);
  if (r.kernel != ForwardKernel::kChunkedMma) return cudaErrorInvalidValue;
  const bool out_vec16 = out_rows_vec16(p);
  const int diag = launch_knobs().exp.chunked_diag;  // (experiments build only; 0 elsewhere)
  if (r.value_rows == 128)
    return r.state_only ? prefill::run_chunked_<128, 3, 4, false, false>(p, out_vec16, diag, stream)
                        : prefill::run_chunked_<128, 3, 4, false>(p, out_vec16, diag, stream);
  if (r.small_pipeline)
    return r.state_only ? prefill::run_chunked_<64, 2, 2, false, false>(p, out_vec16, diag, stream)
                        : prefill::run_chunked_<64, 2, 2, false>(p, out_vec16, diag, stream);
  return r.state_only ? prefill::run_chunked_<64, 3, 4, false, false>(p, out_vec16, diag, stream)
                      : prefill::run_chunked_<64, 3, 4, false>(p, out_vec16, diag, stream);
}

// BackwardChainParams -> the RecurrentParams fields the chunked kernel reads in BWD mode: v carries dO, the
// read-only start state (state_source, slot n) dfinal_state, final_state receives dinitial_state, and the
// checkpoints (every dstate_every tokens, at dstate_cu_starts) receive dS at the end of those chunks; no output, no
// pool.
RecurrentParams chain_as_recurrent(const BackwardChainParams& c) {
  constexpr int kDim = prefill::kHeadDim;
  RecurrentParams p;
  copy_counts(p, c);
  p.K = kDim;
  p.V = kDim;
  p.token_dtype = DType::kBFloat16;
  p.q = c.q;
  p.k = c.k;
  p.v = c.dout;
  p.g = c.g;
  p.beta = c.beta;
  p.A_log = c.A_log;
  p.dt_bias = c.dt_bias;
  if (c.dfinal_state != nullptr) {
    p.state_source = c.dfinal_state;
    p.state_source_dtype = DType::kFloat32;
    p.source_slot_stride = int64_t(c.HV) * kDim * kDim;
    p.n_source = c.N;
  }
  p.cu_seqlens = c.cu_seqlens;
  p.cu_seqlens_int64 = c.cu_seqlens_int64;
  p.final_state = c.dinitial_state;
  p.state_checkpoints = c.dstates;
  p.checkpoint_dtype = DType::kFloat32;
  p.checkpoint_cu_starts = c.dstate_cu_starts;
  p.n_checkpoint_rows = c.n_dstate_rows;
  p.checkpoint_every_n_tokens = c.dstate_every;
  p.scale = c.scale;
  p.gate_mode = c.gate_mode;
  p.lower_bound = c.gate_mode == GateMode::kLowerBound ? c.lower_bound : 0.f;
  p.use_qk_l2norm = c.use_qk_l2norm;
  p.beta_is_logit = c.beta_is_logit;
  return p;
}

cudaError_t launch_chunked_backward_chain(const RecurrentParams& p, const ForwardRoute& r, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  if (r.kernel == ForwardKernel::kChunkedSm90) return launch_chunked_sm90(p, r, stream, /*backward_chain=*/true);
  if (r.kernel != ForwardKernel::kChunkedMma) return cudaErrorInvalidValue;
  if (r.value_rows == 128) return prefill::run_chunked_<128, 3, 4, true>(p, false, 0, stream);
  if (r.small_pipeline) return prefill::run_chunked_<64, 2, 2, true>(p, false, 0, stream);
  return prefill::run_chunked_<64, 3, 4, true>(p, false, 0, stream);
}

}  // namespace kda
