// The training ops on CPU (docs/contract.md, Recurrence and API): kda::recurrent_kda_training_forward,
// kda::recurrent_kda_training_backward and kda::recurrent_kda_backward.
//
// Every mode of recurrent_kda: gate_mode (precomputed / softplus / lower bound), beta_is_logit, use_qk_l2norm; the
// token loop and backward_head.h read them from RecurrentParams.
//
// Forward: the inference token loop (token_loop.h) with per-sequence initial states, a final state per
// sequence and the tapes written as checkpoints every kTapeChunk tokens.
// Backward: per (sequence, value head), the backward of csrc/cpu/backward_head.h (chunks last to first,
// states recomputed from the tape rows, the reverse sweep carrying G = dL/dS).
// Reductions across value heads (GQA dq/dk) and across sequences (dA_log, ddt_bias) go through
// per-(sequence, head) partial buffers summed in a fixed order: results are bit-identical whatever
// the thread count.
#include <ATen/Parallel.h>

#include <tuple>

#include "api/recurrent_params.h"
#include "api/training_checks.h"
#include "cpu/backward_head.h"
#include "cpu/token_loop.h"
#include "kda/route/route.h"
#include "kda/tape_rows.h"

namespace kda {
namespace cpu {

namespace {

using Grads =
    std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

bool is_float_or_double(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
}

// Shapes, dtypes and host-side values shared by the three ops; everything is checked before any
// output is allocated or written.
struct TrainingProblem : TrainingShape {
  std::vector<int64_t> bos, len;  // per sequence
};

// The mode arguments of the three schemas.
struct TrainingModes {
  int64_t gate_mode;
  bool use_qk_l2norm, beta_is_logit;
};

// A compact copy of an optional parameter (strided views are accepted, as on CUDA).
std::optional<at::Tensor> compact(const std::optional<at::Tensor>& t) {
  return t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt;
}

TrainingProblem check_training_inputs(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta,
                                      const std::optional<at::Tensor>& A_log, const std::optional<at::Tensor>& dt_bias,
                                      const std::optional<at::Tensor>& cu_seqlens, double scale, double lower_bound,
                                      const TrainingModes& m) {
  const TrainingShape s =
      check_training_shapes(op, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound, m.gate_mode);
  const auto qt = q.scalar_type();
  KDA_CHECK_TYPE(qt == at::kBFloat16 || qt == at::kFloat || qt == at::kDouble, op,
                 ": q must be bfloat16, float32 or float64 on CPU, got ", qt);
  for (const auto* t : {&A_log, &dt_bias})
    KDA_CHECK_TYPE(!t->has_value() || is_float_or_double(**t), op,
                   ": A_log and dt_bias must be float32 or float64 on CPU, got ", (*t)->scalar_type());
  TrainingProblem pb;
  static_cast<TrainingShape&>(pb) = s;
  if (cu_seqlens.has_value()) {
    // The values, read on the host (the CUDA ops cannot: no host synchronisation there).
    const at::Tensor c = cu_seqlens->to(at::kLong).contiguous();
    const int64_t* cp = c.data_ptr<int64_t>();
    KDA_CHECK(cp[0] == 0, op, ": cu_seqlens[0] must be 0, got ", cp[0]);
    for (int64_t n = 0; n < pb.N; ++n) {
      KDA_CHECK(cp[n] <= cp[n + 1] && cp[n + 1] <= pb.T, op, ": cu_seqlens must be non-decreasing within [0, T=", pb.T,
                "], got cu_seqlens[", n, ":", n + 2, "] = ", cp[n], ", ", cp[n + 1]);
      pb.bos.push_back(cp[n]);
      pb.len.push_back(cp[n + 1] - cp[n]);
    }
  } else {
    pb.bos.assign(pb.N, 0);
    pb.len.assign(pb.N, pb.T);
  }
  return pb;
}

// Tape rows (kda/tape_rows.h): the bound from shapes, as the fake kernel computes it. Unused rows stay zero.
int64_t tape_rows(const TrainingProblem& pb, bool packed) {
  return tape_rows_bound(packed, pb.B, pb.T);
}

at::Tensor tape_starts(const TrainingProblem& pb) {
  at::Tensor s = at::empty({pb.N + 1}, at::kLong);
  int64_t* sp = s.data_ptr<int64_t>();
  sp[0] = 0;
  for (int64_t n = 0; n < pb.N; ++n) sp[n + 1] = sp[n] + tape_rows_of(pb.len[n]);
  return s;
}

void check_state(const at::Tensor& s, const TrainingProblem& pb, const char* name) {
  KDA_CHECK(s.dim() == 4 && s.size(0) == pb.N && s.size(1) == pb.HV && s.size(2) == pb.V && s.size(3) == pb.K, name,
            " must be [N, HV, V, K] = [", pb.N, ", ", pb.HV, ", ", pb.V, ", ", pb.K, "], got ", s.sizes());
  const auto t = s.scalar_type();
  KDA_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kDouble, name,
                 " must be float32, bfloat16 or float64, got ", t);
}

// RecurrentParams for the training call in its modes. The gate parameters go through CpuExtras (fp32 or
// fp64), so make_recurrent_params sees a precomputed gate; the gate mode is set afterwards.
// `output` gives the output layout (the backward passes `do` for the shape check and clears p.out).
RecurrentParams training_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                                const std::optional<at::Tensor>& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                                const at::Tensor& output, const at::Tensor& tapes, const at::Tensor& starts,
                                double scale, double lower_bound, const TrainingModes& m, CpuExtras& x) {
  const std::optional<at::Tensor> none;
  const std::optional<at::Tensor> tapes_opt(tapes), starts_opt(starts);
  const RecurrentArgs args{q,
                           k,
                           v,
                           g,
                           beta,
                           none,
                           none,
                           none,
                           none,
                           none,
                           cu_seqlens,
                           none,
                           none,
                           none,
                           output,
                           none,
                           tapes_opt,
                           starts_opt,
                           scale,
                           /*gate_mode=*/0,
                           lower_bound,
                           m.use_qk_l2norm,
                           m.beta_is_logit,
                           /*num_spec_tokens=*/0,
                           /*checkpoint_every_n_tokens=*/kTapeChunk};
  RecurrentParams p = make_recurrent_params(args);
  p.gate_mode = static_cast<GateMode>(m.gate_mode);
  const double lb = m.gate_mode == 2 ? lower_bound : 0.0;
  p.lower_bound = static_cast<float>(lb);
  x.scale = scale;
  x.lower_bound = lb;
  if (A_log.has_value()) {
    x.A_log = A_log->data_ptr();
    x.A_log_dtype = to_kda_dtype(A_log->scalar_type(), "A_log");
  }
  if (dt_bias.has_value()) {
    x.dt_bias = dt_bias->data_ptr();
    x.dt_bias_dtype = to_kda_dtype(dt_bias->scalar_type(), "dt_bias");
  }
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> training_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const std::optional<at::Tensor>& A_log_in, const std::optional<at::Tensor>& dt_bias_in,
    const at::Tensor& initial_state, const std::optional<at::Tensor>& cu_seqlens, double scale, double lower_bound,
    int64_t gate_mode, bool use_qk_l2norm, bool beta_is_logit) {
  const TrainingModes m{gate_mode, use_qk_l2norm, beta_is_logit};
  // Strided parameter views are accepted (as on CUDA): the loop reads compact copies.
  const std::optional<at::Tensor> A_log = compact(A_log_in), dt_bias = compact(dt_bias_in);
  const TrainingProblem pb = check_training_inputs("recurrent_kda_training_forward", q, k, v, g, beta, A_log, dt_bias,
                                                   cu_seqlens, scale, lower_bound, m);
  note_cpu_route("forward", pb.N, pb.HV, pb.T, pb.B, pb.K);
  check_state(initial_state, pb, "initial_state");
  const at::Tensor init = initial_state.contiguous();
  const auto tape_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor tapes =
      at::zeros({tape_rows(pb, cu_seqlens.has_value()), pb.HV, pb.V, pb.K}, q.options().dtype(tape_dtype));
  at::Tensor starts = tape_starts(pb);
  at::Tensor out = at::zeros(v.sizes(), v.options());
  at::Tensor final_state = at::empty({pb.N, pb.HV, pb.V, pb.K}, init.options());

  CpuExtras x;
  RecurrentParams p =
      training_params(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, out, tapes, starts, scale, lower_bound, m, x);
  p.checkpoint_first = 1;  // no tape row for the state before token 0
  x.init_state = init.data_ptr();
  x.init_dtype = to_kda_dtype(init.scalar_type(), "initial_state");
  x.final_state = final_state.data_ptr();
  x.final_dtype = x.init_dtype;
  run_forward(p, x);
  return {out, final_state, tapes, starts};
}

template <typename TokT>
void run_backward_typed(const RecurrentParams& p, const CpuExtras& x, const TrainingProblem& pb, const at::Tensor& dout,
                        const std::optional<at::Tensor>& dfinal, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                        at::Tensor& dg, at::Tensor& dbeta, at::Tensor& dA_log, at::Tensor& ddt_bias,
                        at::Tensor& dinit) {
  using Acc = acc_t<TokT>;
  const int64_t rows = pb.B * pb.T;
  std::vector<Acc> dq_hv(size_t(rows * pb.HV * pb.K), Acc(0)), dk_hv(dq_hv.size(), Acc(0));
  std::vector<Acc> dA_part(size_t(pb.N * pb.HV), Acc(0)), ddt_part(size_t(pb.N * pb.HV * pb.K), Acc(0));
  BackwardOut<TokT> bo;
  bo.dout = dout.data_ptr<TokT>();
  if (dfinal.has_value()) {
    bo.dfinal = dfinal->data_ptr();
    bo.dfinal_dtype = to_kda_dtype(dfinal->scalar_type(), "dfinal_state");
  }
  bo.dq_hv = dq_hv.data();
  bo.dk_hv = dk_hv.data();
  bo.dv = dv.data_ptr<TokT>();
  bo.dg = dg.data_ptr<TokT>();
  bo.dbeta = dbeta.data_ptr<TokT>();
  bo.dA_part = dA_part.data();
  bo.ddt_part = ddt_part.data();
  bo.dinit = dinit.data_ptr();
  bo.dinit_dtype = to_kda_dtype(dinit.scalar_type(), "dinitial_state");

  at::parallel_for(0, pb.N * pb.HV, 1, [&](int64_t begin, int64_t end) {
    HeadContext<TokT> c(p, x);
    BackwardScratch<Acc> w(p.K, p.V);
    for (int64_t i = begin; i < end; ++i) {
      c.bind(i / p.HV, static_cast<int>(i % p.HV));
      backward_head(c, bo, w);
    }
  });

  // GQA: dq/dk of the value heads of a group, summed in head order into their q/k head.
  const int64_t group = pb.HV / pb.H, K = pb.K;
  TokT* dqp = dq.data_ptr<TokT>();
  TokT* dkp = dk.data_ptr<TokT>();
  at::parallel_for(0, rows * pb.H, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const int64_t first = (r / pb.H * pb.HV + r % pb.H * group) * K;
      for (int64_t i = 0; i < K; ++i) {
        Acc sq = 0, sk = 0;
        for (int64_t j = 0; j < group; ++j) {
          sq += dq_hv[first + j * K + i];
          sk += dk_hv[first + j * K + i];
        }
        dqp[r * K + i] = static_cast<TokT>(sq);
        dkp[r * K + i] = static_cast<TokT>(sk);
      }
    }
  });

  // dA_log and ddt_bias: the per-(sequence, head) partials summed over sequences in order.
  std::vector<Acc> dA(pb.HV, Acc(0)), ddt(size_t(pb.HV * K), Acc(0));
  for (int64_t n = 0; n < pb.N; ++n)
    for (int64_t h = 0; h < pb.HV; ++h) {
      dA[h] += dA_part[n * pb.HV + h];
      for (int64_t i = 0; i < K; ++i) ddt[h * K + i] += ddt_part[(n * pb.HV + h) * K + i];
    }
  if (dA_log.numel() != 0)  // empty: no A_log (precomputed gate)
    store_vec(dA_log.data_ptr(), to_kda_dtype(dA_log.scalar_type(), "dA_log"), dA.data(), pb.HV);
  if (ddt_bias.numel() != 0)  // empty: no dt_bias
    store_vec(ddt_bias.data_ptr(), to_kda_dtype(ddt_bias.scalar_type(), "ddt_bias"), ddt.data(), pb.HV * K);
}

