// Channel padding of the K = V = 64 training path, which runs the 128-channel kernels on zero-padded copies
// (csrc/api/training_cuda.cpp): one pass of 16-byte vector copies each way, where torch's constant_pad_nd fills the
// whole copy and then writes the first half again with scalar strided stores. Host-only declarations, no torch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kda {

// dst [B, T, H, 128] compact bf16 = src [B, T, H, 64] bf16 (strides in elements, last dim contiguous; base
// 16-byte aligned and strides multiples of 8, as kernel_tokens gives) in channels 0-63, `fill` (bf16 bits) in 64-127.
cudaError_t launch_pad_channels_bf16(const void* src, int64_t B, int64_t T, int64_t H, int64_t batch_stride,
                                     int64_t token_stride, int64_t head_stride, uint16_t fill, void* dst,
                                     cudaStream_t stream);

// dst [rows, 64] compact = the first 64 channels of src [rows, 128] compact (bf16; both 16-byte aligned).
cudaError_t launch_first_channels_bf16(const void* src, int64_t rows, void* dst, cudaStream_t stream);

// dst [blocks, 64, 64] compact = the leading 64 x 64 block of each src [blocks, 128, 128] compact (fp32; both
// 16-byte aligned): the tapes and states of the padded path cut back.
cudaError_t launch_first_state_block_f32(const float* src, int64_t blocks, float* dst, cudaStream_t stream);

}  // namespace kda
