// The CPU forward of recurrent_kda and of the training forward: the token loop of token_loop.h over every
// (sequence, value head) pair in parallel. Decode, speculative decode and prefill are the same loop. No
// tensors here: csrc/api/recurrent_cpu.cpp and training_cpu.cpp fill RecurrentParams and CpuExtras.
#include <ATen/Parallel.h>

#include <vector>

#include "cpu/token_loop.h"

namespace kda {
namespace cpu {

namespace {

template <typename TokT>
void run_forward_typed(const RecurrentParams& p, const CpuExtras& x) {
  using Acc = acc_t<TokT>;
  // One item = one (sequence, value head) pair: each owns its output columns and state block, so
  // the result does not depend on how the items are split between threads.
  at::parallel_for(0, p.N * p.HV, 1, [&](int64_t begin, int64_t end) {
    HeadContext<TokT> c(p, x);
    std::vector<Acc> S(size_t(p.V) * p.K), o(p.V);
    for (int64_t i = begin; i < end; ++i) {
      c.bind(i / p.HV, static_cast<int>(i % p.HV));
      run_sequence_head(c, S.data(), o.data());
    }
  });
}

}  // namespace

void run_forward(const RecurrentParams& p, const CpuExtras& x) {
  switch (p.token_dtype) {
    case DType::kBFloat16:
      run_forward_typed<c10::BFloat16>(p, x);
      break;
    case DType::kFloat32:
      run_forward_typed<float>(p, x);
      break;
    case DType::kFloat64:
      run_forward_typed<double>(p, x);
      break;
    default:
      TORCH_CHECK_TYPE(false, "q must be bfloat16, float32 or float64 on CPU");
  }
}

}  // namespace cpu
}  // namespace kda
