// The CPU training backward of one (sequence, value head): chunks last to first, the chunk's per-token
// states recomputed from its tape row with the forward's token step (token_loop.h: bit-identical to the
// forward's), then the reverse sweep (docs/contract.md, Recurrence, the backward) over the chunk carrying
// G = dL/dS. Used by csrc/api/training_cpu.cpp, which allocates the outputs and runs the (sequence, head)
// pairs in parallel. No tensors here.
#pragma once
#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu/token_loop.h"
#include "kda/params.h"
#include "kda/tape_rows.h"

namespace kda {
namespace cpu {

inline int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

// Where the backward of one (sequence, value head) writes.
template <typename TokT>
struct BackwardOut {
  using Acc = acc_t<TokT>;
  const TokT* dout;              // do, contiguous [B, T, HV, V]
  const void* dfinal = nullptr;  // [N, HV, V, K] compact, or null (zeros)
  DType dfinal_dtype = DType::kFloat32;
  Acc* dq_hv;     // [B, T, HV, K]: dq per VALUE head (summed into q/k heads afterwards)
  Acc* dk_hv;     // [B, T, HV, K]
  TokT* dv;       // [B, T, HV, V]
  TokT* dg;       // [B, T, HV, K]
  TokT* dbeta;    // [B, T, HV]
  Acc* dA_part;   // [N, HV]: per (sequence, head) partial of dA_log
  Acc* ddt_part;  // [N, HV, K]
  void* dinit;    // [N, HV, V, K] compact
  DType dinit_dtype;
};

// Per-thread scratch of the backward.
template <typename Acc>
struct BackwardScratch {
  std::vector<Acc> states;              // [kTapeChunk + 1, V, K]: states[i] = state before token i of the chunk
  std::vector<Acc> G;                   // [V, K]: dL/dS after the current token
  std::vector<Acc> o, dO, dv;           // [V]
  std::vector<Acc> sbar, dqn, dkn, da;  // [K]
  BackwardScratch(int K, int V)
      : states(size_t(kTapeChunk + 1) * V * K), G(size_t(V) * K), o(V), dO(V), dv(V), sbar(K), dqn(K), dkn(K), da(K) {}
};

// Reverse sweep (docs/contract.md, Recurrence, the backward) for token t of the bound sequence: Sp = S_{t-1}, St = S_t,
// G = dL/dS_t on entry and dL/dS_{t-1} on exit. `c` holds token t's loaded inputs.
template <typename TokT>
void reverse_token(const HeadContext<TokT>& c, const acc_t<TokT>* Sp, const acc_t<TokT>* St, int64_t t,
                   const BackwardOut<TokT>& bo, BackwardScratch<acc_t<TokT>>& w) {
  using Acc = acc_t<TokT>;
  const RecurrentParams& p = c.p;
  const int K = c.K, V = c.V;
  const int64_t tok_row = c.seq.batch * p.T + c.token(t);  // row of [B*T]
  const int64_t hv_row = tok_row * p.HV + c.hv;            // row of [B*T*HV]
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
      Gr[i] += dov * q[i];       // G += dO q^T
      w.dqn[i] += Str[i] * dov;  // S_t^T dO
      sbar[i] = Spr[i] * d[i];   // decayed state, as in the forward step
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
      const int64_t row = tape_row(p.checkpoint_cu_starts, c.n, ch);
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

}  // namespace cpu
}  // namespace kda
