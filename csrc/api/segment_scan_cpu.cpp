// CPU implementation of kda::segment_state_scan: one batched matmul per segment index (any float dtype).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "api/segment_scan_checks.h"

namespace kda {
namespace {

void segment_state_scan_cpu(const at::Tensor& S, const at::Tensor& Q, const at::Tensor& P, int64_t first) {
  check_segment_state_scan(S, Q, P, first);
  for (int64_t j = first; j < S.size(0); ++j) {
    at::Tensor out = S.select(0, j);
    at::baddbmm_out(out, Q.select(0, j - 1), S.select(0, j - 1), P.select(0, j - 1));
  }
}

}  // namespace
}  // namespace kda

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("segment_state_scan", &kda::segment_state_scan_cpu);
}
