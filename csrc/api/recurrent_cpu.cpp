// kda::recurrent_kda on CPU (docs/contract.md, API): checks -> RecurrentParams -> the token loop
// (csrc/cpu/forward.cpp). Backend and workspace are CUDA scheduling choices and are ignored here, as is
// seq_order (a hint).
#include <cmath>
#include <vector>

#include "api/recurrent_params.h"
#include "cpu/token_loop.h"
#include "kda/common/token_coverage.h"
#include "kda/route/route.h"

namespace kda {
namespace cpu {

namespace {

// The tokens no sequence covers, by the same rule as the CUDA kernel (kda/common/token_coverage.h):
// adjoining ranges leave a prefix and a suffix; otherwise a coverage count per token (O(T + N)).
void zero_uncovered_tokens(const RecurrentParams& p, const at::Tensor& output) {
  const at::Tensor rows = output.select(0, 0);  // [T, HV, V] (packed: B == 1)
  bool chained = true;
  for (int64_t n = 1; n < p.N && chained; ++n) chained = ranges_adjoin(p, n);
  if (chained) {
    const int64_t lo = seq_range(p, 0).bos, hi = seq_end(seq_range(p, p.N - 1));
    if (lo > 0) rows.narrow(0, 0, lo).zero_();
    if (hi < p.T) rows.narrow(0, hi, p.T - hi).zero_();
    return;
  }
  std::vector<int64_t> depth(size_t(p.T) + 1, 0);  // +1 at each range start, -1 at its end
  for (int64_t n = 0; n < p.N; ++n) {
    const SeqRange r = seq_range(p, n);
    if (r.len > 0) ++depth[size_t(r.bos)], --depth[size_t(seq_end(r))];
  }
  int64_t d = 0, run = -1;  // run: first token of the current uncovered run (-1: none)
  for (int64_t t = 0; t <= p.T; ++t) {
    if (t < p.T) d += depth[size_t(t)];
    const bool uncovered = t < p.T && d == 0;
    if (uncovered && run < 0) run = t;
    if (!uncovered && run >= 0) rows.narrow(0, run, t - run).zero_(), run = -1;
  }
}

bool state_dtype_ok(DType dt) {
  return dt == DType::kFloat32 || dt == DType::kBFloat16 || dt == DType::kFloat64;
}

void recurrent_kda_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
    const std::optional<at::Tensor>& state, const std::optional<at::Tensor>& state_source,
    const std::optional<at::Tensor>& initial_state_indices, const std::optional<at::Tensor>& cu_seqlens,
    const std::optional<at::Tensor>& ssm_state_indices, const std::optional<at::Tensor>& num_accepted_tokens,
    const std::optional<at::Tensor>& seq_order, const at::Tensor& output, const std::optional<at::Tensor>& final_state,
    const std::optional<at::Tensor>& state_checkpoints, const std::optional<at::Tensor>& checkpoint_cu_starts,
    const std::optional<at::Tensor>& /*workspace*/, double scale, int64_t gate_mode, double lower_bound,
    bool use_qk_l2norm, bool beta_is_logit, int64_t num_spec_tokens, int64_t checkpoint_every_n_tokens,
    int64_t /*backend*/, bool zero_uncovered, bool disable_state_update) {
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
  note_cpu_route("forward", p.N, p.HV, p.T, p.B, p.K);
  const at::Tensor scratch = output_scratch(p, v);  // a state-only call: the loop writes a scratch output
  KDA_CHECK_TYPE(p.token_dtype != DType::kFloat16, "q must be bfloat16, float32 or float64 on CPU, got ",
                 q.scalar_type());
  if (p.state != nullptr)
    KDA_CHECK_TYPE(state_dtype_ok(p.state_dtype), "initial_state must be float32, bfloat16 or float64, got ",
                   state->scalar_type());
  if (p.state_source != nullptr)
    KDA_CHECK_TYPE(state_dtype_ok(p.state_source_dtype),
                   "initial_state_source must be float32, bfloat16 or float64, got ", state_source->scalar_type());
  if (p.state_checkpoints != nullptr)
    KDA_CHECK_TYPE(state_dtype_ok(p.checkpoint_dtype), "state_checkpoints must be float32, bfloat16 or float64, got ",
                   state_checkpoints->scalar_type());

  CpuExtras x;
  x.scale = scale;
  x.lower_bound = lower_bound;
  if (p.A_log != nullptr) x.A_log = p.A_log;  // fp32 [HV] (checked by make_recurrent_params)
  if (p.dt_bias != nullptr) x.dt_bias = p.dt_bias;
  x.final_state = p.final_state;
  x.final_dtype = DType::kFloat32;
  x.no_state_update = disable_state_update;

  // Inactive sequences/tokens are zeroed by the loop; tokens outside every packed sequence (a broken
  // cu_seqlens contract) keep their values, as on CUDA, unless zero_uncovered asks for zeros.
  if (zero_uncovered && p.cu_seqlens != nullptr && !scratch.defined()) zero_uncovered_tokens(p, output);
  run_forward(p, x);
}

}  // namespace

}  // namespace cpu
}  // namespace kda

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("recurrent_kda", &kda::cpu::recurrent_kda_cpu);
  m.impl("recurrent_kda_decode", &kda::recurrent_kda_decode_as_full<&kda::cpu::recurrent_kda_cpu>);
}
