// The training ops on CPU (SPEC §2.1, §3.2, §3.3): kda::recurrent_kda_training_forward,
// kda::recurrent_kda_training_backward and kda::recurrent_kda_backward.
//
// Forward: the inference token loop (token_loop.h) with per-sequence initial states, a final state per
// sequence and the tapes written as checkpoints every kTapeChunk tokens.
// Backward: per (sequence, value head), chunks last to first: the chunk's per-token states are
// recomputed from its tape row with the same token step as the forward (so they are bit-identical to
// the forward's), then the reverse sweep of SPEC §2.1 runs over the chunk carrying G = dL/dS.
// Reductions across value heads (GQA dq/dk) and across sequences (dA_log, ddt_bias) go through
// per-(sequence, head) partial buffers summed in a fixed order: results are bit-identical whatever
// the thread count.
#include <ATen/Parallel.h>

#include <tuple>

#include "api/recurrent_params.h"
#include "cpu/token_loop.h"

namespace kda {
namespace cpu {

namespace {

using Grads = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                         at::Tensor>;

bool is_float_or_double(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Shapes, dtypes and host-side values shared by the three ops; everything is checked before any
// output is allocated or written.
struct TrainingProblem {
  int64_t B, T, N;
  int64_t H, HV, K, V;
  std::vector<int64_t> bos, len;  // per sequence
};

TrainingProblem check_training_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& g, const at::Tensor& beta, const at::Tensor& A_log,
                                      const at::Tensor& dt_bias, const std::optional<at::Tensor>& cu_seqlens,
                                      double scale, double lower_bound) {
  KDA_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && g.dim() == 4 && beta.dim() == 3,
            "q, k, v, g must be rank 4 and beta rank 3, got ", q.dim(), ", ", k.dim(), ", ", v.dim(), ", ",
            g.dim(), ", ", beta.dim());
  const auto qt = q.scalar_type();
  KDA_CHECK_TYPE(qt == at::kBFloat16 || qt == at::kFloat || qt == at::kDouble,
                 "q must be bfloat16, float32 or float64 on CPU, got ", qt);
  KDA_CHECK(std::isfinite(scale) && scale > 0, "scale must be a finite number > 0, got ", scale);
  KDA_CHECK(std::isfinite(lower_bound) && lower_bound < 0, "lower_bound must be a finite number < 0, got ",
            lower_bound);
  TrainingProblem pb;
  pb.B = q.size(0);
  pb.T = q.size(1);
  pb.H = q.size(2);
  pb.K = q.size(3);
  pb.HV = v.size(2);
  pb.V = v.size(3);
  KDA_CHECK(pb.H > 0 && pb.HV % pb.H == 0, "HV % H must be 0, got HV=", pb.HV, ", H=", pb.H);
  KDA_CHECK(is_float_or_double(A_log) && A_log.is_contiguous() && A_log.numel() == pb.HV,
            "A_log must be a contiguous float32/float64 [HV]=[", pb.HV, "], got ", A_log.scalar_type(), " ",
            A_log.sizes());
  KDA_CHECK(is_float_or_double(dt_bias) && dt_bias.is_contiguous() && dt_bias.numel() == pb.HV * pb.K,
            "dt_bias must be a contiguous float32/float64 [HV, K]=[", pb.HV, ", ", pb.K, "], got ",
            dt_bias.scalar_type(), " ", dt_bias.sizes());
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    KDA_CHECK(pb.B == 1, "cu_seqlens needs B == 1, got B=", pb.B);
    KDA_CHECK_TYPE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong,
                   "cu_seqlens must be int32 or int64, got ", cu.scalar_type());
    KDA_CHECK(cu.dim() == 1 && cu.numel() >= 2, "cu_seqlens must be [N+1] with N >= 1, got ", cu.sizes());
    const at::Tensor c = cu.to(at::kLong).contiguous();
    const int64_t* cp = c.data_ptr<int64_t>();
    pb.N = cu.numel() - 1;
    KDA_CHECK(cp[0] == 0, "cu_seqlens[0] must be 0, got ", cp[0]);
    for (int64_t n = 0; n < pb.N; ++n) {
      KDA_CHECK(cp[n] <= cp[n + 1] && cp[n + 1] <= pb.T, "cu_seqlens must be non-decreasing within [0, T=", pb.T,
                "], got cu_seqlens[", n, ":", n + 2, "] = ", cp[n], ", ", cp[n + 1]);
      pb.bos.push_back(cp[n]);
      pb.len.push_back(cp[n + 1] - cp[n]);
    }
  } else {
    pb.N = pb.B;
    pb.bos.assign(pb.N, 0);
    pb.len.assign(pb.N, pb.T);
  }
  return pb;
}

