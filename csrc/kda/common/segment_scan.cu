// kda_segment_state_scan_kernel: the split's scan of segment start states (segment_scan.h). The rows of a
// state evolve independently (S[j][r] = S[j-1][r] P + Q[j][r]), so a block owns kRows rows of one batch
// entry for the whole scan: the rows stay in shared memory from step to step; thread (c, part) computes column
// c of them over the part-th quarter of the k range, reading those rows of P[j-1] (coalesced across the
// columns; the batch entry's other row blocks read the same P from L2), and part 0 adds the other parts'
// sums in part order (deterministic, no atomics). A step waits on its loads of P, which do not depend on the
// state: four parts keep four times the loads in flight that one thread per column did.
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/common/cuda_check.h"
#include "kda/common/segment_scan.h"

namespace kda {
namespace {

constexpr int kScanCols = 128;  // one thread per column and part, K <= 128
constexpr int kParts = 4;       // the k range split over four thread groups
constexpr int kRows = 8;        // state rows per block

// Rows r0 .. r0 + kRows of one batch entry's states, for j = first .. J-1: S[j] = S[j-1] P[j-1] + Q[j-1], with the
// state, offset and map of step j at entry `base + j * stride` of S, Q and P. zero_start: S[first - 1] is taken as
// zero (not read, and P[first - 1] not read either: S[first] = Q[first - 1]). last: where step J - 1 writes
// instead of S (null: S).
__device__ __forceinline__ void scan_rows(float* __restrict__ S, const float* __restrict__ Q,
                                          const float* __restrict__ P, int64_t base, int64_t stride, int64_t first,
                                          int64_t J, int V, int K, bool zero_start, float* __restrict__ last) {
  __shared__ float rows[kRows][kScanCols];
  __shared__ float partial[kParts - 1][kRows][kScanCols];
  const int c = threadIdx.x % kScanCols, part = threadIdx.x / kScanCols;
  const int r0 = blockIdx.y * kRows;
  const int nr = V - r0 < kRows ? V - r0 : kRows;
  const int64_t state = int64_t(V) * K, map = int64_t(K) * K;
  const int per = (K + kParts - 1) / kParts, k0 = part * per, k1 = k0 + per < K ? k0 + per : K;
  // rows r0 .. r0 + nr of S[first - 1]
  const float* s_prev = S + (base + (first - 1) * stride) * state + int64_t(r0) * K;
  if (part == 0)
    for (int r = 0; r < kRows; ++r) rows[r][c] = !zero_start && c < K && r < nr ? s_prev[int64_t(r) * K + c] : 0.f;
  __syncthreads();
  for (int64_t j = first; j < J; ++j) {
    const float* pj = P + (base + (j - 1) * stride) * map;
    const float* qj = Q + (base + (j - 1) * stride) * state + int64_t(r0) * K;
    float acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = (part == 0 && c < K && r < nr) ? qj[int64_t(r) * K + c] : 0.f;
    if (c < K && !(zero_start && j == first)) {
#pragma unroll 8
      for (int k = k0; k < k1; ++k) {
        const float p = __ldg(pj + int64_t(k) * K + c);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] = fmaf(rows[r][k], p, acc[r]);
      }
    }
    if (part > 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) partial[part - 1][r][c] = acc[r];
    }
    __syncthreads();  // every thread has read the previous rows; the parts' sums are in `partial`
    if (part == 0) {
      float* sj = (last != nullptr && j == J - 1 ? last : S + (base + j * stride) * state) + int64_t(r0) * K;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float x = acc[r];
#pragma unroll
        for (int q = 0; q < kParts - 1; ++q) x += partial[q][r][c];
        if (r < nr && c < K) rows[r][c] = x, sj[int64_t(r) * K + c] = x;
      }
    }
    __syncthreads();
  }
}

// The grid layout: batch entry b = blockIdx.x at step j is entry j * batch + b.
__global__ void __launch_bounds__(kScanCols* kParts)
    kda_segment_state_scan_kernel(float* __restrict__ S, const float* __restrict__ Q, const float* __restrict__ P,
                                  int64_t J, int64_t batch, int V, int K, int64_t first) {
  scan_rows(S, Q, P, int64_t(blockIdx.x), batch, first, J, V, K, false, nullptr);
}

// The packed layout: entry s * HV + h is head h of segment s; sequence n owns segments seg_first[n] ..
// seg_first[n] + seg_count[n] - 1 (blockIdx.x = n * HV + h). Its segment 1 starts at its segment 0's offset
// (segment 0 ran from the sequence's start state), later ones from the scan; with `fin`, one step more writes the
// sequence's end state to fin[n] (Q of its only segment when it has one).
__global__ void __launch_bounds__(kScanCols* kParts)
    kda_segment_state_scan_packed_kernel(float* __restrict__ S, const float* __restrict__ Q,
                                         const float* __restrict__ P, const int64_t* __restrict__ seg_first,
                                         const int64_t* __restrict__ seg_count, float* __restrict__ fin, int HV, int V,
                                         int K) {
  const int64_t n = blockIdx.x / HV, h = blockIdx.x % HV;
  const int64_t count = seg_count[n];
  if (count < (fin != nullptr ? 1 : 2)) return;
  float* last = fin != nullptr ? fin + (n * HV + h) * int64_t(V) * K : nullptr;
  scan_rows(S, Q, P, seg_first[n] * HV + h, HV, 1, count + (fin != nullptr ? 1 : 0), V, K, true, last);
}

}  // namespace

cudaError_t launch_segment_state_scan(float* S, const float* Q, const float* P, int64_t J, int64_t batch, int V, int K,
                                      int64_t first, cudaStream_t stream) {
  if (first < 1) first = 1;
  if (J <= first || batch <= 0 || V <= 0 || K <= 0) return cudaSuccess;
  if (K > kScanCols || batch > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>((V + kRows - 1) / kRows));
  kda_segment_state_scan_kernel<<<grid, kScanCols * kParts, 0, stream>>>(S, Q, P, J, batch, V, K, first);
  return cudaGetLastError();
}

cudaError_t launch_segment_state_scan_packed(float* S, const float* Q, const float* P, const int64_t* seg_first,
                                             const int64_t* seg_count, float* fin, int64_t N, int HV, int V, int K,
                                             cudaStream_t stream) {
  if (N <= 0 || HV <= 0 || V <= 0 || K <= 0) return cudaSuccess;
  if (K > kScanCols || N * HV > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(N * HV), static_cast<unsigned>((V + kRows - 1) / kRows));
  kda_segment_state_scan_packed_kernel<<<grid, kScanCols * kParts, 0, stream>>>(S, Q, P, seg_first, seg_count, fin, HV,
                                                                                V, K);
  return cudaGetLastError();
}

}  // namespace kda
