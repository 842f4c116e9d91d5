// Row prefixes of the per-chunk buffers of the training ops (tapes, the sweep's task slots, the chain's
// dS rows), computed on the device so the ops need no host synchronisation, and the zeroing of the rows
// past the sequences' (tape_rows.h holds the rule).
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "kda/backward/backward_params.h"
#include "kda/common/cuda_check.h"
#include "kda/common/recurrent_rules.h"  // seq_range
#include "kda/tape_rows.h"

namespace kda {
namespace {

constexpr int kScanThreads = 1024;

__global__ void __launch_bounds__(kScanThreads)
    kda_tape_cu_starts_kernel(const void* cu, bool i64, int64_t N, int64_t T, int chunk, int first, int64_t* out) {
  __shared__ int64_t part[kScanThreads];
  const int tid = threadIdx.x;
  const int64_t per = (N + kScanThreads - 1) / kScanThreads;
  const int64_t beg = tid * per;
  const int64_t end = beg + per < N ? beg + per : N;
  int64_t local = 0;
  for (int64_t n = beg; n < end; ++n) local += chunk_rows(seq_range(cu, i64, T, n).len, chunk, first);
  part[tid] = local;
  __syncthreads();
  if (tid == 0) {
    int64_t run = 0;
    for (int i = 0; i < kScanThreads; ++i) {
      const int64_t x = part[i];
      part[i] = run;
      run += x;
    }
    out[0] = 0;
  }
  __syncthreads();
  int64_t run = part[tid];
  for (int64_t n = beg; n < end; ++n) {
    run += chunk_rows(seq_range(cu, i64, T, n).len, chunk, first);
    out[n + 1] = run;
  }
}

__global__ void __launch_bounds__(256)
    kda_zero_rows_past_kernel(float* x, int64_t rows, int64_t row_elems, const int64_t* starts, int64_t N) {
  const int64_t first = starts[N] < 0 ? 0 : starts[N];
  for (int64_t r = first + blockIdx.y; r < rows; r += gridDim.y) {
    float4* row = reinterpret_cast<float4*>(x + r * row_elems);
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < row_elems / 4;
         i += int64_t(gridDim.x) * blockDim.x)
      row[i] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
}

}  // namespace

cudaError_t launch_tape_cu_starts(const void* cu_seqlens, bool cu_seqlens_int64, int64_t N, int64_t T,
                                  int64_t* tape_cu_starts, cudaStream_t stream, int chunk, int first) {
  if (chunk <= 0 || first < 0) return cudaErrorInvalidValue;
  kda_tape_cu_starts_kernel<<<1, kScanThreads, 0, stream>>>(cu_seqlens, cu_seqlens_int64, N, T, chunk, first,
                                                            tape_cu_starts);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_zero_rows_past(float* x, int64_t rows, int64_t row_elems, const int64_t* starts, int64_t N,
                                  cudaStream_t stream) {
  if (rows <= 0 || row_elems <= 0) return cudaSuccess;
  if (row_elems % 4 != 0) return cudaErrorInvalidValue;
  // blockIdx.y strides over rows, blockIdx.x over a row: rows past the sequences are few (at most about N)
  const dim3 grid(static_cast<unsigned>(std::min<int64_t>((row_elems / 4 + 255) / 256, 64)),
                  static_cast<unsigned>(std::min<int64_t>(rows, 16)));
  kda_zero_rows_past_kernel<<<grid, 256, 0, stream>>>(x, rows, row_elems, starts, N);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace kda
