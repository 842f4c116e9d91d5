// CUDA implementation of kda::segment_state_scan: one launch of csrc/kda/common/segment_scan.cu (fp32, K <= 128).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cstdint>

#include "api/segment_scan_checks.h"
#include "kda/common/segment_fixup.h"
#include "kda/common/segment_scan.h"

namespace kda {
namespace {

void segment_state_scan_cuda(const at::Tensor& S, const at::Tensor& Q, const at::Tensor& P, int64_t first) {
  check_segment_state_scan(S, Q, P, first);
  KDA_CHECK_TYPE(S.scalar_type() == at::kFloat, "CUDA segment_state_scan needs float32, got ", S.scalar_type());
  KDA_CHECK(S.size(3) <= 128, "CUDA segment_state_scan needs K <= 128, got K=", S.size(3));
  KDA_CHECK(S.size(2) <= int64_t(65535) * 8 && S.size(1) <= INT32_MAX,
            "CUDA segment_state_scan needs V <= 524280 and batch < 2^31, got V=", S.size(2), ", batch=", S.size(1));
  if (S.numel() == 0) return;
  c10::cuda::CUDAGuard guard(S.device());
  const cudaError_t err = launch_segment_state_scan(
      S.data_ptr<float>(), Q.data_ptr<float>(), P.data_ptr<float>(), S.size(0), S.size(1), static_cast<int>(S.size(2)),
      static_cast<int>(S.size(3)), first, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "kda segment_state_scan kernel launch failed: ", cudaGetErrorString(err));
}

void segment_state_scan_packed_cuda(const at::Tensor& S, const at::Tensor& Q, const at::Tensor& P,
                                    const at::Tensor& seg_first, const at::Tensor& seg_count,
                                    const std::optional<at::Tensor>& fin) {
  check_segment_state_scan_packed(S, Q, P, seg_first, seg_count, fin);
  KDA_CHECK_TYPE(S.scalar_type() == at::kFloat, "CUDA segment_state_scan_packed needs float32, got ", S.scalar_type());
  KDA_CHECK(S.size(3) <= 128, "CUDA segment_state_scan_packed needs K <= 128, got K=", S.size(3));
  KDA_CHECK(S.size(2) <= int64_t(65535) * 8 && seg_first.size(0) * S.size(1) <= INT32_MAX,
            "CUDA segment_state_scan_packed needs V <= 524280 and N * HV < 2^31, got V=", S.size(2));
  if (S.numel() == 0 || seg_first.numel() == 0) return;
  c10::cuda::CUDAGuard guard(S.device());
  const cudaError_t err = launch_segment_state_scan_packed(
      S.data_ptr<float>(), Q.data_ptr<float>(), P.data_ptr<float>(), seg_first.data_ptr<int64_t>(),
      seg_count.data_ptr<int64_t>(), fin.has_value() ? fin->data_ptr<float>() : nullptr, seg_first.size(0),
      static_cast<int>(S.size(1)), static_cast<int>(S.size(2)), static_cast<int>(S.size(3)),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "kda segment_state_scan_packed kernel launch failed: ", cudaGetErrorString(err));
}

#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
// max_segment_tokens: the grid's tiles per segment (the caller's segment length; a longer segment is an error the
// kernel cannot see, so the caller passes the plan's length).
void segment_output_fixup_cuda(const at::Tensor& out, const at::Tensor& A, const at::Tensor& S,
                               const at::Tensor& seg_cu, const at::Tensor& rows, int64_t max_segment_tokens) {
  check_segment_output_fixup(out, A, S, seg_cu, rows);
  KDA_CHECK_TYPE(out.scalar_type() == at::kBFloat16 && S.scalar_type() == at::kFloat,
                 "CUDA segment_output_fixup needs bf16 out and A and an fp32 S, got ", out.scalar_type(), " and ",
                 S.scalar_type());
  KDA_CHECK(S.size(2) % 16 == 0 && S.size(3) % 16 == 0 && S.size(2) <= 128 && S.size(3) <= 128,
            "CUDA segment_output_fixup needs K and V multiples of 16 up to 128, got V=", S.size(2), ", K=", S.size(3));
  if (out.numel() == 0 || rows.numel() == 0) return;
  c10::cuda::CUDAGuard guard(out.device());
  const cudaError_t err = launch_segment_output_fixup(
      out.data_ptr(), A.data_ptr(), S.data_ptr<float>(), seg_cu.data_ptr<int64_t>(), rows.data_ptr<int>(), rows.size(0),
      max_segment_tokens, static_cast<int>(S.size(1)), static_cast<int>(S.size(2)), static_cast<int>(S.size(3)),
      c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "kda segment_output_fixup kernel launch failed: ", cudaGetErrorString(err));
}
#endif  // KDA_EXPERIMENTS (the one-pass split's fix-up: an experiment)

}  // namespace
}  // namespace kda

TORCH_LIBRARY_IMPL(kda, CUDA, m) {
  m.impl("segment_state_scan", &kda::segment_state_scan_cuda);
  m.impl("segment_state_scan_packed", &kda::segment_state_scan_packed_cuda);
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
  m.impl("segment_output_fixup", &kda::segment_output_fixup_cuda);
#endif
}
