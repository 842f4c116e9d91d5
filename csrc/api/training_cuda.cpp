// CUDA implementations of the three training ops (docs/contract.md, API):
//   recurrent_kda_training_forward  = the chunked kernel (csrc/kda/chunked; token-serial csrc/kda/decode for
//                                     decode-sized sequences) with fp32
//                                     tapes every kTapeChunk tokens, in every mode of recurrent_kda (gate,
//                                     beta_is_logit, use_qk_l2norm); K == V in {64, 128};
//   recurrent_kda_training_backward = csrc/kda/backward from the tapes (the backward chain, i.e. the chunked
//                                     kernel in reverse, then the chunk-parallel sweep) in every gate mode
//                                     (beta logit or plain, L2 norm on or off) at K == V == 128, and at
//                                     K == V == 64 on zero-padded copies (training_backward_padded); the small
//                                     sweep on GPUs with ~99 KiB of shared memory per block (sm_120); the CPU
//                                     op on host copies only where even that does not fit (route_training_sweep,
//                                     kda/route/route.h);
//   recurrent_kda_backward          = both.
// Shapes/dtypes follow kda_ops/_fake.py. CUDA fast path: bf16 tokens, K == V == 128. No host synchronisation
// there (tape_cu_starts is computed on the device), so those calls can be captured in a CUDA graph; the torch
// allocations inside them go through the caching allocator.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "api/checks.h"
#include "api/recurrent_params.h"
#include "api/training_checks.h"
#include "kda/backward/backward_params.h"
#include "kda/common/channel_padding.h"
#include "kda/common/device_info.h"
#include "kda/decode/recurrent_launch.h"
#include "kda/chunked/chunked_launch.h"
#include "kda/params.h"
#include "kda/route/route.h"
#include "kda/tape_rows.h"

namespace kda {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

struct TrainDims : TrainingShape {
  int64_t rows;   // tape rows: an upper bound from shapes (kda_ops/_fake.py)
  int64_t slots;  // 64-token chunks of all sequences: an upper bound from shapes (the sweep's tasks)
};

bool aligned16(const Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

// Token tensor as the recurrent kernel wants it: 16-byte aligned base, strides multiples of 8 elements,
// contiguous last dim. Views that are not get a compact copy.
Tensor kernel_tokens(const Tensor& t) {
  bool ok = t.stride(-1) == 1 && aligned16(t);
  for (int d = 0; d + 1 < t.dim(); ++d) ok = ok && (t.size(d) <= 1 || t.stride(d) % 8 == 0);
  return ok ? t : t.clone(at::MemoryFormat::Contiguous);
}

// Compact, 16-byte aligned fp32 copy (or the tensor itself when it already is one).
Tensor compact_f32(const Tensor& t) {
  Tensor c = t.to(at::kFloat).contiguous();
  return aligned16(c) ? c : c.clone();
}

// The mode arguments of the three schemas.
struct TrainingModes {
  int64_t gate_mode;
  bool use_qk_l2norm, beta_is_logit;
};

TrainDims check_training_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const OptTensor& A_log, const OptTensor& dt_bias,
                                const OptTensor& cu_seqlens, double scale, double lower_bound, const TrainingModes& m) {
  KDA_CHECK(q.is_cuda(), op, ": q must be a CUDA tensor, got ", q.device());
  for (const Tensor* t : {&k, &v, &g, &beta}) KDA_CHECK_SAME_DEVICE(*t, q, "every input");
  for (const OptTensor* t : {&A_log, &dt_bias})
    if (t->has_value()) KDA_CHECK_SAME_DEVICE(**t, q, "every input");
  if (cu_seqlens.has_value()) KDA_CHECK_SAME_DEVICE(*cu_seqlens, q, "cu_seqlens");
  const TrainingShape s =
      check_training_shapes(op, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound, m.gate_mode);
  for (const Tensor* t : {&q, &k, &v, &g, &beta})
    KDA_CHECK_TYPE(t->scalar_type() == at::kBFloat16, op, ": CUDA token tensors (q, k, v, g, beta) must be ",
                   at::kBFloat16, ", got ", t->scalar_type());
  KDA_CHECK(s.K == s.V && (s.K == 64 || s.K == kBwdDim), op, ": the CUDA training ops support K == V in {64, ", kBwdDim,
            "}, got K=", s.K, ", V=", s.V);
  if (A_log.has_value()) KDA_CHECK_DTYPE(*A_log, at::kFloat, "A_log");
  if (dt_bias.has_value()) KDA_CHECK_DTYPE(*dt_bias, at::kFloat, "dt_bias");
  if (m.gate_mode == 2) KDA_CHECK(lower_bound >= -5.0, op, ": lower_bound must be in [-5, 0), got ", lower_bound);
  if (cu_seqlens.has_value())
    KDA_CHECK(cu_seqlens->is_contiguous(), op, ": cu_seqlens must be a contiguous [N+1] tensor, got strides ",
              cu_seqlens->strides());
  TrainDims d;
  static_cast<TrainingShape&>(d) = s;
  // Row bounds from shapes (kda/tape_rows.h): the sweep's 64-token slots and the tape rows.
  d.slots = chunk_rows_bound(d.packed, d.B, d.T, d.N, kTapeChunk);
  d.rows = tape_rows_bound(d.packed, d.B, d.T);
  return d;
}

TokenTensor token_view(const Tensor& t) {
  TokenTensor r;
  r.ptr = t.data_ptr();
  r.batch_stride = t.stride(0);
  r.token_stride = t.stride(1);
  r.head_stride = t.stride(2);
  return r;
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, what, " failed: ", cudaGetErrorString(err));
}

