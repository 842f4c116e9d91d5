// Tensors of the kda::recurrent_kda schema -> RecurrentParams (shared by the CPU and CUDA impls).
#pragma once
#include <cmath>
#include <cstdint>
#include <optional>

#include "api/checks.h"
#include "kda/params.h"

namespace kda {

inline DType to_kda_dtype(at::ScalarType t, const char* name) {
  switch (t) {
    case at::kFloat:
      return DType::kFloat32;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kDouble:
      return DType::kFloat64;
    case at::kHalf:
      return DType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, name, " has unsupported dtype ", t);
  }
}

inline TokenTensor token_tensor(const at::Tensor& t, const char* name) {
  // `name` is not a literal here, so KDA_CHECK_LASTDIM_CONTIGUOUS (which pastes it) cannot be used.
  KDA_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dim, got strides ", t.strides());
  TokenTensor r;
  r.ptr = t.data_ptr();
  r.batch_stride = t.stride(0);
  r.token_stride = t.stride(1);
  r.head_stride = t.stride(2);
  return r;
}

struct RecurrentArgs {
  const at::Tensor &q, &k, &v, &g, &beta;
  const std::optional<at::Tensor>&A_log, &dt_bias, &state, &state_source, &initial_state_indices, &cu_seqlens,
      &ssm_state_indices, &num_accepted_tokens, &seq_order;
  const at::Tensor& output;
  const std::optional<at::Tensor>&final_state, &state_checkpoints, &checkpoint_cu_starts;
  double scale;
  int64_t gate_mode;
  double lower_bound;
  bool use_qk_l2norm, beta_is_logit;
  int64_t num_spec_tokens, checkpoint_every_n_tokens;
};

// recurrent_kda_decode's `decode_flags` (registration.cpp): the small arguments of recurrent_kda, packed.
struct DecodeMode {
  int64_t gate_mode, backend, num_spec_tokens;
  bool use_qk_l2norm, beta_is_logit, disable_state_update;
};
inline DecodeMode unpack_decode_mode(int64_t mode) {
  KDA_CHECK(mode >= 0 && mode < (int64_t(1) << 32),
            "recurrent_kda_decode decode_flags must be a 32-bit packed value, got ", mode);
  return DecodeMode{
      mode & 3, (mode >> 8) & 0xff, mode >> 16, ((mode >> 2) & 1) != 0, ((mode >> 3) & 1) != 0, ((mode >> 4) & 1) != 0};
}

// recurrent_kda_decode (the short-schema entry of the eager decode hot path, registration.cpp) as a call of
// the full recurrent_kda implementation `Full` (the CPU or the CUDA one): no source pool, cu_seqlens,
// seq_order, final state, checkpoints or workspace; zero_uncovered off. Registered as
// `&recurrent_kda_decode_as_full<&the_full_op>`, so both backends share this one signature.
template <auto Full>
void recurrent_kda_decode_as_full(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                  const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                                  const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& state,
                                  const std::optional<at::Tensor>& ssm_state_indices,
                                  const std::optional<at::Tensor>& num_accepted_tokens, const at::Tensor& output,
                                  double scale, double lower_bound, int64_t decode_flags) {
  const DecodeMode m = unpack_decode_mode(decode_flags);
  const std::optional<at::Tensor> none;
  Full(q, k, v, g, beta, A_log, dt_bias, state, none, none, none, ssm_state_indices, num_accepted_tokens, none, output,
       none, none, none, none, scale, m.gate_mode, lower_bound, m.use_qk_l2norm, m.beta_is_logit, m.num_spec_tokens, 0,
       m.backend, false, m.disable_state_update);
}

