// The segment-state scan of the exact sequence split (kda_ops/_split.py): from the start states of a
// sequence's first two segments and each segment's affine state map (S_end = S_start P + Q), the start
// state of every later segment, S[j] = S[j-1] P[j-1] + Q[j-1]. One launch for the whole scan (the split
// ran it as one batched matmul per segment, host-bound). Host-only declaration, no torch.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

namespace kda {

// S, Q: [J, batch, V, K] fp32, P: [J, batch, K, K] fp32, contiguous, on the current device. For j = first
// .. J-1 in order: S[j] = S[j-1] P[j-1] + Q[j-1] (each element a sequential fp32 sum over k, so the
// result is deterministic). K <= 128.
cudaError_t launch_segment_state_scan(float* S, const float* Q, const float* P, int64_t J, int64_t batch, int V, int K,
                                      int64_t first, cudaStream_t stream);

// The packed layout (a split planned on the device): S, Q [segments, HV, V, K], P [segments, HV, K, K] fp32;
// seg_first, seg_count [N] int64 on the device: sequence n owns segments seg_first[n] .. + seg_count[n] - 1. Per
// sequence with two or more segments: S[f + 1] = Q[f], then S[f + j] = S[f + j - 1] P[f + j - 1] + Q[f + j - 1]
// (f = seg_first[n]; the other entries are not touched). fin (null: none) [N, HV, V, K]: each sequence's end
// state, S[f + c - 1] P[f + c - 1] + Q[f + c - 1] (c = seg_count[n] >= 2), Q[f] (c == 1). K <= 128.
cudaError_t launch_segment_state_scan_packed(float* S, const float* Q, const float* P, const int64_t* seg_first,
                                             const int64_t* seg_count, float* fin, int64_t N, int HV, int V, int K,
                                             cudaStream_t stream);

}  // namespace kda