// The CUDA backward kernels (the chain and the sweep, csrc/kda/backward) run every gate mode (the lower-bound
// gate with the sweep's factorised exponents, whose 16-token sub-chunks rely on the bound for the range of
// e^{±Γ}; the unbounded softplus and precomputed gates with its pairwise exponents wherever a sub-chunk decays
// too far for that range, sweep.cu), with logit or plain beta and the L2 norm on or off, at K == V == 128 (their
// lane layouts: 4 columns per lane of 32). K == V == 64 runs them on copies zero-padded to 128 channels
// (training_backward_padded): exact, since zero key/query channels and zero value rows keep the padded rows
// and columns of the state and of its gradient zero, and every padded channel's gradient is dropped.
constexpr int64_t kPaddedDim = 64;

// Zero-padding of K == V == 64 tensors to 128 channels: the last dimension (tokens, dt_bias) or the last two
// (states). bf16 token tensors [B, T, H, 64] in one pass of vector copies (kda/common/channel_padding.h), the
// small ones by constant_pad_nd.
Tensor pad_channels(const Tensor& t, double value = 0.0) {
  if (t.dim() != 4 || t.scalar_type() != at::kBFloat16) return at::constant_pad_nd(t, {0, kBwdDim - kPaddedDim}, value);
  TORCH_INTERNAL_ASSERT(t.size(3) == kPaddedDim, "pad_channels: expected 64 channels, got ", t.size(3));
  const Tensor s = kernel_tokens(t);
  Tensor out = at::empty({s.size(0), s.size(1), s.size(2), kBwdDim}, s.options());
  check_cuda(launch_pad_channels_bf16(s.data_ptr(), s.size(0), s.size(1), s.size(2), s.stride(0), s.stride(1),
                                      s.stride(2), c10::BFloat16(static_cast<float>(value)).x, out.data_ptr(),
                                      c10::cuda::getCurrentCUDAStream()),
             "kda channel padding kernel");
  return out;
}
// The raw gate's padding: 0 (a finite decay on zero state rows/columns) but for the softplus gate, whose
// a = -exp(A_log) softplus(0) = -exp(A_log) ln 2 per token would make every chunk "wide" (the slower pairwise
// exponents) for exp(A_log) > ~3.6; there g = -1e4 gives a = 0 (no decay) in the padded channels.
Tensor pad_gate(const Tensor& g, const TrainingModes& m) {
  return pad_channels(g, m.gate_mode == 1 ? -1e4 : 0.0);
}
Tensor pad_state(const Tensor& t) {
  return at::constant_pad_nd(t, {0, kBwdDim - kPaddedDim, 0, kBwdDim - kPaddedDim});
}
// dt_bias ([HV, 64] or flat [HV*64]) as [HV, 128] with zeros.
OptTensor pad_dt_bias(const OptTensor& dt_bias, int64_t HV) {
  return dt_bias ? OptTensor(pad_channels(dt_bias->reshape({HV, kPaddedDim}))) : std::nullopt;
}
// The first 64 channels of a 128-channel result (compact bf16 token tensors and fp32 states by the vector-copy
// kernels, the rest by narrow).
Tensor first_channels(const Tensor& t) {
  if (t.scalar_type() != at::kBFloat16 || !t.is_contiguous() || !aligned16(t) || t.size(-1) != kBwdDim)
    return t.narrow(-1, 0, kPaddedDim).contiguous();
  std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
  shape.back() = kPaddedDim;
  Tensor out = at::empty(shape, t.options());
  check_cuda(
      launch_first_channels_bf16(t.data_ptr(), t.numel() / kBwdDim, out.data_ptr(), c10::cuda::getCurrentCUDAStream()),
      "kda channel crop kernel");
  return out;
}
Tensor first_state_block(const Tensor& t) {
  if (t.scalar_type() != at::kFloat || t.dim() != 4 || !t.is_contiguous() || !aligned16(t) || t.size(2) != kBwdDim ||
      t.size(3) != kBwdDim)
    return t.narrow(-2, 0, kPaddedDim).narrow(-1, 0, kPaddedDim).contiguous();
  Tensor out = at::empty({t.size(0), t.size(1), kPaddedDim, kPaddedDim}, t.options());
  check_cuda(launch_first_state_block_f32(t.data_ptr<float>(), t.size(0) * t.size(1), out.data_ptr<float>(),
                                          c10::cuda::getCurrentCUDAStream()),
             "kda state crop kernel");
  return out;
}

