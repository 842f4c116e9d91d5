// The input check of the three training ops (recurrent_kda_training_forward, recurrent_kda_training_backward,
// recurrent_kda_backward), shared by the CPU and CUDA implementations (training_cpu.cpp, training_cuda.cpp):
// ranks, shapes, head and channel counts, the gate parameters' sizes, scale, lower_bound and cu_seqlens'
// form, and the mode arguments (gate_mode 0 precomputed / 1 softplus / 2 lower bound: A_log absent exactly for
// the precomputed gate, dt_bias optional with a gate; lower_bound checked for the lower-bound gate only). What
// only one backend needs (dtypes, devices, K == V == 128 and lower_bound >= -5 on CUDA, the host
// read of the cu_seqlens values on CPU) its file checks after this. The Python layer (kda_ops/_validate.py)
// validates every public call first; this guards direct torch.ops.kda calls ("<op>: <arg> must be ...").
#pragma once
#include <cmath>
#include <cstdint>
#include <optional>

#include "api/checks.h"

namespace kda {

struct TrainingShape {
  int64_t B = 0, T = 0, N = 0;  // N = B (fixed layout) or len(cu_seqlens) - 1 (packed, B = 1)
  int64_t H = 0, HV = 0, K = 0, V = 0;
  bool packed = false;
};

inline TrainingShape check_training_shapes(const char* op, const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                                           const std::optional<at::Tensor>& A_log,
                                           const std::optional<at::Tensor>& dt_bias,
                                           const std::optional<at::Tensor>& cu_seqlens, double scale,
                                           double lower_bound, int64_t gate_mode) {
  KDA_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && g.dim() == 4 && beta.dim() == 3, op,
            ": q, k, v, g must be rank 4 and beta rank 3, got ", q.dim(), ", ", k.dim(), ", ", v.dim(), ", ", g.dim(),
            ", ", beta.dim());
  TrainingShape d;
  d.B = q.size(0);
  d.T = q.size(1);
  d.H = q.size(2);
  d.K = q.size(3);
  d.HV = v.size(2);
  d.V = v.size(3);
  KDA_CHECK(d.H >= 1 && d.K >= 1, op, ": q must be [B, T, H, K] with H >= 1 and K >= 1, got ", q.sizes());
  KDA_CHECK(d.HV >= 1 && d.V >= 1, op, ": v must be [B, T, HV, V] with HV >= 1 and V >= 1, got ", v.sizes());
  KDA_CHECK(d.HV % d.H == 0, op, ": HV % H must be 0, got HV=", d.HV, ", H=", d.H);
  KDA_CHECK(k.sizes() == q.sizes(), op, ": k must have the shape of q ", q.sizes(), ", got ", k.sizes());
  KDA_CHECK(v.size(0) == d.B && v.size(1) == d.T, op, ": v must be [B, T, HV, V], got ", v.sizes());
  KDA_CHECK(g.size(0) == d.B && g.size(1) == d.T && g.size(2) == d.HV && g.size(3) == d.K, op,
            ": g must be [B, T, HV, K], got ", g.sizes());
  KDA_CHECK(beta.size(0) == d.B && beta.size(1) == d.T && beta.size(2) == d.HV, op, ": beta must be [B, T, HV], got ",
            beta.sizes());
  for (const at::Tensor* t : {&q, &k, &v, &g})
    KDA_CHECK(t->stride(-1) == 1, op, ": token tensors must have a contiguous last dim, got strides ", t->strides());
  KDA_CHECK(gate_mode >= 0 && gate_mode <= 2, op,
            ": gate_mode must be 0 (precomputed), 1 (softplus) or 2 (lower bound), got ", gate_mode);
  if (gate_mode == 0) {
    KDA_CHECK(!A_log.has_value() && !dt_bias.has_value(), op,
              ": A_log and dt_bias must be None with the precomputed gate (gate_mode=0: g is the log-decay)");
  } else {
    KDA_CHECK(A_log.has_value(), op, ": A_log must be a [HV] tensor with gate_mode=", gate_mode, ", got None");
    KDA_CHECK(A_log->numel() == d.HV, op, ": A_log must be [HV]=[", d.HV, "], got ", A_log->sizes());
    if (dt_bias.has_value())
      KDA_CHECK(dt_bias->numel() == d.HV * d.K, op, ": dt_bias must be [HV, K]=[", d.HV, ", ", d.K, "], got ",
                dt_bias->sizes());
  }
  KDA_CHECK(std::isfinite(scale) && scale > 0, op, ": scale must be a finite number > 0, got ", scale);
  if (gate_mode == 2)
    KDA_CHECK(std::isfinite(lower_bound) && lower_bound < 0, op, ": lower_bound must be a finite number < 0, got ",
              lower_bound);
  if (cu_seqlens.has_value()) {
    const at::Tensor& cu = *cu_seqlens;
    KDA_CHECK(d.B == 1, op, ": cu_seqlens needs B == 1, got B=", d.B);
    KDA_CHECK_TYPE(cu.scalar_type() == at::kInt || cu.scalar_type() == at::kLong, op,
                   ": cu_seqlens must be int32 or int64, got ", cu.scalar_type());
    KDA_CHECK(cu.dim() == 1 && cu.numel() >= 2, op, ": cu_seqlens must be [N+1] with N >= 1, got ", cu.sizes());
    d.N = cu.numel() - 1;
    d.packed = true;
  } else {
    d.N = d.B;
  }
  return d;
}

}  // namespace kda
