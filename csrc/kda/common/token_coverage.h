// The covered-token rule: which tokens of a packed call some sequence covers, by the kernels' own clamp
// rule (seq_range in recurrent_rules.h: sequence n covers [bos_n, bos_n + len_n)). Shared by the CPU ops,
// the CUDA zeroing kernel of recurrent_kda (zero_uncovered.cu) and the CUDA training backward
// (covered_tokens in kda/backward/backward_params.h), so every path zeroes the same tokens for a valid
// cu_seqlens. Host/device, no torch.
//
// With the caller contract (cu[0] = 0, non-decreasing, cu[N] = T) every token is covered. A broken
// contract can leave tokens uncovered: cu[0] > 0 or cu[N] < T (a prefix / suffix), or a non-monotone cu,
// e.g. cu = [50, 60, 0, 10] with T = 100 covers [50, 60) and [0, 10) and leaves [10, 50) and [60, 100).
#pragma once
#include <cstdint>

#include "kda/host_device.h"
#include "kda/common/recurrent_rules.h"
#include "kda/params.h"

namespace kda {

KDA_HD int64_t seq_end(const SeqRange& r) {
  return r.bos + r.len;
}

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

// A span [lo, hi) of tokens that sequences certainly cover, for kernels that handle the uncovered tokens as
// a prefix and a suffix (the training backward): every token of the fixed layout; packed, [c_0, c_N) with
// c_i = cu_seqlens[i] clamped to [0, T] (seq_range's clamp). Sequence n covers [c_n, c_{n+1}) when
// c_{n+1} > c_n, so every token between c_0 and c_N is crossed by some sequence, even for a non-monotone
// cu_seqlens (which may cover tokens outside the span too). Empty when c_N < c_0. For a non-decreasing
// cu_seqlens the span is exactly the union of the sequences' ranges (ranges_adjoin holds for every n).
struct CoveredTokens {
  int64_t lo, hi;
  KDA_HD bool contains(int64_t t) const { return t >= lo && t < hi; }
};
KDA_HD CoveredTokens covered_span(const void* cu_seqlens, bool cu_seqlens_int64, int64_t T, int64_t N) {
  if (cu_seqlens == nullptr) return {0, T};
  const auto clamped = [&](int64_t i) {
    const int64_t x =
        cu_seqlens_int64 ? static_cast<const int64_t*>(cu_seqlens)[i] : static_cast<const int32_t*>(cu_seqlens)[i];
    return x < 0 ? int64_t(0) : (x > T ? T : x);
  };
  const int64_t lo = clamped(0), hi = clamped(N);
  return hi >= lo ? CoveredTokens{lo, hi} : CoveredTokens{0, 0};
}

}  // namespace kda