// RecurrentParams of the training forward in its modes (checkpoints every kTapeChunk tokens at
// tape_cu_starts): v, start = initial_state (read-only, slot n), final_state, the tapes as the checkpoints.
// (The backward chain has its own BackwardChainParams.)
RecurrentParams training_recurrent_params(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                          const Tensor& beta, const OptTensor& A_opt, const OptTensor& dtb_opt,
                                          const OptTensor& cu_seqlens, const Tensor& out, const Tensor& start,
                                          const Tensor& final_state, const Tensor& checkpoints,
                                          const Tensor& checkpoint_cu_starts, double scale, double lower_bound,
                                          const TrainingModes& m) {
  const OptTensor none, fs_opt(final_state), ck_opt(checkpoints), cks_opt(checkpoint_cu_starts);
  RecurrentArgs args{.q = q,
                     .k = k,
                     .v = v,
                     .g = g,
                     .beta = beta,
                     .A_log = A_opt,
                     .dt_bias = dtb_opt,
                     .state = none,
                     .state_source = none,  // set below: make_recurrent_params wants indices with a source
                     .initial_state_indices = none,
                     .cu_seqlens = cu_seqlens,
                     .ssm_state_indices = none,
                     .num_accepted_tokens = none,
                     .seq_order = none,
                     .output = out,
                     .final_state = fs_opt,
                     .state_checkpoints = ck_opt,
                     .checkpoint_cu_starts = cks_opt,
                     .scale = scale,
                     .gate_mode = m.gate_mode,
                     .lower_bound = m.gate_mode == 2 ? lower_bound : 0.0,
                     .use_qk_l2norm = m.use_qk_l2norm,
                     .beta_is_logit = m.beta_is_logit,
                     .num_spec_tokens = 0,
                     .checkpoint_every_n_tokens = kTapeChunk};
  RecurrentParams p = make_recurrent_params(args);
  if (start.defined()) {
    p.state_source = start.data_ptr();
    p.state_source_dtype = start.scalar_type() == at::kFloat ? DType::kFloat32 : DType::kBFloat16;
    p.source_slot_stride = int64_t(p.HV) * p.V * p.K;
    p.n_source = start.size(0);
  }
  p.initial_state_indices = nullptr;
  return p;
}

// The backward chain's arguments: the inputs of the training backward `p` (dout, dfinal_state and the
// token tensors the sweep reads too) and the chain's outputs, dstates (rows p.dstate_cu_starts) and
// dinitial_state.
BackwardChainParams backward_chain_params(const TrainingBackwardParams& p, float* dstates, float* dinitial_state) {
  BackwardChainParams c;
  copy_counts(c, p);
  c.q = p.q;
  c.k = p.k;
  c.g = p.g;
  c.beta = p.beta;
  c.dout = p.dout;
  c.A_log = p.A_log;
  c.dt_bias = p.dt_bias;
  c.cu_seqlens = p.cu_seqlens;
  c.cu_seqlens_int64 = p.cu_seqlens_int64;
  c.gate_mode = p.gate_mode;
  c.scale = p.scale;
  c.lower_bound = p.lower_bound;
  c.beta_is_logit = p.beta_is_logit;
  c.use_qk_l2norm = p.use_qk_l2norm;
  c.dfinal_state = p.dfinal_state;
  c.dinitial_state = dinitial_state;
  c.dstates = dstates;
  c.dstate_cu_starts = p.dstate_cu_starts;
  c.n_dstate_rows = p.n_dstate_rows;
  return c;
}