// Tape rows: the state before every 64-token chunk but the first (the initial state, an input of the backward):
// max(ceil(L_i/64) - 1, 0) per sequence. Fixed layout B * (ceil(T/64) - 1); packed T//64 (an upper bound on the
// sum, from shapes, as the fake kernel computes it). Unused rows stay zero.
int64_t tape_rows_of(int64_t len) { return std::max<int64_t>(ceil_div(len, kTapeChunk) - 1, 0); }

int64_t tape_rows(const TrainingProblem& pb, bool packed) {
  return packed ? pb.T / kTapeChunk : pb.B * tape_rows_of(pb.T);
}

at::Tensor tape_starts(const TrainingProblem& pb) {
  at::Tensor s = at::empty({pb.N + 1}, at::kLong);
  int64_t* sp = s.data_ptr<int64_t>();
  sp[0] = 0;
  for (int64_t n = 0; n < pb.N; ++n) sp[n + 1] = sp[n] + tape_rows_of(pb.len[n]);
  return s;
}

void check_state(const at::Tensor& s, const TrainingProblem& pb, const char* name) {
  KDA_CHECK(s.dim() == 4 && s.size(0) == pb.N && s.size(1) == pb.HV && s.size(2) == pb.V && s.size(3) == pb.K,
            name, " must be [N, HV, V, K] = [", pb.N, ", ", pb.HV, ", ", pb.V, ", ", pb.K, "], got ", s.sizes());
  const auto t = s.scalar_type();
  KDA_CHECK_TYPE(t == at::kFloat || t == at::kBFloat16 || t == at::kDouble, name,
                 " must be float32, bfloat16 or float64, got ", t);
}

// RecurrentParams for the training contract (L2 norm, lower-bound gate, logit beta). The gate
// parameters go through CpuExtras (fp32 or fp64), so make_recurrent_params sees a precomputed gate.
// `output` gives the output layout (the backward passes `do` for the shape check and clears p.out).
RecurrentParams training_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                                const at::Tensor& beta, const at::Tensor& A_log, const at::Tensor& dt_bias,
                                const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& output,
                                const at::Tensor& tapes, const at::Tensor& starts, double scale,
                                double lower_bound, CpuExtras& x) {
  const std::optional<at::Tensor> none;
  const std::optional<at::Tensor> tapes_opt(tapes), starts_opt(starts);
  const RecurrentArgs args{q, k, v, g, beta, none, none, none, none, none, cu_seqlens, none, none, none, output,
                           none, tapes_opt, starts_opt, scale, /*gate_mode=*/0, lower_bound,
                           /*use_qk_l2norm=*/true, /*beta_is_logit=*/true, /*num_spec_tokens=*/0,
                           /*checkpoint_every_n_tokens=*/kTapeChunk};
  RecurrentParams p = make_recurrent_params(args);
  p.gate_mode = GateMode::kLowerBound;
  p.lower_bound = static_cast<float>(lower_bound);
  x.scale = scale;
  x.lower_bound = lower_bound;
  x.A_log = A_log.data_ptr();
  x.A_log_dtype = to_kda_dtype(A_log.scalar_type(), "A_log");
  x.dt_bias = dt_bias.data_ptr();
  x.dt_bias_dtype = to_kda_dtype(dt_bias.scalar_type(), "dt_bias");
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> training_forward_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
    const at::Tensor& A_log_in, const at::Tensor& dt_bias_in, const at::Tensor& initial_state,
    const std::optional<at::Tensor>& cu_seqlens, double scale, double lower_bound) {
  // Strided parameter views are accepted (as on CUDA): the loop reads compact copies.
  const at::Tensor A_log = A_log_in.contiguous(), dt_bias = dt_bias_in.contiguous();
  const TrainingProblem pb = check_training_inputs(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound);
  check_state(initial_state, pb, "initial_state");
  const at::Tensor init = initial_state.contiguous();
  const auto tape_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor tapes = at::zeros({tape_rows(pb, cu_seqlens.has_value()), pb.HV, pb.V, pb.K}, q.options().dtype(tape_dtype));
  at::Tensor starts = tape_starts(pb);
  at::Tensor out = at::zeros(v.sizes(), v.options());
  at::Tensor final_state = at::empty({pb.N, pb.HV, pb.V, pb.K}, init.options());

  CpuExtras x;
  RecurrentParams p =
      training_params(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, out, tapes, starts, scale, lower_bound, x);
  p.checkpoint_first = 1;  // no tape row for the state before token 0
  x.init_state = init.data_ptr();
  x.init_dtype = to_kda_dtype(init.scalar_type(), "initial_state");
  x.final_state = final_state.data_ptr();
  x.final_dtype = x.init_dtype;
  run_forward(p, x);
  return {out, final_state, tapes, starts};
}

