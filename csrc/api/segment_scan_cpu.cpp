// CPU implementations of kda::segment_state_scan (one batched matmul per segment index) and
// kda::segment_state_scan_packed (one per sequence and segment), any float dtype.
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

void segment_state_scan_packed_cpu(const at::Tensor& S, const at::Tensor& Q, const at::Tensor& P,
                                   const at::Tensor& seg_first, const at::Tensor& seg_count) {
  check_segment_state_scan_packed(S, Q, P, seg_first, seg_count);
  const int64_t segments = S.size(0);
  const int64_t* first = seg_first.data_ptr<int64_t>();
  const int64_t* count = seg_count.data_ptr<int64_t>();
  for (int64_t n = 0; n < seg_first.size(0); ++n) {
    const int64_t f = first[n], c = count[n];
    if (c < 2) continue;
    KDA_CHECK(f >= 0 && f + c <= segments, "segment_state_scan_packed: sequence ", n, " owns segments ", f, "..",
              f + c - 1, " of ", segments);
    S.select(0, f + 1).copy_(Q.select(0, f));
    for (int64_t j = f + 2; j < f + c; ++j) {
      at::Tensor out = S.select(0, j);
      at::baddbmm_out(out, Q.select(0, j - 1), S.select(0, j - 1), P.select(0, j - 1));
    }
  }
}

}  // namespace
}  // namespace kda

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("segment_state_scan", &kda::segment_state_scan_cpu);
  m.impl("segment_state_scan_packed", &kda::segment_state_scan_packed_cpu);
}