// Forward with tapes. Returns (out bf16, final_state fp32, tapes fp32, tape_cu_starts int64).
std::tuple<Tensor, Tensor, Tensor, Tensor> training_forward_impl(const char* op, const Tensor& q_in, const Tensor& k_in,
                                                                 const Tensor& v_in, const Tensor& g_in,
                                                                 const Tensor& beta, const OptTensor& A_log,
                                                                 const OptTensor& dt_bias, const Tensor& initial_state,
                                                                 const OptTensor& cu_seqlens, double scale,
                                                                 double lower_bound, const TrainingModes& m) {
  const TrainDims d =
      check_training_inputs(op, q_in, k_in, v_in, g_in, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound, m);
  c10::cuda::CUDAGuard guard(q_in.device());
  KDA_CHECK_SAME_DEVICE(initial_state, q_in, "initial_state");
  KDA_CHECK(initial_state.dim() == 4 && initial_state.size(0) == d.N && initial_state.size(1) == d.HV &&
                initial_state.size(2) == d.V && initial_state.size(3) == d.K,
            op, ": initial_state must be [N, HV, V, K]=[", d.N, ", ", d.HV, ", ", d.V, ", ", d.K, "], got ",
            initial_state.sizes());
  KDA_CHECK_TYPE(initial_state.scalar_type() == at::kFloat || initial_state.scalar_type() == at::kBFloat16, op,
                 ": initial_state must be float32 or bfloat16, got ", initial_state.scalar_type());
  // K == V == 64 with sequences long enough for chunks (as chunked_preferred): the 128-channel chunked kernel on
  // zero-padded copies (see kPaddedDim; the token-serial kernel is several times slower there), the output, final
  // state and tapes cut back to 64 channels (the context keeps the 64 x 64 tapes).
  if (d.K == kPaddedDim && d.V == kPaddedDim && d.N > 0 && (d.packed ? d.T : d.B * d.T) >= 16 * d.N) {
    auto [o, fs, tp, starts] = training_forward_impl(op, pad_channels(q_in), pad_channels(k_in), pad_channels(v_in),
                                                     pad_gate(g_in, m), beta, A_log, pad_dt_bias(dt_bias, d.HV),
                                                     pad_state(initial_state), cu_seqlens, scale, lower_bound, m);
    return {first_channels(o), first_state_block(fs), first_state_block(tp), starts};
  }
  const Tensor q = kernel_tokens(q_in), k = kernel_tokens(k_in), v = kernel_tokens(v_in), g = kernel_tokens(g_in);
  Tensor init = initial_state.contiguous();
  if (!aligned16(init)) init = init.clone();
  const OptTensor A = A_log ? OptTensor(A_log->contiguous()) : std::nullopt;
  const OptTensor dtb = dt_bias ? OptTensor(dt_bias->contiguous()) : std::nullopt;
  const auto f32 = q.options().dtype(at::kFloat);

  Tensor out = at::empty({d.B, d.T, d.HV, d.V}, q.options());
  Tensor final_state = at::empty({d.N, d.HV, d.V, d.K}, f32);
  // Fixed layout: the forward writes every row. Packed: rows past the sequences' are zeroed below.
  Tensor tapes = at::empty({d.rows, d.HV, d.V, d.K}, f32);
  Tensor tape_cu_starts = at::empty({d.N + 1}, q.options().dtype(at::kLong));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();

  check_cuda(launch_tape_cu_starts(cu_seqlens ? cu_seqlens->data_ptr() : nullptr,
                                   cu_seqlens && cu_seqlens->scalar_type() == at::kLong, d.N, d.T,
                                   tape_cu_starts.data_ptr<int64_t>(), stream, kTapeChunk, /*first=*/1),
             "kda tape_cu_starts kernel");
  if (d.packed)
    check_cuda(launch_zero_rows_past(tapes.data_ptr<float>(), d.rows, d.HV * d.V * d.K,
                                     tape_cu_starts.data_ptr<int64_t>(), d.N, stream),
               "kda tape zero kernel");

  RecurrentParams p = training_recurrent_params(q, k, v, g, beta, A, dtb, cu_seqlens, out, init, final_state, tapes,
                                                tape_cu_starts, scale, lower_bound, m);
  p.checkpoint_first = 1;  // no tape row for the state before token 0 (initial_state)
  // The chunked tensor-core kernel writes the tapes as its checkpoints (every 64 tokens, fp32) whenever the
  // sequences are long enough to fill chunks; short ones (mostly decode-sized) take the token-serial kernel.
  const ForwardRoute route = route_forward(p, Backend::kAuto, /*disable_state_update=*/false);
  if (route.kernel == ForwardKernel::kChunkedMma || route.kernel == ForwardKernel::kChunkedSm90)
    check_cuda(launch_chunked(p, route, stream), "kda chunked kernel (training forward)");
  else
    check_cuda(launch_recurrent(p, route, stream), "kda recurrent kernel (training forward)");
  // final_state in initial_state's dtype (kda_ops/_fake.py); the tapes stay fp32.
  if (initial_state.scalar_type() != at::kFloat) final_state = final_state.to(initial_state.scalar_type());
  return {out, final_state, tapes, tape_cu_starts};
}

using Grads = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor>;

// The training backward of the calls the CUDA kernels cannot run on this GPU (route_training_sweep: less shared memory
// per block than even the small sweep needs, or KDA_TRAINING_SWEEP=host): the CPU op on host copies, its
// gradients copied back to q's device. The CPU op checks the tapes and tape_cu_starts against the sequences
// itself (it reads cu_seqlens on the host).
Grads training_backward_on_cpu(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const OptTensor& A_log, const OptTensor& dt_bias, const Tensor& tapes,
                               const Tensor& tape_cu_starts, const OptTensor& initial_state,
                               const OptTensor& cu_seqlens, const Tensor& dout, const OptTensor& dfinal_state,
                               double scale, double lower_bound, const TrainingModes& m) {
  static auto cpu_op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kda::recurrent_kda_training_backward", "")
          .typed<Grads(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const OptTensor&,
                       const OptTensor&, const Tensor&, const Tensor&, const OptTensor&, const OptTensor&,
                       const Tensor&, const OptTensor&, double, double, int64_t, bool, bool)>();
  const auto host = [](const OptTensor& t) { return t ? OptTensor(t->cpu()) : std::nullopt; };
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // a kernel call, as this one is: no autograd recording
  Grads r = cpu_op.call(q.cpu(), k.cpu(), v.cpu(), g.cpu(), beta.cpu(), host(A_log), host(dt_bias), tapes.cpu(),
                        tape_cu_starts.cpu(), host(initial_state), host(cu_seqlens), dout.cpu(), host(dfinal_state),
                        scale, lower_bound, m.gate_mode, m.use_qk_l2norm, m.beta_is_logit);
  const auto dev = [&](const Tensor& t) { return t.to(q.device()); };
  return {dev(std::get<0>(r)), dev(std::get<1>(r)), dev(std::get<2>(r)), dev(std::get<3>(r)),
          dev(std::get<4>(r)), dev(std::get<5>(r)), dev(std::get<6>(r)), dev(std::get<7>(r))};
}