// Where the backward of one (sequence, value head) writes.
template <typename TokT>
struct BackwardOut {
  using Acc = acc_t<TokT>;
  const TokT* dout;  // do, contiguous [B, T, HV, V]
  const void* dfinal = nullptr;  // [N, HV, V, K] compact, or null (zeros)
  DType dfinal_dtype = DType::kFloat32;
  Acc* dq_hv;   // [B, T, HV, K]: dq per VALUE head (summed into q/k heads afterwards)
  Acc* dk_hv;   // [B, T, HV, K]
  TokT* dv;     // [B, T, HV, V]
  TokT* dg;     // [B, T, HV, K]
  TokT* dbeta;  // [B, T, HV]
  Acc* dA_part;   // [N, HV]: per (sequence, head) partial of dA_log
  Acc* ddt_part;  // [N, HV, K]
  void* dinit;    // [N, HV, V, K] compact
  DType dinit_dtype;
};

// Per-thread scratch of the backward.
template <typename Acc>
struct BackwardScratch {
  std::vector<Acc> states;  // [kTapeChunk + 1, V, K]: states[i] = state before token i of the chunk
  std::vector<Acc> G;       // [V, K]: dL/dS after the current token
  std::vector<Acc> o, dO, dv;           // [V]
  std::vector<Acc> sbar, dqn, dkn, da;  // [K]
  BackwardScratch(int K, int V)
      : states(size_t(kTapeChunk + 1) * V * K), G(size_t(V) * K), o(V), dO(V), dv(V), sbar(K), dqn(K), dkn(K),
        da(K) {}
};

