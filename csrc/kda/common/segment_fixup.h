// The one-pass exact split's output fix-up (kda_ops/_split.py): each segment's outputs from a zero start plus its
// effective queries times the segment's exact start state, O[t, h] += A[t, h] · S[rows[s], h]ᵀ for the tokens t of
// segment s (seg_cu[s] .. seg_cu[s + 1]) with rows[s] >= 0. Host-only declaration, no torch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kda {

// out [T, HV, V] and A [T, HV, K] bf16, S [slots', HV, V, K] fp32, seg_cu int64 [slots + 1], rows int32 [slots],
// contiguous, on the current device; no segment longer than max_segment_tokens. K, V multiples of 16, <= 128. The
// products round S to bf16 (as the chunked kernels' state operand) and accumulate in fp32; out is rounded once.
cudaError_t launch_segment_output_fixup(void* out, const void* A, const float* S, const int64_t* seg_cu,
                                        const int* rows, int64_t slots, int64_t max_segment_tokens, int HV, int V,
                                        int K, cudaStream_t stream);

}  // namespace kda
