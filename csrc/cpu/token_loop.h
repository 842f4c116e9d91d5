// The CPU token loop of docs/contract.md, Recurrence, for one (sequence, value head), shared by the inference op
// and the training forward (forward.cpp) and the chunk recompute of the training backward (backward_head.h).
// Included by csrc/cpu and the CPU op files csrc/api/*_cpu.cpp only: the CUDA translation units never see
// these templates. No tensors (c10's bf16/fp16 scalar types only).
//
// Arithmetic is in Acc = float (bf16/fp32 tokens) or double (fp64 tokens, for gradcheck); the state
// of one value head, [V, K] with K contiguous, lives in a local Acc buffer and is converted to its
// storage dtype only when written to memory (pool, checkpoint/tape row, final state).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kda/common/recurrent_rules.h"
#include "kda/params.h"

namespace kda {
namespace cpu {

template <typename TokT>
using acc_t = std::conditional_t<std::is_same<TokT, double>::value, double, float>;

inline int64_t dtype_bytes(DType dt) {
  switch (dt) {
    case DType::kFloat32:
      return 4;
    case DType::kFloat64:
      return 8;
    default:
      return 2;
  }
}

// Element `offset` of a runtime-typed buffer (the offset is in elements, 64-bit).
inline const void* elem_ptr(const void* base, DType dt, int64_t offset) {
  return static_cast<const char*>(base) + offset * dtype_bytes(dt);
}
inline void* elem_ptr(void* base, DType dt, int64_t offset) {
  return static_cast<char*>(base) + offset * dtype_bytes(dt);
}

template <typename Acc, typename Src>
inline void convert_in(Acc* dst, const Src* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Acc>(static_cast<float>(src[i]));
}
template <typename Acc>
inline void convert_in(Acc* dst, const double* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<Acc>(src[i]);
}

// n elements of a runtime-typed buffer -> Acc. The dtype switch sits outside the element loop.
template <typename Acc>
inline void load_vec(Acc* dst, const void* src, DType dt, int64_t n) {
  switch (dt) {
    case DType::kFloat32:
      convert_in(dst, static_cast<const float*>(src), n);
      break;
    case DType::kFloat64:
      convert_in(dst, static_cast<const double*>(src), n);
      break;
    case DType::kBFloat16:
      convert_in(dst, static_cast<const c10::BFloat16*>(src), n);
      break;
    case DType::kFloat16:
      convert_in(dst, static_cast<const c10::Half*>(src), n);
      break;
  }
}

// Acc -> n elements of a runtime-typed buffer (bf16/fp16: round to nearest even, once).
template <typename Acc>
inline void store_vec(void* dst, DType dt, const Acc* src, int64_t n) {
  switch (dt) {
    case DType::kFloat32: {
      auto* d = static_cast<float*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<float>(src[i]);
      break;
    }
    case DType::kFloat64: {
      auto* d = static_cast<double*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = static_cast<double>(src[i]);
      break;
    }
    case DType::kBFloat16: {
      auto* d = static_cast<c10::BFloat16*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = c10::BFloat16(static_cast<float>(src[i]));
      break;
    }
    case DType::kFloat16: {
      auto* d = static_cast<c10::Half*>(dst);
      for (int64_t i = 0; i < n; ++i) d[i] = c10::Half(static_cast<float>(src[i]));
      break;
    }
  }
}

// Dot product with eight independent partial sums: the compiler can vectorise it without
// -ffast-math, and the summation order is fixed (bit-deterministic results).
template <typename Acc>
inline Acc dot(const Acc* a, const Acc* b, int n) {
  Acc s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  for (; i < n; ++i) s[i & 7] += a[i] * b[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// What the loop needs beyond RecurrentParams: fp64-exact scalars and gate parameters (gradcheck
// runs in fp64; RecurrentParams keeps them in fp32 for the kernels), and the per-sequence start and
// end states of the training ops (RecurrentParams only knows the inference pool).
struct CpuExtras {
  double scale = 0.0;
  double lower_bound = 0.0;
  const void* A_log = nullptr;  // [HV]; null when the gate is precomputed
  DType A_log_dtype = DType::kFloat32;
  const void* dt_bias = nullptr;  // [HV, K] compact; null = 0
  DType dt_bias_dtype = DType::kFloat32;
  // Training: sequence n starts from init_state[n] (the pool rules are not used then).
  const void* init_state = nullptr;  // [N, HV, V, K] compact
  DType init_dtype = DType::kFloat32;
  // End state of every active sequence.
  void* final_state = nullptr;  // [N, HV, V, K] compact
  DType final_dtype = DType::kFloat32;
  // Speculative verify (disable_state_update): write no pool slot of p.state (the rules that decide which
  // sequences and tokens are active still read the slots).
  bool no_state_update = false;
};

// One value head of one sequence: its parameters, and the inputs of the current token in Acc.
template <typename TokT>
struct HeadContext {
  using Acc = acc_t<TokT>;
  const RecurrentParams& p;
  const CpuExtras& x;
  const int K, V;

  int64_t n = 0;
  int hv = 0, h = 0;  // value head and its q/k head (GQA: contiguous groups)
  SeqRange seq{0, 0, 0};
  Acc A = 0;             // exp(A_log[hv])
  std::vector<Acc> dtb;  // [K] dt_bias[hv] (0 when absent)

  // Current token (load()).
  std::vector<Acc> q_raw, k_raw;  // [K] as stored
  std::vector<Acc> q;             // [K] normalised (when L2 is on) and scaled
  std::vector<Acc> k;             // [K] normalised (when L2 is on)
  std::vector<Acc> v;             // [V]
  std::vector<Acc> g_raw, a, d;   // [K] gate input, log-decay, decay exp(a)
  Acc q_rho = 1, k_rho = 1;       // rsqrt(|x|^2 + eps) (1 when L2 is off)
  Acc beta_raw = 0, beta = 0;

  HeadContext(const RecurrentParams& p_, const CpuExtras& x_)
      : p(p_), x(x_), K(p_.K), V(p_.V), dtb(K), q_raw(K), k_raw(K), q(K), k(K), v(V), g_raw(K), a(K), d(K) {}

  void bind(int64_t n_, int hv_) {
    n = n_;
    hv = hv_;
    h = hv / (p.HV / p.H);
    seq = seq_range(p, n);
    if (x.A_log != nullptr) {
      Acc al = 0;
      load_vec(&al, elem_ptr(x.A_log, x.A_log_dtype, hv), x.A_log_dtype, 1);
      A = std::exp(al);
    }
    if (x.dt_bias != nullptr)
      load_vec(dtb.data(), elem_ptr(x.dt_bias, x.dt_bias_dtype, int64_t(hv) * K), x.dt_bias_dtype, K);
    else
      std::fill(dtb.begin(), dtb.end(), Acc(0));
  }

  // Token index along T of token t of the bound sequence.
  int64_t token(int64_t t) const { return seq.bos + t; }

  const TokT* token_ptr(const TokenTensor& tt, int head, int64_t t) const {
    return tt.row<TokT>(seq.batch, token(t), head);
  }

  TokT* out_ptr(int64_t t) const {
    return static_cast<TokT*>(p.out) + seq.batch * p.out_batch_stride + token(t) * p.out_token_stride +
           hv * p.out_head_stride;
  }

  // Recurrence steps 1-3 for token t of the bound sequence.
  void load(int64_t t) {
    convert_in(q_raw.data(), token_ptr(p.q, h, t), K);
    convert_in(k_raw.data(), token_ptr(p.k, h, t), K);
    convert_in(v.data(), token_ptr(p.v, hv, t), V);
    convert_in(g_raw.data(), token_ptr(p.g, hv, t), K);
    convert_in(&beta_raw, token_ptr(p.beta, hv, t), 1);
    if (p.use_qk_l2norm) {
      q_rho = Acc(1) / std::sqrt(dot(q_raw.data(), q_raw.data(), K) + Acc(1e-6));
      k_rho = Acc(1) / std::sqrt(dot(k_raw.data(), k_raw.data(), K) + Acc(1e-6));
    } else {
      q_rho = k_rho = Acc(1);
    }
    const Acc scale = static_cast<Acc>(x.scale);
    for (int i = 0; i < K; ++i) {
      q[i] = q_raw[i] * q_rho * scale;
      k[i] = k_raw[i] * k_rho;
    }
    const Acc lb = static_cast<Acc>(x.lower_bound);
    for (int i = 0; i < K; ++i) {
      a[i] = gate_log_decay<Acc>(p.gate_mode, g_raw[i], A, dtb[i], lb);
      d[i] = std::exp(a[i]);
    }
    beta = p.beta_is_logit ? kda_sigmoid<Acc>(beta_raw) : beta_raw;
  }

  // Recurrence steps 4-7 on the state S [V, K], one fused pass per row v; o [V] gets S_new q.
  void step(Acc* S, Acc* o) const {
    for (int vi = 0; vi < V; ++vi) {
      Acc* row = S + int64_t(vi) * K;
      for (int i = 0; i < K; ++i) row[i] *= d[i];
      const Acc pv = dot(row, k.data(), K);
      const Acc r = beta * (v[vi] - pv);
      for (int i = 0; i < K; ++i) row[i] += r * k[i];
      o[vi] = dot(row, q.data(), K);
    }
  }
};

// Runs the whole bound sequence for the bound value head with every rule of docs/contract.md, API and Slots (start
// state, token activity, pool/spec writes, checkpoints or tapes, final state). S: [V*K] scratch, o: [V]. Inactive
// tokens and sequences get zero output; tokens outside every sequence are never touched.
template <typename TokT>
void run_sequence_head(HeadContext<TokT>& c, acc_t<TokT>* S, acc_t<TokT>* o) {
  using Acc = acc_t<TokT>;
  const RecurrentParams& p = c.p;
  const CpuExtras& x = c.x;
  const int64_t n = c.n;
  const int64_t blk = int64_t(p.V) * p.K;  // one head's state
  const int64_t head_off = int64_t(c.hv) * blk;
  const int64_t seq_off = (n * p.HV) * blk + head_off;  // in [N, HV, V, K] buffers

  const StartState st = start_state(p, n);
  auto zero_output = [&](int64_t t) {
    TokT* out = c.out_ptr(t);
    for (int vi = 0; vi < p.V; ++vi) out[vi] = TokT(0);
  };
  if (st.kind < 0) {  // inactive: no state read or write, zero output
    for (int64_t t = 0; t < c.seq.len; ++t) zero_output(t);
    return;
  }
  if (x.init_state != nullptr) {
    load_vec(S, elem_ptr(x.init_state, x.init_dtype, seq_off), x.init_dtype, blk);
  } else if (st.kind == 0) {
    std::fill(S, S + blk, Acc(0));
  } else if (st.kind == 1) {
    load_vec(S, elem_ptr(p.state, p.state_dtype, st.slot * p.state_slot_stride + head_off), p.state_dtype, blk);
  } else {
    load_vec(S, elem_ptr(p.state_source, p.state_source_dtype, st.slot * p.source_slot_stride + head_off),
             p.state_source_dtype, blk);
  }

  const bool spec = p.num_spec_tokens > 0;
  const int every = p.checkpoint_every_n_tokens;
  const int64_t len = c.seq.len;
  for (int64_t t = 0; t < len; ++t) {
    if (every > 0 && t % every == 0 && t / every >= p.checkpoint_first) {
      const int64_t row = p.checkpoint_cu_starts[n] + t / every - p.checkpoint_first;
      if (row >= 0 && row < p.n_checkpoint_rows)
        store_vec(elem_ptr(p.state_checkpoints, p.checkpoint_dtype, row * p.HV * blk + head_off), p.checkpoint_dtype, S,
                  blk);
    }
    if (!token_active(p, n, t)) {
      zero_output(t);
      continue;
    }
    c.load(t);
    c.step(S, o);
    TokT* out = c.out_ptr(t);
    for (int vi = 0; vi < p.V; ++vi) out[vi] = static_cast<TokT>(o[vi]);
    if (spec && !x.no_state_update) {
      const int64_t slot = write_slot(p, n, t);  // in the pool: the token is active
      store_vec(elem_ptr(p.state, p.state_dtype, slot * p.state_slot_stride + head_off), p.state_dtype, S, blk);
    }
  }
  if (!spec && p.state != nullptr && len > 0 && !x.no_state_update) {
    const int64_t slot = write_slot(p, n, 0);
    if (slot_in_pool(slot, p.n_pool))
      store_vec(elem_ptr(p.state, p.state_dtype, slot * p.state_slot_stride + head_off), p.state_dtype, S, blk);
  }
  if (x.final_state != nullptr) store_vec(elem_ptr(x.final_state, x.final_dtype, seq_off), x.final_dtype, S, blk);
}

// All (sequence, value head) pairs in parallel (defined in recurrent.cpp, used by training.cpp).
void run_forward(const RecurrentParams& p, const CpuExtras& x);

}  // namespace cpu
}  // namespace kda
