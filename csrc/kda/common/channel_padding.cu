// Channel padding of the K = V = 64 training path (channel_padding.h): grid-stride loops over 16-byte pieces.
#include "kda/common/channel_padding.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "kda/common/cuda_check.h"

namespace kda {
namespace {

constexpr int kThreads = 256;

int grid_for(int64_t pieces) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((pieces + kThreads - 1) / kThreads, 65536)));
}

// One output piece = 8 bf16 (16 bytes); 16 pieces per 128-channel row, the first 8 from the source row.
__global__ void __launch_bounds__(kThreads)
    pad_channels_kernel(const uint16_t* __restrict__ src, int64_t T, int64_t H, int64_t sb, int64_t st, int64_t sh,
                        uint32_t fill2, uint4* __restrict__ dst, int64_t pieces) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < pieces; i += int64_t(gridDim.x) * kThreads) {
    const int64_t row = i >> 4;
    const int piece = static_cast<int>(i & 15);
    uint4 x = make_uint4(fill2, fill2, fill2, fill2);
    if (piece < 8) {
      const int64_t h = row % H, bt = row / H;
      const int64_t t = bt % T, b = bt / T;
      x = *reinterpret_cast<const uint4*>(src + b * sb + t * st + h * sh + 8 * piece);
    }
    dst[i] = x;
  }
}

__global__ void __launch_bounds__(kThreads)
    first_channels_kernel(const uint4* __restrict__ src, uint4* __restrict__ dst, int64_t pieces) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < pieces; i += int64_t(gridDim.x) * kThreads)
    dst[i] = src[(i >> 3) * 16 + (i & 7)];  // 8 pieces of 64 channels out of 16 of 128
}

// One output piece = 4 floats; 16 pieces per 64-float output row, 64 rows per block.
__global__ void __launch_bounds__(kThreads)
    first_state_block_kernel(const float4* __restrict__ src, float4* __restrict__ dst, int64_t pieces) {
  for (int64_t i = blockIdx.x * int64_t(kThreads) + threadIdx.x; i < pieces; i += int64_t(gridDim.x) * kThreads) {
    const int64_t blk = i >> 10;  // 64 rows x 16 pieces
    const int r = static_cast<int>((i >> 4) & 63), piece = static_cast<int>(i & 15);
    dst[i] = src[blk * 4096 + r * 32 + piece];  // a source block: 128 rows x 32 pieces
  }
}

}  // namespace

cudaError_t launch_pad_channels_bf16(const void* src, int64_t B, int64_t T, int64_t H, int64_t batch_stride,
                                     int64_t token_stride, int64_t head_stride, uint16_t fill, void* dst,
                                     cudaStream_t stream) {
  const int64_t pieces = B * T * H * 16;
  if (pieces == 0) return cudaSuccess;
  const uint32_t fill2 = uint32_t(fill) | (uint32_t(fill) << 16);
  pad_channels_kernel<<<grid_for(pieces), kThreads, 0, stream>>>(static_cast<const uint16_t*>(src), T, H, batch_stride,
                                                                 token_stride, head_stride, fill2,
                                                                 static_cast<uint4*>(dst), pieces);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_first_channels_bf16(const void* src, int64_t rows, void* dst, cudaStream_t stream) {
  const int64_t pieces = rows * 8;
  if (pieces == 0) return cudaSuccess;
  first_channels_kernel<<<grid_for(pieces), kThreads, 0, stream>>>(static_cast<const uint4*>(src),
                                                                   static_cast<uint4*>(dst), pieces);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

cudaError_t launch_first_state_block_f32(const float* src, int64_t blocks, float* dst, cudaStream_t stream) {
  const int64_t pieces = blocks * 64 * 16;
  if (pieces == 0) return cudaSuccess;
  first_state_block_kernel<<<grid_for(pieces), kThreads, 0, stream>>>(reinterpret_cast<const float4*>(src),
                                                                      reinterpret_cast<float4*>(dst), pieces);
  KDA_CHECK_LAUNCH();
  return cudaSuccess;
}

}  // namespace kda
