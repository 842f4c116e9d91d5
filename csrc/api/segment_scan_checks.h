// Argument checks of kda::segment_state_scan (the exact sequence split's scan of segment start states),
// shared by its CPU and CUDA implementations.
#pragma once
#include <ATen/ATen.h>

#include "api/checks.h"

namespace kda {

// S, Q: [J, batch, V, K]; P: [J, batch, K, K]; one floating dtype, one device, contiguous; first >= 1.
inline void check_segment_state_scan(const at::Tensor& S, const at::Tensor& Q, const at::Tensor& P, int64_t first) {
  KDA_CHECK(S.dim() == 4, "S must be [J, batch, V, K], got ", S.sizes());
  KDA_CHECK(Q.sizes() == S.sizes(), "Q must have the shape of S ", S.sizes(), ", got ", Q.sizes());
  KDA_CHECK(P.dim() == 4 && P.size(0) == S.size(0) && P.size(1) == S.size(1) && P.size(2) == S.size(3) &&
                P.size(3) == S.size(3),
            "P must be [J, batch, K, K] = [", S.size(0), ", ", S.size(1), ", ", S.size(3), ", ", S.size(3), "], got ",
            P.sizes());
  KDA_CHECK_TYPE(at::isFloatingType(S.scalar_type()), "S must be a floating dtype, got ", S.scalar_type());
  KDA_CHECK_TYPE(Q.scalar_type() == S.scalar_type() && P.scalar_type() == S.scalar_type(),
                 "S, Q and P must share one dtype, got ", S.scalar_type(), ", ", Q.scalar_type(), ", ",
                 P.scalar_type());
  KDA_CHECK_SAME_DEVICE(Q, S, "Q");
  KDA_CHECK_SAME_DEVICE(P, S, "P");
  const auto contiguous = [](const at::Tensor& t, const char* name) {
    KDA_CHECK(t.is_contiguous(), name, " must be contiguous, got strides ", t.strides());
  };
  contiguous(S, "S");
  contiguous(Q, "Q");
  contiguous(P, "P");
  KDA_CHECK(first >= 1, "first must be >= 1, got ", first);
}

// The packed layout: S, Q [segments, HV, V, K]; P [segments, HV, K, K]; seg_first, seg_count int64 [N] on S's
// device (sequence n owns segments seg_first[n] .. + seg_count[n] - 1; the kernels trust these values, which the
// split builds).
inline void check_segment_state_scan_packed(const at::Tensor& S, const at::Tensor& Q, const at::Tensor& P,
                                            const at::Tensor& seg_first, const at::Tensor& seg_count) {
  check_segment_state_scan(S, Q, P, 1);
  KDA_CHECK(seg_first.dim() == 1 && seg_count.sizes() == seg_first.sizes(),
            "seg_first and seg_count must be [N] of one length, got ", seg_first.sizes(), " and ", seg_count.sizes());
  KDA_CHECK_TYPE(seg_first.scalar_type() == at::kLong && seg_count.scalar_type() == at::kLong,
                 "seg_first and seg_count must be int64, got ", seg_first.scalar_type(), " and ",
                 seg_count.scalar_type());
  KDA_CHECK_SAME_DEVICE(seg_first, S, "seg_first");
  KDA_CHECK_SAME_DEVICE(seg_count, S, "seg_count");
  KDA_CHECK(seg_first.is_contiguous() && seg_count.is_contiguous(), "seg_first and seg_count must be contiguous");
}

}  // namespace kda
