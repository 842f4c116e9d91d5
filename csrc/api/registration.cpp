// Every schema of the kda library, declared once. Implementations register per dispatch key in
// csrc/api/*_cpu.cpp (CPU) and csrc/api/*_cuda.cpp (CUDA); fake kernels live in kda_ops/_fake.py and
// autograd in kda_ops/_autograd.py. Argument meaning, shapes and dtypes: docs/contract.md (API, Slots) and the
// docstrings of kda_ops/interface.py.
// The Python module that loads this library: csrc/api/python_module.cpp.
#include <torch/library.h>

TORCH_LIBRARY(kda, m) {
  // Inference: decode (T=1), speculative decode (1+S tokens), prefill (any T), fixed or packed.
  // Writes `output`, the state pool `state` (in place, its own dtype), `final_state` (fp32, only when
  // `state` is None), and `state_checkpoints`. A 1-D empty `output` makes a state-only call: no outputs
  // (the chunked kernel skips the output product; the sequence split's end-state passes). gate_mode: 0 precomputed, 1
  // softplus, 2 lower bound. backend: 0 auto, 1 chunked, 2 recurrent. A_log is [HV] fp32 and dt_bias [HV, K] fp32 here
  // (the Python layer expands per-q/k-head parameters). zero_uncovered: also write zeros to the packed tokens outside
  // every sequence (a broken cu_seqlens contract; by the clamp rule of kda::seq_range), for an `output` the Python
  // layer allocated itself; False leaves those tokens of a caller's buffer as they were. disable_state_update
  // (speculative verify): the outputs of every token as usual, by the same slot and activity rules, but no pool slot of
  // `state` is written (no final write, no per-token spec columns); final_state and state_checkpoints (caller buffers,
  // not pool slots) are written as usual.
  m.def(
      "recurrent_kda(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor(a!)? state, Tensor? state_source, Tensor? initial_state_indices, Tensor? cu_seqlens, "
      "Tensor? ssm_state_indices, Tensor? num_accepted_tokens, Tensor? seq_order, Tensor(b!) output, "
      "Tensor(c!)? final_state, Tensor(d!)? state_checkpoints, Tensor? checkpoint_cu_starts, "
      "Tensor(e!)? workspace, float scale, int gate_mode, float lower_bound, bool use_qk_l2norm, "
      "bool beta_is_logit, int num_spec_tokens, int checkpoint_every_n_tokens, int backend, "
      "bool zero_uncovered=False, bool disable_state_update=False) -> ()");

  // The decode-shaped subset of recurrent_kda with a short schema, for the eager hot path: a call from
  // Python converts every schema argument to an IValue and checks it against the schema, ~0.4 us an
  // argument, so the 29 arguments above cost more host time than the op's own checks and launch. Same
  // kernels and checks as recurrent_kda with no state_source, initial_state_indices, cu_seqlens, seq_order,
  // final_state, checkpoints or workspace, zero_uncovered False. `decode_flags` packs the small arguments:
  // bits 0-1 gate_mode, bit 2 use_qk_l2norm, bit 3 beta_is_logit, bit 4 disable_state_update, bits 8-15
  // backend, bits 16-31 num_spec_tokens (recurrent_params.h, unpack_decode_mode).
  m.def(
      "recurrent_kda_decode(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor(a!)? state, Tensor? ssm_state_indices, Tensor? num_accepted_tokens, Tensor(b!) output, "
      "float scale, float lower_bound, int decode_flags) -> ()");

  // Training forward (functional). gate_mode, use_qk_l2norm and beta_is_logit as in recurrent_kda (appended
  // with the defaults of the original training contract: lower-bound gate, L2 norm on, logit beta, so older
  // callers keep working). A_log must be None for the precomputed gate and a tensor otherwise; dt_bias may be
  // None (0) with a gate; lower_bound is read by the lower-bound gate only. Returns the output, the
  // final state per sequence, and the tapes: the state before every kTapeChunk(=64)-token chunk of
  // every sequence but the first ([rows, HV, V, K], rows = an upper bound from shapes, see _fake.py; the state
  // before token 0 is initial_state) with tape_cu_starts int64 [N+1] giving each sequence's first row.
  m.def(
      "recurrent_kda_training_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, "
      "Tensor? dt_bias, Tensor initial_state, Tensor? cu_seqlens, float scale, float lower_bound, "
      "int gate_mode=2, bool use_qk_l2norm=True, bool beta_is_logit=True) -> "
      "(Tensor out, Tensor final_state, Tensor tapes, Tensor tape_cu_starts)");

  // Training backward from the tapes and the initial state (None: zeros): the eight gradients of docs/contract.md,
  // Recurrence (the backward), in that order; the mode arguments as in the forward. dA_log / ddt_bias are empty
  // ([0]) when A_log / dt_bias is None (the Python layer returns None for them).
  m.def(
      "recurrent_kda_training_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, "
      "Tensor? dt_bias, Tensor tapes, Tensor tape_cu_starts, Tensor? initial_state, Tensor? cu_seqlens, "
      "Tensor do, Tensor? dfinal_state, float scale, float lower_bound, int gate_mode=2, "
      "bool use_qk_l2norm=True, bool beta_is_logit=True) -> "
      "(Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor dA_log, Tensor ddt_bias, "
      "Tensor dinitial_state)");

  // Backward from the raw inputs (no context): the same eight gradients, the same mode arguments.
  m.def(
      "recurrent_kda_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, "
      "Tensor? dt_bias, Tensor initial_state, Tensor? cu_seqlens, Tensor do, Tensor? dfinal_state, "
      "float scale, float lower_bound, int gate_mode=2, bool use_qk_l2norm=True, bool beta_is_logit=True) -> "
      "(Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor dA_log, Tensor ddt_bias, "
      "Tensor dinitial_state)");

  // The differentiable core of kda_ops.kda: the arguments and results of recurrent_kda_training_forward /
  // recurrent_kda_training_backward, with one difference: each routes internally (the routing spine's split route:
  // the exact sequence split, or one call of the training op), so torch.compile, autograd and FSDP see this one op
  // pair whatever the route. Their kernels are Python compositions of the ops here (kda_ops/_autograd.py; autograd
  // through register_autograd on kda_forward); the tapes are in the unsplit layout either way, so the backward may
  // take a route of its own.
  m.def(
      "kda_forward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor initial_state, Tensor? cu_seqlens, float scale, float lower_bound, int gate_mode=2, "
      "bool use_qk_l2norm=True, bool beta_is_logit=True) -> "
      "(Tensor out, Tensor final_state, Tensor tapes, Tensor tape_cu_starts)");
  m.def(
      "kda_backward(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor? A_log, Tensor? dt_bias, "
      "Tensor tapes, Tensor tape_cu_starts, Tensor? initial_state, Tensor? cu_seqlens, Tensor do, "
      "Tensor? dfinal_state, float scale, float lower_bound, int gate_mode=2, bool use_qk_l2norm=True, "
      "bool beta_is_logit=True) -> "
      "(Tensor dq, Tensor dk, Tensor dv, Tensor dg, Tensor dbeta, Tensor dA_log, Tensor ddt_bias, "
      "Tensor dinitial_state)");

  // The exact sequence split's scan of segment start states (kda_ops/_split.py): S, Q [J, batch, V, K], P
  // [J, batch, K, K], one dtype (CUDA: fp32, K <= 128), contiguous; for j = first .. J-1 in order,
  // S[j] = S[j-1] P[j-1] + Q[j-1] (S[0 .. first) are inputs). One launch on CUDA.
  m.def("segment_state_scan(Tensor(a!) S, Tensor Q, Tensor P, int first) -> ()");
  // The same over packed segments (a split planned on the device): S, Q [segments, HV, V, K], P [segments, HV,
  // K, K]; sequence n owns segments seg_first[n] .. + seg_count[n] - 1 (int64 [N], on S's device); per sequence
  // of two or more segments S[f + 1] = Q[f], then S[f + j] = S[f + j - 1] P[f + j - 1] + Q[f + j - 1]; `final`
  // [N, HV, V, K] (optional): each sequence's end state, the same step once more (Q[f] for one segment).
  m.def(
      "segment_state_scan_packed(Tensor(a!) S, Tensor Q, Tensor P, Tensor seg_first, Tensor seg_count, "
      "Tensor(b!)? final=None) -> ()");
  // The one-pass split's output fix-up: for each segment s with rows[s] >= 0, its tokens t (seg_cu[s] ..
  // seg_cu[s + 1], at most max_segment_tokens) get out[t, h] += A[t, h] S[rows[s], h]ᵀ (out [T, HV, V], A [T, HV, K]
  // one dtype (CUDA: bf16, K and V multiples of 16 up to 128), S [slots', HV, V, K] (CUDA: fp32)).
  m.def(
      "segment_output_fixup(Tensor(a!) out, Tensor A, Tensor S, Tensor seg_cu, Tensor rows, int max_segment_tokens) "
      "-> ()");
}
