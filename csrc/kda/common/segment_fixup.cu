// kda_segment_output_fixup_kernel: the one-pass split's output fix-up (segment_fixup.h), O += A · S_startᵀ per
// segment and value head, on tensor cores (mma.sync m16n8k16, bf16 operands, fp32 accumulators).
//
// One CTA of 4 warps per (up to kSpan tokens of a segment, value head). Shared: the segment's start state S [V][K]
// as bf16 (rounded from fp32 once per CTA, rows padded by 8 elements so the B-fragment reads of the 8 row groups
// hit distinct banks), 34 KiB: staged once per kSpan tokens (64 KiB of fp32 from L2), not per 64-token tile. The
// warps then walk 64-token tiles of the span; in a tile each warp owns 16 tokens: A fragments straight from global
// memory (4-byte pairs of adjacent channels, rows past the segment end read as zero), B fragments from shared
// memory, V / 8 accumulator tiles; then each output pair is read, added in fp32 and written back as bf16. One
// barrier (after the state is staged).
//
// Model (K = V = 128, per 64-token tile and head): 4 warps x 8 k-steps x 16 n-tiles = 512 mma.sync (1M FMA, ~1k
// SM-cycles at the dense rate), 48 KiB of HBM traffic (A read, O read and written). At H=4 T=16384 (1M token-head
// rows): 0.10 GB, ~25 us at 4 TB/s; the state staging ~16k cycles per CTA is amortised over kSpan / 64 tiles.
//
// An experiment: compiled only in a KDA_BUILD_EXPERIMENTS=1 build (the one-pass split lost to the three passes in
// its first measurement; docs/performance.md "Exact sequence split").
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/common/ptx.cuh"
#include "kda/common/segment_fixup.h"

namespace kda {
namespace {

constexpr int kTile = 64;     // tokens per tile (16 per warp)
constexpr int kSpan = 1024;   // tokens per CTA
constexpr int kMaxDim = 128;  // K, V <= 128
constexpr int kPad = 8;       // bf16 elements of padding per staged state row

__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 p = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&p);
}

// 16 token rows t0 .. t0 + 15 (those below t1) of one warp: out += A Sᵀ with S staged in `st`.
__device__ __forceinline__ void fixup_rows(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ A,
                                           const __nv_bfloat16 (*st)[kMaxDim + kPad], int64_t t0, int64_t t1, int h,
                                           int HV, int V, int K, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int64_t r0 = t0 + g, r1 = r0 + 8;  // the thread's two token rows
  const bool ok0 = r0 < t1, ok1 = r1 < t1;
  const int64_t tok = int64_t(HV) * K;  // elements between tokens in A
  const uint32_t* a0p = reinterpret_cast<const uint32_t*>(A + r0 * tok + int64_t(h) * K);
  const uint32_t* a1p = reinterpret_cast<const uint32_t*>(A + r1 * tok + int64_t(h) * K);
  float acc[kMaxDim / 8][4];
#pragma unroll
  for (int n = 0; n < kMaxDim / 8; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  for (int k0 = 0; k0 < K; k0 += 16) {
    uint32_t a[4];
    a[0] = ok0 ? a0p[(k0 + 2 * t) / 2] : 0u;
    a[1] = ok1 ? a1p[(k0 + 2 * t) / 2] : 0u;
    a[2] = ok0 ? a0p[(k0 + 8 + 2 * t) / 2] : 0u;
    a[3] = ok1 ? a1p[(k0 + 8 + 2 * t) / 2] : 0u;
#pragma unroll
    for (int n = 0; n < kMaxDim / 8; ++n) {
      if (n * 8 < V) {
        const uint32_t b0 = *reinterpret_cast<const uint32_t*>(&st[n * 8 + g][k0 + 2 * t]);
        const uint32_t b1 = *reinterpret_cast<const uint32_t*>(&st[n * 8 + g][k0 + 8 + 2 * t]);
        ptx::mma_bf16(acc[n], a, b0, b1);
      }
    }
  }
  const int64_t otok = int64_t(HV) * V;
#pragma unroll
  for (int n = 0; n < kMaxDim / 8; ++n) {
    if (n * 8 >= V) continue;
    const int c = n * 8 + 2 * t;
    if (ok0) {
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + r0 * otok + int64_t(h) * V + c);
      const float2 x = __bfloat1622float2(*o);
      *o = __floats2bfloat162_rn(x.x + acc[n][0], x.y + acc[n][1]);
    }
    if (ok1) {
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(out + r1 * otok + int64_t(h) * V + c);
      const float2 x = __bfloat1622float2(*o);
      *o = __floats2bfloat162_rn(x.x + acc[n][2], x.y + acc[n][3]);
    }
  }
}

__global__ void __launch_bounds__(128)
    kda_segment_output_fixup_kernel(__nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ A,
                                    const float* __restrict__ S, const int64_t* __restrict__ seg_cu,
                                    const int* __restrict__ rows, int64_t spans_per_segment, int HV, int V, int K) {
  __shared__ __align__(16) __nv_bfloat16 st[kMaxDim][kMaxDim + kPad];
  const int64_t seg = blockIdx.x / spans_per_segment, end = seg_cu[seg + 1];
  const int64_t span0 = seg_cu[seg] + (blockIdx.x % spans_per_segment) * kSpan;
  const int64_t span1 = span0 + kSpan < end ? span0 + kSpan : end;
  const int row = rows[seg];
  if (row < 0 || span0 >= span1) return;  // (uniform over the CTA)
  const int h = blockIdx.y;
  // stage S[row, h] as bf16: thread i converts float4 groups i, i + 128, ...
  const float* s = S + ((int64_t(row) * HV + h) * V) * K;
  for (int i = threadIdx.x; i < V * K / 4; i += blockDim.x) {
    const float4 x = reinterpret_cast<const float4*>(s)[i];
    const int v = (i * 4) / K, k = (i * 4) % K;
    *reinterpret_cast<uint2*>(&st[v][k]) = make_uint2(pack_bf16(x.x, x.y), pack_bf16(x.z, x.w));
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int64_t t0 = span0 + warp * 16; t0 < span1; t0 += kTile) fixup_rows(out, A, st, t0, span1, h, HV, V, K, lane);
}

}  // namespace

cudaError_t launch_segment_output_fixup(void* out, const void* A, const float* S, const int64_t* seg_cu,
                                        const int* rows, int64_t slots, int64_t max_segment_tokens, int HV, int V,
                                        int K, cudaStream_t stream) {
  if (slots <= 0 || max_segment_tokens <= 0 || HV <= 0) return cudaSuccess;
  if (K % 16 != 0 || V % 16 != 0 || K > kMaxDim || V > kMaxDim || HV > 65535) return cudaErrorInvalidValue;
  const int64_t spans = (max_segment_tokens + kSpan - 1) / kSpan;
  if (slots * spans > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(slots * spans), static_cast<unsigned>(HV));
  kda_segment_output_fixup_kernel<<<grid, 128, 0, stream>>>(
      static_cast<__nv_bfloat16*>(out), static_cast<const __nv_bfloat16*>(A), S, seg_cu, rows, spans, HV, V, K);
  return cudaGetLastError();
}

}  // namespace kda
#endif  // KDA_EXPERIMENTS
