// CPU implementations of kda::segment_state_scan (one batched matmul per segment index) and
// kda::segment_state_scan_packed (one per sequence and segment), any float dtype; kda::segment_output_fixup
// (one batched matmul per segment).
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
                                   const at::Tensor& seg_first, const at::Tensor& seg_count,
                                   const std::optional<at::Tensor>& fin) {
  check_segment_state_scan_packed(S, Q, P, seg_first, seg_count, fin);
  const int64_t segments = S.size(0);
  const int64_t* first = seg_first.data_ptr<int64_t>();
  const int64_t* count = seg_count.data_ptr<int64_t>();
  for (int64_t n = 0; n < seg_first.size(0); ++n) {
    const int64_t f = first[n], c = count[n];
    if (c < 1) continue;
    KDA_CHECK(f >= 0 && f + c <= segments, "segment_state_scan_packed: sequence ", n, " owns segments ", f, "..",
              f + c - 1, " of ", segments);
    for (int64_t j = f + 1; j <= f + c; ++j) {
      const bool last = j == f + c;
      if (last && !fin.has_value()) break;
      at::Tensor out = last ? fin->select(0, n) : S.select(0, j);
      if (j == f + 1)
        out.copy_(Q.select(0, f));
      else
        at::baddbmm_out(out, Q.select(0, j - 1), S.select(0, j - 1), P.select(0, j - 1));
    }
  }
}

void segment_output_fixup_cpu(const at::Tensor& out, const at::Tensor& A, const at::Tensor& S, const at::Tensor& seg_cu,
                              const at::Tensor& rows, int64_t max_segment_tokens) {
  check_segment_output_fixup(out, A, S, seg_cu, rows);
  const int64_t* cu = seg_cu.data_ptr<int64_t>();
  const int* row = rows.data_ptr<int>();
  for (int64_t s = 0; s < rows.size(0); ++s) {
    const int64_t t0 = cu[s], t1 = cu[s + 1];
    if (row[s] < 0 || t1 <= t0) continue;
    KDA_CHECK(row[s] < S.size(0) && t0 >= 0 && t1 <= out.size(0) && t1 - t0 <= max_segment_tokens,
              "segment_output_fixup: segment ", s, " out of range");
    // [HV, L, K] x [HV, K, V] in S's dtype, added to out's rows
    const at::Tensor a = A.slice(0, t0, t1).transpose(0, 1).to(S.scalar_type());
    const at::Tensor add = at::bmm(a, S.select(0, row[s]).transpose(1, 2)).transpose(0, 1);
    at::Tensor o = out.slice(0, t0, t1);
    o.copy_(o.to(S.scalar_type()) + add);
  }
}

}  // namespace
}  // namespace kda

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("segment_state_scan", &kda::segment_state_scan_cpu);
  m.impl("segment_state_scan_packed", &kda::segment_state_scan_packed_cpu);
  m.impl("segment_output_fixup", &kda::segment_output_fixup_cpu);
}
