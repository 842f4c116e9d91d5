// Argument checks of kda::segment_state_scan (the exact sequence split's scan of segment start states),
// shared by its CPU and CUDA implementations.
#pragma once
#include <ATen/ATen.h>

#include <optional>

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
                                            const at::Tensor& seg_first, const at::Tensor& seg_count,
                                            const std::optional<at::Tensor>& fin) {
  check_segment_state_scan(S, Q, P, 1);
  KDA_CHECK(seg_first.dim() == 1 && seg_count.sizes() == seg_first.sizes(),
            "seg_first and seg_count must be [N] of one length, got ", seg_first.sizes(), " and ", seg_count.sizes());
  KDA_CHECK_TYPE(seg_first.scalar_type() == at::kLong && seg_count.scalar_type() == at::kLong,
                 "seg_first and seg_count must be int64, got ", seg_first.scalar_type(), " and ",
                 seg_count.scalar_type());
  KDA_CHECK_SAME_DEVICE(seg_first, S, "seg_first");
  KDA_CHECK_SAME_DEVICE(seg_count, S, "seg_count");
  KDA_CHECK(seg_first.is_contiguous() && seg_count.is_contiguous(), "seg_first and seg_count must be contiguous");
  if (fin.has_value()) {
    KDA_CHECK(fin->dim() == 4 && fin->size(0) == seg_first.size(0) && fin->size(1) == S.size(1) &&
                  fin->size(2) == S.size(2) && fin->size(3) == S.size(3),
              "final must be [N, HV, V, K] = [", seg_first.size(0), ", ", S.size(1), ", ", S.size(2), ", ", S.size(3),
              "], got ", fin->sizes());
    KDA_CHECK_TYPE(fin->scalar_type() == S.scalar_type(), "final must have S's dtype ", S.scalar_type(), ", got ",
                   fin->scalar_type());
    KDA_CHECK_SAME_DEVICE(*fin, S, "final");
    KDA_CHECK(fin->is_contiguous(), "final must be contiguous");
  }
}

// kda::segment_output_fixup: out [T, HV, V] and A [T, HV, K] of one dtype, S [slots, HV, V, K] floating, seg_cu
// int64 [slots + 1], rows int32 [slots], one device, contiguous.
inline void check_segment_output_fixup(const at::Tensor& out, const at::Tensor& A, const at::Tensor& S,
                                       const at::Tensor& seg_cu, const at::Tensor& rows) {
  KDA_CHECK(S.dim() == 4, "S must be [slots, HV, V, K], got ", S.sizes());
  KDA_CHECK(out.dim() == 3 && out.size(1) == S.size(1) && out.size(2) == S.size(2), "out must be [T, HV, V] = [T, ",
            S.size(1), ", ", S.size(2), "], got ", out.sizes());
  KDA_CHECK(A.dim() == 3 && A.size(0) == out.size(0) && A.size(1) == S.size(1) && A.size(2) == S.size(3),
            "A must be [T, HV, K] = [", out.size(0), ", ", S.size(1), ", ", S.size(3), "], got ", A.sizes());
  KDA_CHECK(rows.dim() == 1 && rows.size(0) <= S.size(0) && seg_cu.dim() == 1 && seg_cu.size(0) == rows.size(0) + 1,
            "rows must be [slots] (at most S's ", S.size(0), ") and seg_cu [slots + 1], got ", rows.sizes(), " and ",
            seg_cu.sizes());
  KDA_CHECK_TYPE(A.scalar_type() == out.scalar_type(), "A must have out's dtype ", out.scalar_type(), ", got ",
                 A.scalar_type());
  KDA_CHECK_TYPE(at::isFloatingType(S.scalar_type()), "S must be a floating dtype, got ", S.scalar_type());
  KDA_CHECK_TYPE(seg_cu.scalar_type() == at::kLong && rows.scalar_type() == at::kInt,
                 "seg_cu must be int64 and rows int32, got ", seg_cu.scalar_type(), " and ", rows.scalar_type());
  for (const at::Tensor* t : {&A, &S, &seg_cu, &rows}) KDA_CHECK_SAME_DEVICE(*t, out, "every argument");
  for (const at::Tensor* t : {&out, &A, &S, &seg_cu, &rows})
    KDA_CHECK(t->is_contiguous(), "segment_output_fixup needs contiguous tensors, got strides ", t->strides());
}

}  // namespace kda