Grads training_backward_impl(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                             const Tensor& beta, const OptTensor& A_log, const OptTensor& dt_bias,
                             const Tensor& tapes_in, const Tensor& tape_cu_starts, const OptTensor& initial_state,
                             const OptTensor& cu_seqlens, const Tensor& dout, const OptTensor& dfinal_state,
                             double scale, double lower_bound, const TrainingModes& m, int64_t state_dim = 0);

// The training backward's own tensors against the shapes of the call (d, from check_training_inputs): tapes
// [rows, HV, V, K] fp32, tape_cu_starts [N+1] int64, do [B, T, HV, V] bf16 with a contiguous last dim,
// initial_state / dfinal_state [N, HV, V, K] (fp32 or bf16), all on q's device.
// state_dim: the V = K of the tapes and initial_state (d.K; 64 in the padded K == V == 64 call, whose sweep reads
// them unpadded).
void check_backward_tensors(const char* op, const TrainDims& d, const Tensor& q, const Tensor& tapes,
                            const Tensor& tape_cu_starts, const Tensor& dout, const OptTensor& initial_state,
                            const OptTensor& dfinal_state, int64_t state_dim) {
  KDA_CHECK_SAME_DEVICE(tapes, q, "tapes");
  KDA_CHECK_SAME_DEVICE(tape_cu_starts, q, "tape_cu_starts");
  KDA_CHECK_SAME_DEVICE(dout, q, "do");
  KDA_CHECK(tapes.dim() == 4 && tapes.size(1) == d.HV && tapes.size(2) == state_dim && tapes.size(3) == state_dim, op,
            ": tapes must be [rows, HV, V, K], got ", tapes.sizes());
  KDA_CHECK_DTYPE(tapes, at::kFloat, "tapes");
  KDA_CHECK_DTYPE(tape_cu_starts, at::kLong, "tape_cu_starts");
  KDA_CHECK(tape_cu_starts.dim() == 1 && tape_cu_starts.numel() == d.N + 1 && tape_cu_starts.is_contiguous(), op,
            ": tape_cu_starts must be a contiguous [N+1]=[", d.N + 1, "], got ", tape_cu_starts.sizes());
  KDA_CHECK_TYPE(dout.scalar_type() == at::kBFloat16, op, ": do must be ", at::kBFloat16, ", got ", dout.scalar_type());
  KDA_CHECK(
      dout.dim() == 4 && dout.size(0) == d.B && dout.size(1) == d.T && dout.size(2) == d.HV && dout.size(3) == d.V, op,
      ": do must be [B, T, HV, V], got ", dout.sizes());
  KDA_CHECK(dout.stride(-1) == 1, op, ": do must have a contiguous last dim, got strides ", dout.strides());
  for (const auto& [t, name] :
       {std::pair<const OptTensor*, const char*>{&dfinal_state, "dfinal_state"}, {&initial_state, "initial_state"}})
    if (t->has_value()) {
      KDA_CHECK_SAME_DEVICE(**t, q, name);
      const int64_t sd = t == &initial_state ? state_dim : d.K;
      KDA_CHECK((*t)->dim() == 4 && (*t)->size(0) == d.N && (*t)->size(1) == d.HV && (*t)->size(2) == sd &&
                    (*t)->size(3) == sd,
                op, ": ", name, " must be [N, HV, V, K], got ", (*t)->sizes());
    }
  if (initial_state.has_value())
    KDA_CHECK_TYPE(initial_state->scalar_type() == at::kFloat || initial_state->scalar_type() == at::kBFloat16, op,
                   ": initial_state must be float32 or bfloat16, got ", initial_state->scalar_type());
}

// K == V == 64 on the K == V == 128 kernels (see kPaddedDim): q, k, v, do zero-padded to 128 channels, g by
// pad_gate, dt_bias with zeros, dfinal_state with zero rows and columns; the tapes and initial_state stay 64 x 64
// (the sweep reads them as the leading block of its 128 x 128 state, zeros elsewhere: p.state_dim); the gradients
// are the first 64 channels (dq, dk, dv, dg, ddt_bias) and the leading 64 x 64 block (dinitial_state). The
// caller's tensors are checked before (check_backward_tensors), so errors name them as given. Costs the copies and
// 128-channel work.
Grads training_backward_padded(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                               const Tensor& beta, const OptTensor& A_log, const OptTensor& dt_bias,
                               const Tensor& tapes, const Tensor& tape_cu_starts, const OptTensor& initial_state,
                               const OptTensor& cu_seqlens, const Tensor& dout, const OptTensor& dfinal_state,
                               double scale, double lower_bound, const TrainingModes& m) {
  const OptTensor dfinal = dfinal_state ? OptTensor(pad_state(*dfinal_state)) : std::nullopt;
  Grads r = training_backward_impl(op, pad_channels(q), pad_channels(k), pad_channels(v), pad_gate(g, m), beta, A_log,
                                   pad_dt_bias(dt_bias, v.size(2)), tapes, tape_cu_starts, initial_state, cu_seqlens,
                                   pad_channels(dout), dfinal, scale, lower_bound, m, kPaddedDim);
  Tensor ddt = std::get<6>(r);
  if (dt_bias) ddt = first_channels(ddt).view(dt_bias->sizes());
  return {first_channels(std::get<0>(r)),
          first_channels(std::get<1>(r)),
          first_channels(std::get<2>(r)),
          first_channels(std::get<3>(r)),
          std::get<4>(r),
          std::get<5>(r),
          ddt,
          first_state_block(std::get<7>(r))};
}

