// The stages of the CUDA training backward after the reverse sweep, and the launcher that runs them in
// order (the math: docs/contract.md, Recurrence; the plan: docs/design.md). The backward runs, on one
// stream, with no host synchronisation and no allocation (CUDA-graph capturable):
//   1. chain   (csrc/kda/chunked, BWD mode; launched by the caller first): dS at the end of every
//              16-token chunk and dinitial_state;
//   2. zero    kda_training_backward_zero_uncovered_kernel: token gradients of the packed tokens outside
//              covered_tokens;
//   3. sweep   (sweep.cu): per (64-token slot, value head) task, dv, dg, dbeta, per-head dq/dk (or dq, dk
//              themselves without a GQA group) and the parameter-gradient partials;
//   4. finish  kda_training_backward_qk_finish_kernel — warp per (token, q/k head, q|k): GQA sum of the
//              value heads of the group in increasing hv, then the L2-norm backward, bf16 out;
//              kda_training_backward_param_finish_kernel — dA_log and ddt_bias summed over the partial rows
//              in order (deterministic: no atomics).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kda/backward/backward_common.cuh"
#include "kda/backward/backward_params.h"
#include "kda/common/cuda_check.h"
#include "kda/common/recurrent_rules.h"  // kL2NormEps

namespace kda {
namespace {
using namespace bwd;

constexpr int kDim = kBwdDim;
static_assert(kDim == 128, "the finishing kernels' lane layout assumes 128 columns (4 per lane)");

// Warp per (token, q/k head, q|k): GQA sum of the group's value heads (increasing hv), then the
// L2-norm backward dx~ = ρ dx - ρ³ (x~·dx) x~ with ρ = rsqrt(|x~|² + 1e-6).
__global__ void __launch_bounds__(256) kda_training_backward_qk_finish_kernel(const TrainingBackwardParams p) {
  const int64_t gw = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t total = p.B * p.T * p.H * 2;
  if (gw >= total) return;
  const int which = static_cast<int>(gw & 1);  // 0: q, 1: k
  const int64_t rest = gw >> 1;
  const int h = static_cast<int>(rest % p.H);
  const int64_t ti = rest / p.H;
  const int64_t b = ti / p.T, t = ti % p.T;
  const int group = p.HV / p.H;
  void* out = which ? p.dk : p.dq;
  // Packed tokens outside covered_tokens (outside every sequence, for a valid cu_seqlens): their workspace rows
  // may be unwritten; their gradient is 0 (x there is never read: it may hold inf/NaN).
  if (!covered_tokens(p).contains(t)) {
#pragma unroll
    for (int e = 0; e < 4; ++e) st_bf16(out, (ti * p.H + h) * kDim + 4 * lane + e, 0.f);
    return;
  }
  const float* dh = which ? p.dk_head : p.dq_head;
  const TokenTensor& x = which ? p.k : p.q;
  float dx[4] = {0.f, 0.f, 0.f, 0.f};
  for (int g = 0; g < group; ++g) {
    const float* src = dh + (ti * p.HV + h * group + g) * kDim + 4 * lane;
#pragma unroll
    for (int e = 0; e < 4; ++e) dx[e] += src[e];
  }
  const int64_t xo = x.offset(b, t, h) + 4 * lane;
  float xr[4], ss = 0.f, dot = 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    xr[e] = ld_bf16(x.ptr, xo + e);
    ss = fmaf(xr[e], xr[e], ss);
    dot = fmaf(xr[e], dx[e], dot);
  }
  ss = warp_sum32(ss);
  dot = warp_sum32(dot);
  // without the L2 norm: dx~ = dx (ρ = 1, no projection)
  const float rho = p.use_qk_l2norm ? rsqrtf(ss + kL2NormEps) : 1.f;
  const float c3 = p.use_qk_l2norm ? rho * rho * rho * dot : 0.f;
#pragma unroll
  for (int e = 0; e < 4; ++e) st_bf16(out, (ti * p.H + h) * kDim + 4 * lane + e, rho * dx[e] - c3 * xr[e]);
}

// Zeroes dv, dg, dβ (and dq, dk when the sweep writes them itself) of the packed tokens outside covered_tokens
// (for a valid cu_seqlens: the tokens no sequence covers); runs before the sweep, so a token a broken
// cu_seqlens covers anyway still gets the sweep's values. Packed layout (B = 1); block per token of
// [0, lo) and [hi, T), 16-byte stores.
__global__ void __launch_bounds__(256) kda_training_backward_zero_uncovered_kernel(const TrainingBackwardParams p) {
  const CoveredTokens cov = covered_tokens(p);
  const auto zero = [](void* base, int64_t row, int64_t row_elems) {  // bf16 rows of a multiple of 8 elements
    uint4* r = reinterpret_cast<uint4*>(static_cast<__nv_bfloat16*>(base) + row * row_elems);
    for (int64_t i = threadIdx.x; i < row_elems / 8; i += blockDim.x) r[i] = make_uint4(0u, 0u, 0u, 0u);
  };
  const int64_t uncovered = cov.lo + (p.T - cov.hi);
  for (int64_t i = blockIdx.x; i < uncovered; i += gridDim.x) {
    const int64_t ti = i < cov.lo ? i : cov.hi + (i - cov.lo);
    zero(p.dv, ti, int64_t(p.HV) * kDim);
    zero(p.dg, ti, int64_t(p.HV) * kDim);
    for (int h = threadIdx.x; h < p.HV; h += blockDim.x) st_bf16(p.dbeta, ti * p.HV + h, 0.f);
    if (p.fused_qk) {
      zero(p.dq, ti, int64_t(p.H) * kDim);
      zero(p.dk, ti, int64_t(p.H) * kDim);
    }
  }
}

// dA_log[hv] and ddt_bias[hv, k]: sums over the partial rows in increasing order (deterministic, and the
// same bits on every GPU: the rows follow the shapes, not the SM count).
__global__ void kda_training_backward_param_finish_kernel(const TrainingBackwardParams p) {
  const int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (idx >= int64_t(p.HV) * kDim) return;
  const int64_t hv = idx / kDim, k = idx % kDim;
  float acc = 0.f;
  for (int64_t r = 0; r < p.partial_rows; ++r) acc += p.ddt_partial[(r * p.HV + hv) * kDim + k];
  p.ddt_bias[idx] = acc;
  if (k == 0) {
    float a = 0.f;
    for (int64_t r = 0; r < p.partial_rows; ++r) a += p.dA_partial[r * p.HV + hv];
    p.dA_log[hv] = a;
  }
}

}  // namespace

