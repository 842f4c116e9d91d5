// CUDA implementation of kda::recurrent_kda (docs/contract.md, API): checks -> RecurrentParams -> the token-serial
// kernel (csrc/kda/decode) or the chunked tensor-core prefill (csrc/kda/chunked) on the current stream.
// Which kernel runs is decided by the routing spine (route_forward, csrc/kda/route/route.h) from the backend
// argument (2 recurrent: a token-serial kernel for every mode; 1 chunked: a chunked kernel, prefill with K == V ==
// 128 and no speculative decode; 0 auto: chunked when supported and the sequences average at least 16 tokens),
// the device and the launch knobs.
// zero_uncovered (set by the Python layer when it allocated `output`): packed tokens outside every
// sequence are zeroed first by a small kernel (csrc/kda/common/zero_uncovered.cu); a caller's `output`
// keeps them as they were.
// disable_state_update (speculative verify): the token-serial kernel with pool writes off (backend auto
// picks it; chunked refuses the flag).
// No host sync and no allocation on the normal path, so calls can be captured in a CUDA graph (a state-only
// call, a 1-D empty output, that takes a token-serial kernel allocates a scratch output).
#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "api/checks.h"
#include "api/recurrent_params.h"
#include "kda/common/zero_uncovered.h"
#include "kda/decode/recurrent_launch.h"
#include "kda/chunked/chunked_launch.h"
#include "kda/params.h"
#include "kda/route/route.h"

namespace kda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

bool aligned(const void* ptr, int bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % bytes == 0;
}