// Fills the POD params; checks only what would otherwise be a memory error (ranks, inner sizes,
// dtypes of index tensors, compact inner state blocks). Full validation is kda_ops/_validate.py.
inline RecurrentParams make_recurrent_params(const RecurrentArgs& a) {
  KDA_CHECK(a.gate_mode >= 0 && a.gate_mode <= 2,
            "gate_mode must be 0 (precomputed), 1 (softplus) or 2 (lower bound), got ", a.gate_mode);
  KDA_CHECK(a.num_spec_tokens >= 0, "num_spec_tokens must be >= 0, got ", a.num_spec_tokens);
  KDA_CHECK(a.checkpoint_every_n_tokens >= 0, "checkpoint_every_n_tokens must be >= 0, got ",
            a.checkpoint_every_n_tokens);
  KDA_CHECK(std::isfinite(a.scale) && a.scale > 0, "scale must be a finite number > 0, got ", a.scale);
  KDA_CHECK(a.q.dim() == 4 && a.k.dim() == 4 && a.v.dim() == 4 && a.g.dim() == 4 && a.beta.dim() == 3,
            "q, k, v, g must be rank 4 and beta rank 3");
  // Head and channel counts >= 1 before anything divides by them (B and T may be 0: nothing to compute).
  KDA_CHECK(a.q.size(2) >= 1 && a.q.size(3) >= 1, "q must be [B, T, H, K] with H >= 1 and K >= 1, got ", a.q.sizes());
  KDA_CHECK(a.v.size(2) >= 1 && a.v.size(3) >= 1, "v must be [B, T, HV, V] with HV >= 1 and V >= 1, got ", a.v.sizes());
  KDA_CHECK(
      a.q.size(2) <= INT32_MAX && a.v.size(2) <= INT32_MAX && a.q.size(3) <= INT32_MAX && a.v.size(3) <= INT32_MAX,
      "head and channel counts must fit in int32, got q ", a.q.sizes(), ", v ", a.v.sizes());
  RecurrentParams p;
  p.B = a.q.size(0);
  p.T = a.q.size(1);
  p.H = a.q.size(2);
  p.K = a.q.size(3);
  p.HV = a.v.size(2);
  p.V = a.v.size(3);
  KDA_CHECK(p.HV % p.H == 0, "HV % H must be 0, got HV=", p.HV, ", H=", p.H);
  KDA_CHECK(a.k.sizes() == a.q.sizes(), "k must have the shape of q ", a.q.sizes(), ", got ", a.k.sizes());
  KDA_CHECK(a.g.size(0) == p.B && a.g.size(1) == p.T && a.g.size(2) == p.HV && a.g.size(3) == p.K,
            "g must be [B, T, HV, K], got ", a.g.sizes());
  KDA_CHECK(a.beta.size(0) == p.B && a.beta.size(1) == p.T && a.beta.size(2) == p.HV, "beta must be [B, T, HV], got ",
            a.beta.sizes());
  // A 1-D empty output: the caller needs only the states (the sequence split's end-state passes); the
  // chunked kernel then skips the output product, the other paths write a scratch buffer (output_scratch).
  const bool no_output = a.output.dim() == 1 && a.output.numel() == 0;
  KDA_CHECK(no_output || a.output.sizes() == a.v.sizes(), "output must have the shape of v ", a.v.sizes(),
            " (or be a 1-D empty tensor when only the states are needed), got ", a.output.sizes());
  p.token_dtype = to_kda_dtype(a.q.scalar_type(), "q");
  for (const at::Tensor* t : {&a.k, &a.v, &a.g, &a.beta, &a.output})
    KDA_CHECK_TYPE(t->scalar_type() == a.q.scalar_type(), "token tensors must share q's dtype ", a.q.scalar_type(),
                   ", got ", t->scalar_type());
  p.q = token_tensor(a.q, "q");
  p.k = token_tensor(a.k, "k");
  p.v = token_tensor(a.v, "v");
  p.g = token_tensor(a.g, "g");
  p.beta.ptr = a.beta.data_ptr();
  p.beta.batch_stride = a.beta.stride(0);
  p.beta.token_stride = a.beta.stride(1);
  p.beta.head_stride = a.beta.stride(2);
  if (!no_output) {
    KDA_CHECK_LASTDIM_CONTIGUOUS(a.output, "output");
    p.out = a.output.data_ptr();
    p.out_batch_stride = a.output.stride(0);
    p.out_token_stride = a.output.stride(1);
    p.out_head_stride = a.output.stride(2);
  }  // else p.out stays null

  p.gate_mode = static_cast<GateMode>(a.gate_mode);
  if (p.gate_mode != GateMode::kPrecomputed) {
    KDA_CHECK(a.A_log.has_value(), "A_log is required by the in-kernel gate");
    KDA_CHECK(a.A_log->is_contiguous() && a.A_log->numel() == p.HV, "A_log must be contiguous [HV]=[", p.HV, "], got ",
              a.A_log->sizes());
    KDA_CHECK_DTYPE(*a.A_log, at::kFloat, "A_log");
    p.A_log = a.A_log->data_ptr<float>();
    if (a.dt_bias.has_value()) {
      KDA_CHECK(a.dt_bias->is_contiguous() && a.dt_bias->numel() == int64_t(p.HV) * p.K,
                "dt_bias must be contiguous [HV, K], got ", a.dt_bias->sizes());
      KDA_CHECK_DTYPE(*a.dt_bias, at::kFloat, "dt_bias");
      p.dt_bias = a.dt_bias->data_ptr<float>();
    }
  }

  const int64_t inner = int64_t(p.HV) * p.V * p.K;
  auto check_pool = [&](const at::Tensor& s, const char* name) {
    KDA_CHECK(s.dim() == 4 && s.size(1) == p.HV && s.size(2) == p.V && s.size(3) == p.K, name,
              " must be [N_pool, HV, V, K] = [*, ", p.HV, ", ", p.V, ", ", p.K, "], got ", s.sizes());
    KDA_CHECK(s.stride(3) == 1 && s.stride(2) == p.K && s.stride(1) == int64_t(p.V) * p.K &&
                  (s.size(0) <= 1 || s.stride(0) >= inner),
              name, " must have a compact [HV, V, K] block per slot, got strides ", s.strides());
  };
  if (a.state.has_value()) {
    check_pool(*a.state, "initial_state");
    p.state = a.state->data_ptr();
    p.state_dtype = to_kda_dtype(a.state->scalar_type(), "initial_state");
    p.state_slot_stride = a.state->size(0) <= 1 ? inner : a.state->stride(0);
    p.n_pool = a.state->size(0);
  }
  if (a.state_source.has_value()) {
    check_pool(*a.state_source, "initial_state_source");
    KDA_CHECK(a.initial_state_indices.has_value(), "initial_state_indices is required with initial_state_source");
    p.state_source = a.state_source->data_ptr();
    p.state_source_dtype = to_kda_dtype(a.state_source->scalar_type(), "initial_state_source");
    p.source_slot_stride = a.state_source->size(0) <= 1 ? inner : a.state_source->stride(0);
    p.n_source = a.state_source->size(0);
  }
  if (a.cu_seqlens.has_value()) {
    KDA_CHECK(p.B == 1, "cu_seqlens needs B == 1, got B=", p.B);
    KDA_CHECK(a.cu_seqlens->dim() == 1 && a.cu_seqlens->numel() >= 2 && a.cu_seqlens->is_contiguous(),
              "cu_seqlens must be a contiguous [N+1] tensor with N >= 1, got ", a.cu_seqlens->sizes());
    auto dt = a.cu_seqlens->scalar_type();
    KDA_CHECK_TYPE(dt == at::kInt || dt == at::kLong, "cu_seqlens must be int32 or int64, got ", dt);
    p.cu_seqlens = a.cu_seqlens->data_ptr();
    p.cu_seqlens_int64 = dt == at::kLong;
    p.N = a.cu_seqlens->numel() - 1;
  } else {
    p.N = p.B;
  }
  p.num_spec_tokens = static_cast<int>(a.num_spec_tokens);
  auto check_index = [&](const std::optional<at::Tensor>& t, int64_t numel, const char* name) -> const int32_t* {
    if (!t.has_value()) return nullptr;
    KDA_CHECK_TYPE(t->scalar_type() == at::kInt, name, " must be int32, got ", t->scalar_type());
    KDA_CHECK(t->is_contiguous() && t->numel() == numel, name, " must be contiguous with ", numel, " elements, got ",
              t->sizes());
    return t->data_ptr<int32_t>();
  };
  p.ssm_state_indices = check_index(a.ssm_state_indices, p.N * (p.num_spec_tokens + 1), "ssm_state_indices");
  if (p.num_spec_tokens > 0)
    KDA_CHECK(p.ssm_state_indices != nullptr && p.state != nullptr,
              "speculative decode needs initial_state and ssm_state_indices [N, 1+S]");
  p.num_accepted_tokens = check_index(a.num_accepted_tokens, p.N, "num_accepted_tokens");
  p.initial_state_indices = check_index(a.initial_state_indices, p.N, "initial_state_indices");
  p.seq_order = check_index(a.seq_order, p.N, "seq_order");
  if (a.final_state.has_value()) {
    KDA_CHECK(a.final_state->is_contiguous() && a.final_state->numel() == p.N * inner,
              "final_state must be a contiguous [N, HV, V, K], got ", a.final_state->sizes());
    KDA_CHECK_DTYPE(*a.final_state, at::kFloat, "final_state");
    p.final_state = a.final_state->data_ptr<float>();
  }
  p.checkpoint_every_n_tokens = static_cast<int>(a.checkpoint_every_n_tokens);
  if (p.checkpoint_every_n_tokens > 0) {
    KDA_CHECK(a.state_checkpoints.has_value() && a.checkpoint_cu_starts.has_value(),
              "checkpointing needs state_checkpoints and checkpoint_cu_starts");
    KDA_CHECK(a.state_checkpoints->is_contiguous() && a.state_checkpoints->dim() == 4 &&
                  a.state_checkpoints->numel() == a.state_checkpoints->size(0) * inner,
              "state_checkpoints must be a contiguous [C, HV, V, K], got ", a.state_checkpoints->sizes());
    KDA_CHECK_DTYPE(*a.checkpoint_cu_starts, at::kLong, "checkpoint_cu_starts");
    KDA_CHECK(a.checkpoint_cu_starts->is_contiguous() && a.checkpoint_cu_starts->numel() == p.N + 1,
              "checkpoint_cu_starts must be contiguous [N+1], got ", a.checkpoint_cu_starts->sizes());
    p.state_checkpoints = a.state_checkpoints->data_ptr();
    p.checkpoint_dtype = to_kda_dtype(a.state_checkpoints->scalar_type(), "state_checkpoints");
    p.checkpoint_cu_starts = a.checkpoint_cu_starts->data_ptr<int64_t>();
    p.n_checkpoint_rows = a.state_checkpoints->size(0);
  }
  p.scale = static_cast<float>(a.scale);
  p.lower_bound = static_cast<float>(a.lower_bound);
  p.use_qk_l2norm = a.use_qk_l2norm;
  p.beta_is_logit = a.beta_is_logit;
  return p;
}

// A state-only call (1-D empty output, p.out null) on a path that writes outputs anyway: a scratch output of
// v's shape for it to write, held by the returned tensor for the call.
inline at::Tensor output_scratch(RecurrentParams& p, const at::Tensor& v) {
  if (p.out != nullptr) return {};
  at::Tensor scratch = at::empty(v.sizes(), v.options());
  p.out = scratch.data_ptr();
  p.out_batch_stride = scratch.stride(0);
  p.out_token_stride = scratch.stride(1);
  p.out_head_stride = scratch.stride(2);
  return scratch;
}

}  // namespace kda