Grads training_backward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const std::optional<at::Tensor>& A_log_in,
                            const std::optional<at::Tensor>& dt_bias_in, const at::Tensor& tapes,
                            const at::Tensor& tape_cu_starts, const std::optional<at::Tensor>& initial_state,
                            const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& dout,
                            const std::optional<at::Tensor>& dfinal_state, double scale, double lower_bound,
                            int64_t gate_mode, bool use_qk_l2norm, bool beta_is_logit) {
  const TrainingModes m{gate_mode, use_qk_l2norm, beta_is_logit};
  const std::optional<at::Tensor> A_log = compact(A_log_in), dt_bias = compact(dt_bias_in);
  const TrainingProblem pb = check_training_inputs("recurrent_kda_training_backward", q, k, v, g, beta, A_log, dt_bias,
                                                   cu_seqlens, scale, lower_bound, m);
  note_cpu_route("training_backward", pb.N, pb.HV, pb.T, pb.B, pb.K);
  KDA_CHECK(dout.sizes() == v.sizes(), "do must have the shape of v ", v.sizes(), ", got ", dout.sizes());
  KDA_CHECK(dout.is_floating_point(), "do must be a floating tensor, got ", dout.scalar_type());
  const at::Tensor do_c = dout.to(q.scalar_type()).contiguous();
  KDA_CHECK(tapes.dim() == 4 && tapes.size(1) == pb.HV && tapes.size(2) == pb.V && tapes.size(3) == pb.K,
            "tapes must be [rows, HV, V, K] = [*, ", pb.HV, ", ", pb.V, ", ", pb.K, "], got ", tapes.sizes());
  KDA_CHECK_TYPE(tapes.scalar_type() == at::kFloat || tapes.scalar_type() == at::kDouble,
                 "tapes must be float32 or float64, got ", tapes.scalar_type());
  const at::Tensor tapes_c = tapes.contiguous();
  KDA_CHECK_TYPE(tape_cu_starts.scalar_type() == at::kLong, "tape_cu_starts must be int64, got ",
                 tape_cu_starts.scalar_type());
  KDA_CHECK(tape_cu_starts.dim() == 1 && tape_cu_starts.numel() == pb.N + 1, "tape_cu_starts must be [N+1] = [",
            pb.N + 1, "], got ", tape_cu_starts.sizes());
  const at::Tensor starts = tape_cu_starts.contiguous();
  {
    const int64_t* sp = starts.data_ptr<int64_t>();
    for (int64_t n = 0; n < pb.N; ++n) {
      const int64_t want = tape_rows_of(pb.len[n]);
      KDA_CHECK(sp[n] >= 0 && sp[n + 1] - sp[n] == want && sp[n + 1] <= tapes.size(0),
                "tape_cu_starts does not match the sequences and tapes: sequence ", n, " has ", pb.len[n], " tokens (",
                want, " tape rows), got rows [", sp[n], ", ", sp[n + 1], ") of ", tapes.size(0));
    }
  }
  std::optional<at::Tensor> dfinal;
  if (dfinal_state.has_value()) {
    check_state(*dfinal_state, pb, "dfinal_state");
    dfinal = dfinal_state->contiguous();
  }

  CpuExtras x;
  RecurrentParams p =
      training_params(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, do_c, tapes_c, starts, scale, lower_bound, m, x);
  p.out = nullptr;  // the backward writes no forward output
  at::Tensor init;
  if (initial_state.has_value()) {
    check_state(*initial_state, pb, "initial_state");
    init = initial_state->contiguous();
    x.init_state = init.data_ptr();
    x.init_dtype = to_kda_dtype(init.scalar_type(), "initial_state");
  }

  at::Tensor dq = at::zeros(q.sizes(), q.options());
  at::Tensor dk = at::zeros(k.sizes(), q.options());
  at::Tensor dv = at::zeros(v.sizes(), q.options());
  at::Tensor dg = at::zeros(g.sizes(), q.options());
  at::Tensor dbeta = at::zeros(beta.sizes(), q.options());
  // Parameter gradients shaped like their inputs; empty ([0]) for an absent parameter.
  const auto pdt = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto popt = A_log.has_value() ? A_log->options() : q.options().dtype(pdt);
  at::Tensor dA_log = A_log.has_value() ? at::zeros(A_log->sizes(), popt) : at::zeros({0}, popt);
  at::Tensor ddt_bias = dt_bias.has_value() ? at::zeros(dt_bias->sizes(), popt) : at::zeros({0}, popt);
  at::Tensor dinit = at::zeros({pb.N, pb.HV, pb.V, pb.K}, tapes.options());
  switch (p.token_dtype) {
    case DType::kBFloat16:
      run_backward_typed<c10::BFloat16>(p, x, pb, do_c, dfinal, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinit);
      break;
    case DType::kFloat32:
      run_backward_typed<float>(p, x, pb, do_c, dfinal, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinit);
      break;
    default:
      run_backward_typed<double>(p, x, pb, do_c, dfinal, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinit);
      break;
  }
  return {dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dinit};
}