// q, k, g are read in 8- or 16-byte pieces: the base must be 16-byte aligned and every stride a multiple
// of 8 elements. Views that are not (rare: fused projections have K-multiple strides) get a compact copy.
Tensor vector_readable(const Tensor& t) {
  bool ok = t.stride(-1) == 1 && aligned(t.data_ptr(), 16);
  for (int d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  return ok ? t : t.contiguous().clone();
}

void check_state_buffer(const OptTensor& t, const char* name, int64_t slot_stride, bool check_stride) {
  if (!t.has_value()) return;
  KDA_CHECK_TYPE(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, name,
                 " must be float32 or bfloat16 on CUDA, got ", t->scalar_type());
  KDA_CHECK(aligned(t->data_ptr(), 16), name, " must be 16-byte aligned on CUDA, got address ", t->data_ptr());
  const int64_t elem = t->element_size();
  KDA_CHECK(!check_stride || (slot_stride * elem) % 16 == 0, name,
            " must have a slot stride of a multiple of 16 bytes on CUDA, got ", slot_stride, " elements");
}

void recurrent_kda_cuda(const Tensor& q_in, const Tensor& k_in, const Tensor& v_in, const Tensor& g_in,
                        const Tensor& beta, const OptTensor& A_log, const OptTensor& dt_bias, const OptTensor& state,
                        const OptTensor& state_source, const OptTensor& initial_state_indices,
                        const OptTensor& cu_seqlens, const OptTensor& ssm_state_indices,
                        const OptTensor& num_accepted_tokens, const OptTensor& seq_order, const Tensor& output,
                        const OptTensor& final_state, const OptTensor& state_checkpoints,
                        const OptTensor& checkpoint_cu_starts, const OptTensor& /*workspace*/, double scale,
                        int64_t gate_mode, double lower_bound, bool use_qk_l2norm, bool beta_is_logit,
                        int64_t num_spec_tokens, int64_t checkpoint_every_n_tokens, int64_t backend,
                        bool zero_uncovered, bool disable_state_update) {
  KDA_CHECK(backend >= 0 && backend <= 2, "backend must be 0 (auto), 1 (chunked) or 2 (recurrent), got ", backend);
  KDA_CHECK(q_in.is_cuda(), "q must be a CUDA tensor, got ", q_in.device());
  for (const Tensor* t : {&k_in, &v_in, &g_in, &beta, &output}) KDA_CHECK_SAME_DEVICE(*t, q_in, "every token tensor");
  for (const OptTensor* t :
       {&A_log, &dt_bias, &state, &state_source, &initial_state_indices, &cu_seqlens, &ssm_state_indices,
        &num_accepted_tokens, &seq_order, &final_state, &state_checkpoints, &checkpoint_cu_starts})
    if (t->has_value()) KDA_CHECK_SAME_DEVICE(**t, q_in, "every tensor argument");
  for (const Tensor* t : {&q_in, &k_in, &v_in, &g_in, &beta, &output})
    KDA_CHECK_TYPE(t->scalar_type() == at::kBFloat16,
                   "CUDA recurrent_kda token tensors (q, k, v, g, beta, output) "
                   "must be ",
                   at::kBFloat16, ", got ", t->scalar_type());
  KDA_CHECK(q_in.dim() == 4 && v_in.dim() == 4, "q and v must be rank 4, got ", q_in.dim(), " and ", v_in.dim());
  const int64_t K = q_in.size(3), Vd = v_in.size(3);
  KDA_CHECK(K == Vd && (K == 64 || K == 128), "CUDA recurrent_kda needs K == V in {64, 128}, got K=", K, ", V=", Vd);

  c10::cuda::CUDAGuard guard(q_in.device());
  const Tensor q = vector_readable(q_in), k = vector_readable(k_in), g = vector_readable(g_in);
  const Tensor v = vector_readable(v_in);
  const RecurrentArgs args{q,
                           k,
                           v,
                           g,
                           beta,
                           A_log,
                           dt_bias,
                           state,
                           state_source,
                           initial_state_indices,
                           cu_seqlens,
                           ssm_state_indices,
                           num_accepted_tokens,
                           seq_order,
                           output,
                           final_state,
                           state_checkpoints,
                           checkpoint_cu_starts,
                           scale,
                           gate_mode,
                           lower_bound,
                           use_qk_l2norm,
                           beta_is_logit,
                           num_spec_tokens,
                           checkpoint_every_n_tokens};
  RecurrentParams p = make_recurrent_params(args);
  check_state_buffer(state, "initial_state", p.state_slot_stride, true);
  check_state_buffer(state_source, "initial_state_source", p.source_slot_stride, true);
  check_state_buffer(state_checkpoints, "state_checkpoints", 0, false);
  if (final_state.has_value())
    KDA_CHECK(aligned(final_state->data_ptr(), 16), "final_state must be 16-byte aligned on CUDA");
  if (p.T == 0 || p.N == 0) {
    // Nothing to compute but final states (zero-length sequences keep their start state).
    if (p.final_state == nullptr) return;
  }
  // The route (kernel family, tile, variant) is the spine's (kda/route/route.h); a pinned backend that cannot run
  // the call comes back with its reason.
  const ForwardRoute route = route_forward(p, static_cast<Backend>(backend), disable_state_update);
  KDA_CHECK(route.error == nullptr, "recurrent_kda backend='chunked': ", route.error == nullptr ? "" : route.error,
            "; use backend='auto' or 'recurrent'");
  const bool chunked = route.kernel == ForwardKernel::kChunkedMma || route.kernel == ForwardKernel::kChunkedSm90;
  // A state-only call (1-D empty output): the chunked kernel skips the output product; the token-serial
  // kernels write a scratch output instead.
  const Tensor scratch = chunked ? Tensor() : output_scratch(p, v);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (zero_uncovered && p.cu_seqlens != nullptr && p.out != nullptr && !scratch.defined()) {
    // A freshly allocated output (torch.empty): tokens outside every sequence must read as zero. Only
    // they are written, found on the device from cu_seqlens (no sync); the main kernel writes the rest.
    const cudaError_t zerr = launch_zero_uncovered_tokens(p, stream);
    TORCH_CHECK(zerr == cudaSuccess, "kda zero_uncovered_tokens kernel launch failed: ", cudaGetErrorString(zerr));
  }
  const cudaError_t err =
      chunked ? launch_chunked(p, route, stream) : launch_recurrent(p, route, stream, disable_state_update);
  TORCH_CHECK(err == cudaSuccess, "kda ", chunked ? "chunked" : "recurrent",
              " kernel launch failed: ", cudaGetErrorString(err));
}

}  // namespace
}  // namespace kda

TORCH_LIBRARY_IMPL(kda, CUDA, m) {
  m.impl("recurrent_kda", &kda::recurrent_kda_cuda);
  m.impl("recurrent_kda_decode", &kda::recurrent_kda_decode_as_full<&kda::recurrent_kda_cuda>);
}
