// Host dispatch of the chunked prefill kernel: picks the value rows per CTA from the grid size.
#include <cstdint>
#include <cstdlib>

#include "kda/common/device_info.h"
#include "kda/chunked/chunked_instantiations.h"
#include "kda/chunked/chunked_kernel.cuh"  // (sizeof the shared-memory layouts only)
#include "kda/chunked/chunked_launch.h"
#include "kda/chunked/sm90/chunked_sm90.h"
#include "kda/common/recurrent_rules.h"  // out_rows_vec16

namespace kda {
namespace {

// Largest dynamic shared memory one block may opt into (227 KB on sm_90/sm_100, 99 KB on sm_120).
int max_smem_optin() { return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(227 * 1024); }

constexpr int kSmem64 = static_cast<int>(sizeof(prefill::ChunkedSmem<64, 3, 4>));
constexpr int kSmem128 = static_cast<int>(sizeof(prefill::ChunkedSmem<128, 3, 4>));
constexpr int kSmemSmall = static_cast<int>(sizeof(prefill::ChunkedSmem<64, 2, 2>));

// The launcher's schedule knobs, read from the environment once per process (a function-local static:
// thread-safe initialisation). They change how the work is spread, never the arithmetic, except diag.
//   KDA_CHUNKED_VB=64|128       value rows per CTA (benchmarks; 0 = chosen from the grid size)
//   KDA_CHUNKED_PIPELINE=small  the shallow pipeline of GPUs with ~100 KB of shared memory per block (tests)
//   KDA_CHUNKED_DIAG=mask       benchmarks only: skips one role's math on purpose (kDiagNo* in
//                               chunked_config.cuh); results are wrong while it is set
struct ChunkedKnobs {
  int vb = 0;
  bool small_pipeline = false;
  int diag = 0;
};

const ChunkedKnobs& chunked_knobs() {
  static const ChunkedKnobs knobs = [] {
    ChunkedKnobs k;
    if (const char* env = std::getenv("KDA_CHUNKED_VB")) {
      const int v = std::atoi(env);
      if (v == 64 || v == 128) k.vb = v;
    }
    const char* pipe = std::getenv("KDA_CHUNKED_PIPELINE");
    k.small_pipeline = pipe != nullptr && pipe[0] == 's';
    if (const char* dg = std::getenv("KDA_CHUNKED_DIAG")) k.diag = std::atoi(dg);
    return k;
  }();
  return knobs;
}

// KDA_CHUNKED_KERNEL=sm90: the Hopper kernel for the calls it covers; auto (the default): the same unless one
// of this kernel's own switches is set (KDA_CHUNKED_VB/_PIPELINE/_DIAG ask for this kernel), and for the
// backward chain only on grids where this kernel takes 128 value rows per CTA too (chunked_sm90.h); mma: this
// kernel.
bool hopper_takes(const RecurrentParams& p, int sms, bool backward_chain) {
  const int mode = chunked_sm90_mode();
  if (mode == 0) return false;
  if (mode == 2) {
    const ChunkedKnobs& k = chunked_knobs();
    if (k.vb != 0 || k.small_pipeline || k.diag != 0) return false;
    if (backward_chain && p.N * p.HV * 2 <= int64_t(sms)) return false;
  }
  return chunked_sm90_supported(p);
}

}  // namespace

int64_t chunked_small_pipeline_smem_bytes() { return kSmemSmall; }

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

cudaError_t launch_chunked(const RecurrentParams& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  const ChunkedKnobs& knobs = chunked_knobs();
  const int sms = cached_device_attribute<cudaDevAttrMultiProcessorCount>(132);
  if (hopper_takes(p, sms, /*backward_chain=*/false)) return launch_chunked_sm90(p, stream);
  // One CTA per SM fits (registers). When the (sequence, head) tasks fill at most half of the SMs, split
  // the value rows over two CTAs: the chain is latency-bound, so two CTAs per head halve its per-chunk
  // work at the cost of repeating the per-chunk prep.
  int vb = p.N * p.HV * 2 <= int64_t(sms) ? 64 : 128;
  if (knobs.vb != 0) vb = knobs.vb;
  const int optin = max_smem_optin();
  if (vb == 128 && kSmem128 > optin) vb = 64;
  if (knobs.small_pipeline) vb = 64;
  const bool out_vec16 = out_rows_vec16(p);
  const int diag = knobs.diag;
  const bool state_only = p.out == nullptr;  // the state-only kernels (no output product)
  if (vb == 128)
    return state_only ? prefill::run_chunked_<128, 3, 4, false, false>(p, out_vec16, diag, stream)
                      : prefill::run_chunked_<128, 3, 4, false>(p, out_vec16, diag, stream);
  // Less shared memory per block than the default pipeline needs (sm_120: 99 KB): shallower pipeline.
  // KDA_CHUNKED_PIPELINE=small forces it anywhere (tests: the same arithmetic, bit-identical results).
  const bool small = kSmem64 > optin || knobs.small_pipeline;
  if (small)
    return state_only ? prefill::run_chunked_<64, 2, 2, false, false>(p, out_vec16, diag, stream)
                      : prefill::run_chunked_<64, 2, 2, false>(p, out_vec16, diag, stream);
  return state_only ? prefill::run_chunked_<64, 3, 4, false, false>(p, out_vec16, diag, stream)
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

cudaError_t launch_chunked_backward_chain(const BackwardChainParams& c, cudaStream_t stream) {
  const RecurrentParams p = chain_as_recurrent(c);
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  const int sms = cached_device_attribute<cudaDevAttrMultiProcessorCount>(132);
  if (hopper_takes(p, sms, /*backward_chain=*/true)) return launch_chunked_sm90(p, stream, /*backward_chain=*/true);
  // As the forward: two CTAs per head (64 value rows each) when the heads fill at most half of the SMs, the
  // shallow pipeline where a block gets less shared memory (sm_120) or KDA_CHUNKED_PIPELINE=small asks for it.
  const ChunkedKnobs& knobs = chunked_knobs();
  const int optin = max_smem_optin();
  int vb = p.N * p.HV * 2 <= int64_t(sms) ? 64 : 128;
  if ((vb == 128 && kSmem128 > optin) || knobs.small_pipeline) vb = 64;
  if (vb == 128) return prefill::run_chunked_<128, 3, 4, true>(p, false, 0, stream);
  if (kSmem64 > optin || knobs.small_pipeline) return prefill::run_chunked_<64, 2, 2, true>(p, false, 0, stream);
  return prefill::run_chunked_<64, 3, 4, true>(p, false, 0, stream);
}

}  // namespace kda