// Reverse sweep of SPEC §2.1 for token t of the bound sequence: Sp = S_{t-1}, St = S_t, G = dL/dS_t
// on entry and dL/dS_{t-1} on exit. `c` holds token t's loaded inputs.
template <typename TokT>
void reverse_token(const HeadContext<TokT>& c, const acc_t<TokT>* Sp, const acc_t<TokT>* St, int64_t t,
                   const BackwardOut<TokT>& bo, BackwardScratch<acc_t<TokT>>& w) {
  using Acc = acc_t<TokT>;
  const RecurrentParams& p = c.p;
  const int K = c.K, V = c.V;
  const int64_t tok_row = c.seq.batch * p.T + c.token(t);  // row of [B*T]
  const int64_t hv_row = tok_row * p.HV + c.hv;               // row of [B*T*HV]
  convert_in(w.dO.data(), bo.dout + hv_row * V, V);
  std::fill(w.dqn.begin(), w.dqn.end(), Acc(0));
  std::fill(w.dkn.begin(), w.dkn.end(), Acc(0));
  std::fill(w.da.begin(), w.da.end(), Acc(0));
  Acc dbeta = 0;
  const Acc* q = c.q.data();
  const Acc* kk = c.k.data();
  const Acc* d = c.d.data();
  Acc* sbar = w.sbar.data();
  for (int vi = 0; vi < V; ++vi) {
    Acc* Gr = w.G.data() + int64_t(vi) * K;
    const Acc* Spr = Sp + int64_t(vi) * K;
    const Acc* Str = St + int64_t(vi) * K;
    const Acc dov = w.dO[vi];
    for (int i = 0; i < K; ++i) {
      Gr[i] += dov * q[i];           // G += dO q^T
      w.dqn[i] += Str[i] * dov;      // S_t^T dO
      sbar[i] = Spr[i] * d[i];       // decayed state, as in the forward step
    }
    const Acc pv = dot(sbar, kk, K);
    const Acc diff = c.v[vi] - pv;
    const Acc r = c.beta * diff;
    const Acc u = dot(Gr, kk, K);
    w.dv[vi] = c.beta * u;
    dbeta += u * diff;
    const Acc dp = -c.beta * u;
    for (int i = 0; i < K; ++i) {
      w.dkn[i] += Gr[i] * r + sbar[i] * dp;  // G^T r + Sbar^T dp
      const Acc dsb = Gr[i] + dp * kk[i];    // dSbar = G + dp k^T
      w.da[i] += sbar[i] * dsb;              // d * sum_v S_{t-1} dSbar
      Gr[i] = dsb * d[i];                    // dL/dS_{t-1}
    }
  }

  // Chain rules back to the raw inputs.
  const Acc scale = static_cast<Acc>(c.x.scale);
  for (int i = 0; i < K; ++i) w.dqn[i] *= scale;
  Acc* dq = bo.dq_hv + hv_row * K;
  Acc* dk = bo.dk_hv + hv_row * K;
  if (p.use_qk_l2norm) {
    // x = x~ rho: dx~ = rho dx - rho^3 (x~ . dx) x~
    const Acc qd = dot(c.q_raw.data(), w.dqn.data(), K);
    const Acc kd = dot(c.k_raw.data(), w.dkn.data(), K);
    const Acc rq3 = c.q_rho * c.q_rho * c.q_rho, rk3 = c.k_rho * c.k_rho * c.k_rho;
    for (int i = 0; i < K; ++i) {
      dq[i] = c.q_rho * w.dqn[i] - rq3 * qd * c.q_raw[i];
      dk[i] = c.k_rho * w.dkn[i] - rk3 * kd * c.k_raw[i];
    }
  } else {
    for (int i = 0; i < K; ++i) {
      dq[i] = w.dqn[i];
      dk[i] = w.dkn[i];
    }
  }
  TokT* dv = bo.dv + hv_row * V;
  for (int vi = 0; vi < V; ++vi) dv[vi] = static_cast<TokT>(w.dv[vi]);
  bo.dbeta[hv_row] = static_cast<TokT>(p.beta_is_logit ? dbeta * c.beta * (Acc(1) - c.beta) : dbeta);

  TokT* dg = bo.dg + hv_row * K;
  Acc* ddt = bo.ddt_part + (c.n * p.HV + c.hv) * K;
  Acc dA = 0;
  const Acc lb = static_cast<Acc>(c.x.lower_bound);
  for (int i = 0; i < K; ++i) {
    const Acc xg = c.g_raw[i] + c.dtb[i];
    Acc dgi;
    if (p.gate_mode == GateMode::kLowerBound) {
      // a = lb * sigmoid(z), z = A (g + dt_bias)
      const Acc z = c.A * xg;
      const Acc s = kda_sigmoid<Acc>(z);
      const Acc dz = lb * w.da[i] * s * (Acc(1) - s);
      dgi = c.A * dz;
      dA += dz * z;
    } else if (p.gate_mode == GateMode::kSoftplus) {
      // a = -A softplus(g + dt_bias)
      dgi = -c.A * kda_sigmoid<Acc>(xg) * w.da[i];
      dA += w.da[i] * c.a[i];
    } else {
      dgi = w.da[i];
    }
    dg[i] = static_cast<TokT>(dgi);
    if (p.gate_mode != GateMode::kPrecomputed) ddt[i] += dgi;
  }
  bo.dA_part[c.n * p.HV + c.hv] += dA;
}

template <typename TokT>
void backward_head(HeadContext<TokT>& c, const BackwardOut<TokT>& bo, BackwardScratch<acc_t<TokT>>& w) {
  using Acc = acc_t<TokT>;
  const RecurrentParams& p = c.p;
  const int64_t blk = int64_t(p.V) * p.K;
  const int64_t head_off = int64_t(c.hv) * blk;
  const int64_t seq_off = c.n * p.HV * blk + head_off;
  if (bo.dfinal != nullptr)
    load_vec(w.G.data(), elem_ptr(bo.dfinal, bo.dfinal_dtype, seq_off), bo.dfinal_dtype, blk);
  else
    std::fill(w.G.begin(), w.G.end(), Acc(0));

  const int64_t len = c.seq.len;
  for (int64_t ch = ceil_div(len, kTapeChunk) - 1; ch >= 0; --ch) {
    const int64_t t0 = ch * kTapeChunk;
    const int64_t cl = std::min<int64_t>(kTapeChunk, len - t0);
    Acc* states = w.states.data();
    if (ch > 0) {  // tape row (checked against the tape size up front)
      const int64_t row = p.checkpoint_cu_starts[c.n] + ch - 1;
      load_vec(states, elem_ptr(p.state_checkpoints, p.checkpoint_dtype, row * p.HV * blk + head_off),
               p.checkpoint_dtype, blk);
    } else if (c.x.init_state != nullptr) {  // the state before token 0
      load_vec(states, elem_ptr(c.x.init_state, c.x.init_dtype, seq_off), c.x.init_dtype, blk);
    } else {
      std::fill(states, states + blk, Acc(0));
    }
    for (int64_t i = 0; i < cl; ++i) {
      std::copy(states + i * blk, states + (i + 1) * blk, states + (i + 1) * blk);
      c.load(t0 + i);
      c.step(states + (i + 1) * blk, w.o.data());
    }
    for (int64_t i = cl - 1; i >= 0; --i) {
      c.load(t0 + i);
      reverse_token(c, states + i * blk, states + (i + 1) * blk, t0 + i, bo, w);
    }
  }
  store_vec(elem_ptr(bo.dinit, bo.dinit_dtype, seq_off), bo.dinit_dtype, w.G.data(), blk);
}