Grads training_backward_impl(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                             const Tensor& beta, const OptTensor& A_log, const OptTensor& dt_bias,
                             const Tensor& tapes_in, const Tensor& tape_cu_starts, const OptTensor& initial_state,
                             const OptTensor& cu_seqlens, const Tensor& dout, const OptTensor& dfinal_state,
                             double scale, double lower_bound, const TrainingModes& m, int64_t state_dim) {
  const TrainDims d = check_training_inputs(op, q, k, v, g, beta, A_log, dt_bias, cu_seqlens, scale, lower_bound, m);
  c10::cuda::CUDAGuard guard(q.device());
  if (state_dim <= 0) state_dim = d.K;
  const SweepKernel route = route_training_sweep(static_cast<int>(m.gate_mode));  // (kda/route/route.h)
  if (route == SweepKernel::kHost) {
    // the host copies cannot be captured: refuse under CUDA-graph capture before anything is enqueued
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    check_cuda(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(), &capture), "cudaStreamIsCapturing");
    TORCH_CHECK(capture == cudaStreamCaptureStatusNone, op, ": this call runs the CPU implementation on host copies (",
                "this GPU gives a block less shared memory than the CUDA backward's sweep needs, or "
                "KDA_TRAINING_SWEEP=host is set",
                ") and cannot be captured in a CUDA graph; run it eagerly");
    KDA_CHECK_SAME_DEVICE(tapes_in, q, "tapes");
    KDA_CHECK_SAME_DEVICE(tape_cu_starts, q, "tape_cu_starts");
    KDA_CHECK_SAME_DEVICE(dout, q, "do");
    for (const OptTensor* t : {&initial_state, &dfinal_state})
      if (t->has_value()) KDA_CHECK_SAME_DEVICE(**t, q, "initial_state and dfinal_state");
    return training_backward_on_cpu(q, k, v, g, beta, A_log, dt_bias, tapes_in, tape_cu_starts, initial_state,
                                    cu_seqlens, dout, dfinal_state, scale, lower_bound, m);
  }
  check_backward_tensors(op, d, q, tapes_in, tape_cu_starts, dout, initial_state, dfinal_state, state_dim);
  if (d.K == kPaddedDim && d.V == kPaddedDim)
    return training_backward_padded(op, q, k, v, g, beta, A_log, dt_bias, tapes_in, tape_cu_starts, initial_state,
                                    cu_seqlens, dout, dfinal_state, scale, lower_bound, m);
  // K == V == kBwdDim, every gate mode (A_log absent exactly for the precomputed gate).
  Tensor dfinal;
  if (dfinal_state.has_value())
    dfinal = compact_f32(*dfinal_state);  // (16-byte aligned: the chain reads it with vector loads)
  Tensor init;  // the state before token 0 of each sequence (the tapes start at token 64); undefined = zeros
  if (initial_state.has_value()) {
    init = compact_f32(*initial_state);  // (16-byte aligned: the sweep copies it with cp.async)
  }
  const Tensor tapes = compact_f32(tapes_in);
  const Tensor A = A_log ? A_log->contiguous() : Tensor();
  const Tensor dtb = dt_bias ? dt_bias->contiguous() : Tensor();
  const auto f32 = q.options().dtype(at::kFloat);
  const auto tok = q.options();

  // No GQA group (HV == H) on the chunked sweep: it writes dq, dk itself (after the L2-norm backward);
  // otherwise the qk finishing kernel does. Token gradients are not zero-filled: the sweep writes every token
  // of every sequence and launch_training_backward zeroes the packed tokens outside them (covered_tokens).
  const bool fused_qk = d.HV == d.H;
  Tensor dq = at::empty({d.B, d.T, d.H, kBwdDim}, tok);
  Tensor dk = at::empty({d.B, d.T, d.H, kBwdDim}, tok);
  Tensor dv = at::empty({d.B, d.T, d.HV, kBwdDim}, tok);
  Tensor dg = at::empty({d.B, d.T, d.HV, kBwdDim}, tok);
  Tensor dbeta = at::empty({d.B, d.T, d.HV}, tok);
  // (without A_log / dt_bias, scratch for the finishing kernel's sums; the op then returns an empty gradient)
  Tensor dA_log = at::empty({d.HV}, f32);
  Tensor ddt_bias = at::empty({d.HV, kBwdDim}, f32);
  Tensor dinit = at::empty({d.N, d.HV, kBwdDim, kBwdDim}, f32);

  const int sms = cached_device_attribute<cudaDevAttrMultiProcessorCount>(1);
  // Tasks of the sweep: (64-token slot, value head); one parameter-gradient partial row per task row.
  const int64_t partial_rows = d.slots;
  const int64_t tasks = partial_rows * d.HV;
  // Persistent CTAs: as many waves of tasks as one CTA per SM needs, spread over the fewest CTAs that keep that many
  // (e.g. 4096 tasks on 132 SMs: 32 waves on 128 CTAs, not 31 waves and 4 tasks of a 32nd on 132): the same time
  // per wave, less traffic from the SMs that would only wait for the last wave.
  const int64_t waves = (tasks + std::max(sms, 1) - 1) / std::max(sms, 1);
  const int grid = static_cast<int>(waves > 0 ? (tasks + waves - 1) / waves : 0);
  Tensor head_grads = at::empty({fused_qk ? 0 : 2 * d.B * d.T * d.HV * kBwdDim}, f32);  // covered rows only
  Tensor partials = at::empty({tasks * (kBwdDim + 1)}, f32);
  // The small sweep's S and dS, one pair of [128][132] fp32 matrices per CTA (~132 KiB each).
  Tensor sweep_state;
  if (route == SweepKernel::kSmall) sweep_state = at::empty({grid, training_backward_sweep_state_floats()}, f32);
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  Tensor dstates, dstate_cu_starts, slot_cu_starts;
  // Token tensors as the kernels want them (16-byte aligned base, strides multiples of 8 elements): the chain
  // and the chunked sweep read them with vector loads. (Named: the kernels read these copies after this.)
  const Tensor qc = kernel_tokens(q), kc = kernel_tokens(k), vc = kernel_tokens(v), gc = kernel_tokens(g),
               dO = kernel_tokens(dout);
  const bool sweep64 = route == SweepKernel::kSweep64;
  {
    // the chunked sweep's task slots: one per 64-token chunk, the state before token 0 included
    slot_cu_starts = at::empty({d.N + 1}, q.options().dtype(at::kLong));
    check_cuda(launch_tape_cu_starts(cu_seqlens ? cu_seqlens->data_ptr() : nullptr,
                                     cu_seqlens && cu_seqlens->scalar_type() == at::kLong, d.N, d.T,
                                     slot_cu_starts.data_ptr<int64_t>(), stream, kTapeChunk, /*first=*/0),
               "kda slot starts kernel");
    if (sweep64) {
      // the 64-token sweep: dS at the end of every 64-token chunk, one row per slot
      dstate_cu_starts = slot_cu_starts;
      dstates = at::empty({d.slots, d.HV, kBwdDim, kBwdDim}, f32);
    } else {
      // Rows of the backward chain's dS (at the end of every 16-token chunk): a 16-token prefix like
      // tape_cu_starts (fixed: B ceil(T/16); packed: <= T/16 + N).
      dstate_cu_starts = at::empty({d.N + 1}, q.options().dtype(at::kLong));
      check_cuda(launch_tape_cu_starts(cu_seqlens ? cu_seqlens->data_ptr() : nullptr,
                                       cu_seqlens && cu_seqlens->scalar_type() == at::kLong, d.N, d.T,
                                       dstate_cu_starts.data_ptr<int64_t>(), stream, 16, /*first=*/0),
                 "kda dS row starts kernel");
      dstates = at::empty({chunk_rows_bound(d.packed, d.B, d.T, d.N, 16), d.HV, kBwdDim, kBwdDim}, f32);
    }
  }

  TrainingBackwardParams p;
  copy_counts(p, d);
  p.q = token_view(qc);
  p.k = token_view(kc);
  p.v = token_view(vc);
  p.g = token_view(gc);
  p.beta = token_view(beta);
  p.dout = token_view(dO);
  p.A_log = A.defined() ? A.data_ptr<float>() : nullptr;
  p.dt_bias = dtb.defined() ? dtb.data_ptr<float>() : nullptr;
  p.tapes = tapes.data_ptr<float>();
  p.n_tape_rows = tapes.size(0);
  p.tape_cu_starts = tape_cu_starts.data_ptr<int64_t>();
  p.initial_state = init.defined() ? init.data_ptr<float>() : nullptr;
  p.state_dim = static_cast<int>(state_dim);
  p.slot_cu_starts = slot_cu_starts.data_ptr<int64_t>();
  p.n_slots = d.slots;
  if (cu_seqlens.has_value()) {
    p.cu_seqlens = cu_seqlens->data_ptr();
    p.cu_seqlens_int64 = cu_seqlens->scalar_type() == at::kLong;
  }
  p.dfinal_state = dfinal.defined() ? dfinal.data_ptr<float>() : nullptr;
  p.scale = static_cast<float>(scale);
  p.gate_mode = static_cast<GateMode>(m.gate_mode);
  p.lower_bound = m.gate_mode == 2 ? static_cast<float>(lower_bound) : 0.f;
  p.beta_is_logit = m.beta_is_logit;
  p.use_qk_l2norm = m.use_qk_l2norm;
  p.dv = dv.data_ptr();
  p.dg = dg.data_ptr();
  p.dbeta = dbeta.data_ptr();
  float* hg = fused_qk ? nullptr : head_grads.data_ptr<float>();
  p.dq_head = hg;
  p.dk_head = fused_qk ? nullptr : hg + d.B * d.T * d.HV * kBwdDim;
  p.fused_qk = fused_qk;
  p.partial_rows = partial_rows;
  p.ddt_partial = partials.data_ptr<float>();
  p.dA_partial = p.ddt_partial + tasks * kBwdDim;
  p.dstates = dstates.data_ptr<float>();
  p.dstate_cu_starts = dstate_cu_starts.data_ptr<int64_t>();
  p.n_dstate_rows = dstates.size(0);
  p.grid = grid;
  p.sweep_state = sweep_state.defined() ? sweep_state.data_ptr<float>() : nullptr;
  p.sweep64 = sweep64;
  p.dq = dq.data_ptr();
  p.dk = dk.data_ptr();
  p.dA_log = dA_log.data_ptr<float>();
  p.ddt_bias = ddt_bias.data_ptr<float>();
  // The backward chain first (the chunked kernel in reverse, on the same stream): dS at the end of every
  // 16-token chunk (64-token with the Hopper sweep) into dstates, and dinitial_state. Then the sweep and the
  // finishing kernels.
  BackwardChainParams chain = backward_chain_params(p, dstates.data_ptr<float>(), dinit.data_ptr<float>());
  chain.dstate_every = sweep64 ? kTapeChunk : 16;
  const RecurrentParams chain_p = chain_as_recurrent(chain);
  check_cuda(launch_chunked_backward_chain(chain_p, route_backward_chain(chain_p), stream),
             "kda backward chain kernel");
  check_cuda(launch_training_backward(p, stream), "kda training backward kernels");
  // Parameter gradients shaped like their inputs (dt_bias may be a flat [HV*K]).
  return {dq,
          dk,
          dv,
          dg,
          dbeta,
          A_log ? dA_log.view(A_log->sizes()) : at::empty({0}, f32),
          dt_bias ? ddt_bias.view(dt_bias->sizes()) : at::empty({0}, f32),
          dinit};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> training_forward_cuda(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta, const OptTensor& A_log,
    const OptTensor& dt_bias, const Tensor& initial_state, const OptTensor& cu_seqlens, double scale,
    double lower_bound, int64_t gate_mode, bool use_qk_l2norm, bool beta_is_logit) {
  return training_forward_impl("recurrent_kda_training_forward", q, k, v, g, beta, A_log, dt_bias, initial_state,
                               cu_seqlens, scale, lower_bound, {gate_mode, use_qk_l2norm, beta_is_logit});
}