Grads backward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                   const at::Tensor& beta, const std::optional<at::Tensor>& A_log,
                   const std::optional<at::Tensor>& dt_bias, const at::Tensor& initial_state,
                   const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& dout,
                   const std::optional<at::Tensor>& dfinal_state, double scale, double lower_bound, int64_t gate_mode,
                   bool use_qk_l2norm, bool beta_is_logit) {
  auto fwd = training_forward_cpu(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound,
                                  gate_mode, use_qk_l2norm, beta_is_logit);
  Grads gr = training_backward_cpu(q, k, v, g, beta, A_log, dt_bias, std::get<2>(fwd), std::get<3>(fwd), initial_state,
                                   cu_seqlens, dout, dfinal_state, scale, lower_bound, gate_mode, use_qk_l2norm,
                                   beta_is_logit);
  std::get<7>(gr) = std::get<7>(gr).to(initial_state.scalar_type());
  return gr;
}

}  // namespace

}  // namespace cpu
}  // namespace kda

TORCH_LIBRARY_IMPL(kda, CPU, m) {
  m.impl("recurrent_kda_training_forward", &kda::cpu::training_forward_cpu);
  m.impl("recurrent_kda_training_backward", &kda::cpu::training_backward_cpu);
  m.impl("recurrent_kda_backward", &kda::cpu::backward_cpu);
}
