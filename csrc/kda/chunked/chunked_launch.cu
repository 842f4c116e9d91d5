// Host dispatch of the chunked prefill kernel: picks the value rows per CTA from the grid size.
#include <cstdint>
#include <cstdlib>

#include "kda/common/device_info.h"
#include "kda/chunked/chunked_instantiations.h"
#include "kda/chunked/chunked_kernel.cuh"  // (sizeof the shared-memory layouts only)
#include "kda/chunked/chunked_launch.h"
#include "kda/chunked/sm90/chunked_sm90.h"

namespace kda {
namespace {

// Largest dynamic shared memory one block may opt into (227 KB on sm_90/sm_100, 99 KB on sm_120).
int max_smem_optin() { return cached_device_attribute<cudaDevAttrMaxSharedMemoryPerBlockOptin>(227 * 1024); }

constexpr int kSmem64 = static_cast<int>(sizeof(prefill::ChunkedSmem<64, 3, 4>));
constexpr int kSmem128 = static_cast<int>(sizeof(prefill::ChunkedSmem<128, 3, 4>));
constexpr int kSmemSmall = static_cast<int>(sizeof(prefill::ChunkedSmem<64, 2, 2>));

}  // namespace

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
  // KDA_CHUNKED_KERNEL=sm90: the Hopper kernel for the cases it covers (inference prefill), else this one.
  if (chunked_sm90_requested() && chunked_sm90_supported(p)) return launch_chunked_sm90(p, stream);
  const int sms = cached_device_attribute<cudaDevAttrMultiProcessorCount>(132);
  // One CTA per SM fits (registers). When the (sequence, head) tasks fill at most half of the SMs, split
  // the value rows over two CTAs: the chain is latency-bound, so two CTAs per head halve its per-chunk
  // work at the cost of repeating the per-chunk prep.
  int vb = p.N * p.HV * 2 <= int64_t(sms) ? 64 : 128;
  if (const char* env = std::getenv("KDA_CHUNKED_VB")) {
    const int v = std::atoi(env);
    if (v == 64 || v == 128) vb = v;
  }
  const int optin = max_smem_optin();
  if (vb == 128 && kSmem128 > optin) vb = 64;
  if (const char* pipe = std::getenv("KDA_CHUNKED_PIPELINE"); pipe != nullptr && pipe[0] == 's') vb = 64;
  auto al = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  const bool out_vec16 = al(p.out) && p.out_token_stride % 8 == 0 && p.out_head_stride % 8 == 0 &&
                         (p.cu_seqlens != nullptr || p.out_batch_stride % 8 == 0);
  const char* dg = std::getenv("KDA_CHUNKED_DIAG");  // benchmarks only: skips work on purpose
  const int diag = dg != nullptr ? std::atoi(dg) : 0;
  if (vb == 128) return prefill::run_chunked_<128, 3, 4, false>(p, out_vec16, diag, stream);
  // Less shared memory per block than the default pipeline needs (sm_120: 99 KB): shallower pipeline.
  // KDA_CHUNKED_PIPELINE=small forces it anywhere (tests: the same arithmetic, bit-identical results).
  const char* pipe = std::getenv("KDA_CHUNKED_PIPELINE");
  const bool small = kSmem64 > optin || (pipe != nullptr && pipe[0] == 's');
  if (small) return prefill::run_chunked_<64, 2, 2, false>(p, out_vec16, diag, stream);
  return prefill::run_chunked_<64, 3, 4, false>(p, out_vec16, diag, stream);
}

cudaError_t launch_chunked_backward_chain(const RecurrentParams& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  const int sms = cached_device_attribute<cudaDevAttrMultiProcessorCount>(132);
  // As the forward: two CTAs per head (64 value rows each) when the heads fill at most half of the SMs.
  const int vb = p.N * p.HV * 2 <= int64_t(sms) ? 64 : 128;
  if (vb == 128) return prefill::run_chunked_<128, 3, 4, true>(p, false, 0, stream);
  return prefill::run_chunked_<64, 3, 4, true>(p, false, 0, stream);
}

}  // namespace kda
