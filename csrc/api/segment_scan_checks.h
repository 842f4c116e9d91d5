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

}  // namespace kda