Grads training_backward_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                             const OptTensor& A_log, const OptTensor& dt_bias, const Tensor& tapes,
                             const Tensor& tape_cu_starts, const OptTensor& initial_state, const OptTensor& cu_seqlens,
                             const Tensor& dout, const OptTensor& dfinal_state, double scale, double lower_bound,
                             int64_t gate_mode, bool use_qk_l2norm, bool beta_is_logit) {
  return training_backward_impl("recurrent_kda_training_backward", q, k, v, g, beta, A_log, dt_bias, tapes,
                                tape_cu_starts, initial_state, cu_seqlens, dout, dfinal_state, scale, lower_bound,
                                {gate_mode, use_qk_l2norm, beta_is_logit});
}

Grads backward_cuda(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                    const OptTensor& A_log, const OptTensor& dt_bias, const Tensor& initial_state,
                    const OptTensor& cu_seqlens, const Tensor& dout, const OptTensor& dfinal_state, double scale,
                    double lower_bound, int64_t gate_mode, bool use_qk_l2norm, bool beta_is_logit) {
  const char* op = "recurrent_kda_backward";
  const TrainingModes m{gate_mode, use_qk_l2norm, beta_is_logit};
  auto fwd =
      training_forward_impl(op, q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, m);
  auto grads = training_backward_impl(op, q, k, v, g, beta, A_log, dt_bias, std::get<2>(fwd), std::get<3>(fwd),
                                      initial_state, cu_seqlens, dout, dfinal_state, scale, lower_bound, m);
  // dinitial_state in initial_state's dtype (kda_ops/_fake.py).
  if (initial_state.scalar_type() != at::kFloat)
    std::get<7>(grads) = std::get<7>(grads).to(initial_state.scalar_type());
  return grads;
}

}  // namespace
}  // namespace kda

TORCH_LIBRARY_IMPL(kda, CUDA, m) {
  m.impl("recurrent_kda_training_forward", &kda::training_forward_cuda);
  m.impl("recurrent_kda_training_backward", &kda::training_backward_cuda);
  m.impl("recurrent_kda_backward", &kda::backward_cuda);
}