template <typename TokT>
void run_backward_typed(const RecurrentParams& p, const CpuExtras& x, const TrainingProblem& pb,
                        const at::Tensor& dout, const std::optional<at::Tensor>& dfinal, at::Tensor& dq,
                        at::Tensor& dk, at::Tensor& dv, at::Tensor& dg, at::Tensor& dbeta, at::Tensor& dA_log,
                        at::Tensor& ddt_bias, at::Tensor& dinit) {
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
  store_vec(dA_log.data_ptr(), to_kda_dtype(dA_log.scalar_type(), "dA_log"), dA.data(), pb.HV);
  store_vec(ddt_bias.data_ptr(), to_kda_dtype(ddt_bias.scalar_type(), "ddt_bias"), ddt.data(), pb.HV * K);
}

Grads training_backward_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                            const at::Tensor& beta, const at::Tensor& A_log_in, const at::Tensor& dt_bias_in,
                            const at::Tensor& tapes, const at::Tensor& tape_cu_starts,
                            const std::optional<at::Tensor>& initial_state,
                            const std::optional<at::Tensor>& cu_seqlens, const at::Tensor& dout,
                            const std::optional<at::Tensor>& dfinal_state, double scale, double lower_bound) {
  const at::Tensor A_log = A_log_in.contiguous(), dt_bias = dt_bias_in.contiguous();
  const TrainingProblem pb = check_training_inputs(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound);
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
  KDA_CHECK(tape_cu_starts.dim() == 1 && tape_cu_starts.numel() == pb.N + 1,
            "tape_cu_starts must be [N+1] = [", pb.N + 1, "], got ", tape_cu_starts.sizes());
  const at::Tensor starts = tape_cu_starts.contiguous();
  {
    const int64_t* sp = starts.data_ptr<int64_t>();
    for (int64_t n = 0; n < pb.N; ++n) {
      const int64_t want = tape_rows_of(pb.len[n]);
      KDA_CHECK(sp[n] >= 0 && sp[n + 1] - sp[n] == want && sp[n + 1] <= tapes.size(0),
                "tape_cu_starts does not match the sequences and tapes: sequence ", n, " has ", pb.len[n],
                " tokens (", want, " tape rows), got rows [", sp[n], ", ", sp[n + 1], ") of ", tapes.size(0));
    }
  }
  std::optional<at::Tensor> dfinal;
  if (dfinal_state.has_value()) {
    check_state(*dfinal_state, pb, "dfinal_state");
    dfinal = dfinal_state->contiguous();
  }

  CpuExtras x;
  RecurrentParams p = training_params(q, k, v, g, beta, A_log, dt_bias, cu_seqlens, do_c, tapes_c, starts, scale,
                                      lower_bound, x);
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
  at::Tensor dA_log = at::zeros(A_log.sizes(), A_log.options());
  at::Tensor ddt_bias = at::zeros(dt_bias.sizes(), A_log.options());
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
                   const at::Tensor& beta, const at::Tensor& A_log, const at::Tensor& dt_bias,
                   const at::Tensor& initial_state, const std::optional<at::Tensor>& cu_seqlens,
                   const at::Tensor& dout, const std::optional<at::Tensor>& dfinal_state, double scale,
                   double lower_bound) {
  auto fwd = training_forward_cpu(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound);
  Grads gr = training_backward_cpu(q, k, v, g, beta, A_log, dt_bias, std::get<2>(fwd), std::get<3>(fwd),
                                   initial_state, cu_seqlens, dout, dfinal_state, scale, lower_bound);
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
