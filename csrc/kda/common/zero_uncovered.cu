// kda_zero_uncovered_tokens: writes zeros to the output tokens of a packed call that no sequence covers
// (see zero_uncovered.h, token_coverage.h). One launch, no scratch, no host sync.
//
// Every block first decides, from cu_seqlens alone, whether the sequence ranges adjoin (the contract,
// and any non-decreasing cu): one coalesced pass over cu per block, redundant across blocks so that no
// grid-wide sync or flag buffer is needed. Then:
// - adjoining ranges: the uncovered tokens are the prefix [0, bos_0) and the suffix [end_{N-1}, T). In
//   the common case both are empty and the block exits having written nothing; otherwise the grid
//   zeroes those rows, grid-stride.
// - otherwise (a non-monotone cu, a broken contract): each block takes tokens blockIdx.x, +gridDim.x, ...
//   and tests each against all N ranges (O(N / threads) per token), zeroing the rows it finds uncovered.
#include <cuda_runtime.h>

#include <cstdint>

#include "kda/common/device_info.h"
#include "kda/common/cuda_check.h"
#include "kda/common/token_coverage.h"
#include "kda/common/zero_uncovered.h"

namespace kda {
namespace {

constexpr int kZeroThreads = 256;
// Elements per thread aimed at when sizing the grid for the worst case (every token uncovered).
constexpr int64_t kZeroElemsPerThread = 8;

// Word: an unsigned integer as wide as the token dtype; all-zero bits are +0.0 in bf16/fp16/fp32/fp64.
template <typename Word>
__global__ void __launch_bounds__(kZeroThreads)
    kda_zero_uncovered_tokens_kernel(const __grid_constant__ RecurrentParams p) {
  bool adjoin = true;
  for (int64_t n = 1 + threadIdx.x; n < p.N && adjoin; n += blockDim.x) adjoin = ranges_adjoin(p, n);
  const bool chained = __syncthreads_and(adjoin);

  Word* out = static_cast<Word*>(p.out);    // [1, T, HV, V]: batch row 0 only (packed)
  const int64_t row = int64_t(p.HV) * p.V;  // elements of one token
  if (chained) {
    const int64_t lo = seq_range(p, 0).bos, hi = seq_end(seq_range(p, p.N - 1));
    const int64_t total = (lo + (p.T - hi)) * row;
    // Uncovered element i: token u = i / row of the list [0, lo) ++ [hi, T), head and channel from i % row.
    for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += int64_t(gridDim.x) * blockDim.x) {
      const int64_t u = i / row, r = i - u * row;
      const int64_t t = u < lo ? u : hi + (u - lo);
      const int64_t h = r / p.V, c = r - h * p.V;
      out[t * p.out_token_stride + h * p.out_head_stride + c] = Word(0);
    }
    return;
  }
  for (int64_t t = blockIdx.x; t < p.T; t += gridDim.x) {  // uniform across the block: the sync is safe
    bool covered = false;
    for (int64_t n = threadIdx.x; n < p.N && !covered; n += blockDim.x) covered = seq_covers(p, n, t);
    if (__syncthreads_or(covered)) continue;
    for (int64_t r = threadIdx.x; r < row; r += blockDim.x) {
      const int64_t h = r / p.V, c = r - h * p.V;
      out[t * p.out_token_stride + h * p.out_head_stride + c] = Word(0);
    }
  }
}

template <typename Word>
cudaError_t launch_typed(const RecurrentParams& p, cudaStream_t stream) {
  const int64_t elems = p.T * int64_t(p.HV) * p.V;
  const int64_t want = (elems + kZeroThreads * kZeroElemsPerThread - 1) / (kZeroThreads * kZeroElemsPerThread);
  // Two blocks per SM are one resident wave: the cu pass (the whole cost in the common case) then runs
  // once in parallel, and a worst-case fill still has every SM storing.
  const int64_t cap = 2 * int64_t(cached_device_attribute<cudaDevAttrMultiProcessorCount>(132));
  const int blocks = static_cast<int>(want < 1 ? 1 : (want > cap ? cap : want));
  kda_zero_uncovered_tokens_kernel<Word><<<blocks, kZeroThreads, 0, stream>>>(p);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace

cudaError_t launch_zero_uncovered_tokens(const RecurrentParams& p, cudaStream_t stream) {
  if (p.cu_seqlens == nullptr || p.T == 0 || p.N == 0 || p.HV == 0 || p.V == 0) return cudaSuccess;
  switch (p.token_dtype) {
    case DType::kBFloat16:
    case DType::kFloat16:
      return launch_typed<uint16_t>(p, stream);
    case DType::kFloat32:
      return launch_typed<uint32_t>(p, stream);
    case DType::kFloat64:
      return launch_typed<uint64_t>(p, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace kda