cudaError_t launch_training_backward(const TrainingBackwardParams& p, cudaStream_t stream) {
  // fused_qk (the sweep writes dq/dk itself) needs no GQA group: with HV > H several value heads would write
  // one dq row.
  if (p.fused_qk && p.HV != p.H) return cudaErrorInvalidValue;
  if (p.cu_seqlens != nullptr && p.B * p.T > 0) {        // the fixed layout covers every token
    if (p.B != 1) return cudaErrorInvalidValue;          // packed calls have B = 1
    const int64_t blocks = std::min<int64_t>(p.T, 512);  // (blocks past the uncovered tokens exit at once)
    kda_training_backward_zero_uncovered_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
    KDA_CHECK_LAUNCH();
  }
  if (p.grid > 0) {
    if (p.partial_rows != p.n_slots) return cudaErrorInvalidValue;  // one partial row per task slot
    KDA_RETURN_IF_ERROR(p.sweep64 ? launch_training_backward_sweep64(p, stream)
                                  : launch_training_backward_chunked_sweep(p, stream));
  }
  const int64_t warps = p.B * p.T * p.H * 2;
  if (warps > 0 && !p.fused_qk) {
    const int64_t blocks = (warps * 32 + 255) / 256;
    kda_training_backward_qk_finish_kernel<<<static_cast<unsigned>(blocks), 256, 0, stream>>>(p);
    KDA_CHECK_LAUNCH();
  }
  if (p.HV > 0) {
    const int64_t threads = int64_t(p.HV) * kDim;
    kda_training_backward_param_finish_kernel<<<static_cast<unsigned>((threads + 255) / 256), 256, 0, stream>>>(p);
    KDA_CHECK_LAUNCH();
  }
  return cudaSuccess;
}

}  // namespace kda
