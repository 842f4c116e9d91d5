// Which output tokens of a packed recurrent_kda call some sequence covers, by the kernels' own clamp rule
// (seq_range in recurrent_rules.h: sequence n covers [bos_n, bos_n + len_n)). Shared by the CPU op and
// the CUDA zeroing kernel (zero_uncovered.cu) so both zero exactly the same tokens. Host/device, no torch.
//
// With the caller contract (cu[0] = 0, non-decreasing, cu[N] = T) every token is covered. A broken
// contract can leave tokens uncovered: cu[0] > 0 or cu[N] < T (a prefix / suffix), or a non-monotone cu,
// e.g. cu = [50, 60, 0, 10] with T = 100 covers [50, 60) and [0, 10) and leaves [10, 50) and [60, 100).
#pragma once
#include <cstdint>

#include "kda/common/host_device.h"
#include "kda/common/recurrent_rules.h"
#include "kda/params.h"

namespace kda {

KDA_HD int64_t seq_end(const SeqRange& r) { return r.bos + r.len; }

// Sequence n (n >= 1) starts where sequence n-1 ends. When this holds for every n the ranges tile one
// interval [bos_0, end_{N-1}) and the uncovered tokens are exactly [0, bos_0) and [end_{N-1}, T).
// By the clamp rule this is cu clamped to [0, T] being non-decreasing; any non-decreasing cu passes.
KDA_HD bool ranges_adjoin(const RecurrentParams& p, int64_t n) {
  return seq_range(p, n).bos == seq_end(seq_range(p, n - 1));
}

// Token t lies in sequence n's range.
KDA_HD bool seq_covers(const RecurrentParams& p, int64_t n, int64_t t) {
  const SeqRange r = seq_range(p, n);
  return t >= r.bos && t < seq_end(r);
}

}  // namespace kda
