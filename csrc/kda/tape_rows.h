// The training tapes' row rule, once for the CPU ops, the CUDA ops and the kernels (kda_ops/_fake.py
// computes the same bounds for the fake kernels; docs/contract.md, API, describes the tapes).
//
// A buffer with one row per `chunk` tokens of every sequence keeps, for a sequence of L tokens,
// max(ceil(L / chunk) - first, 0) rows, at rows starts[n] .. starts[n+1] of a per-sequence prefix:
//   tapes           chunk = kTapeChunk, first = 1: row starts[n] + c - 1 holds the state before token
//                   kTapeChunk * c (c >= 1; the state before token 0 is initial_state, an input of the
//                   backward already);
//   sweep slots     chunk = kTapeChunk, first = 0: one CUDA backward-sweep task per 64-token chunk;
//   chain dS rows   chunk = 16, first = 0: the chain gradient at the end of every 16-token chunk.
// Host/device, no torch.
#pragma once
#include <cstdint>

#include "kda/host_device.h"

namespace kda {

// Tokens per tape chunk: the tapes hold the state before every kTapeChunk-token chunk of each sequence.
constexpr int kTapeChunk = 64;

// Rows of one sequence of `len` tokens: max(ceil(len / chunk) - first, 0).
KDA_HD int64_t chunk_rows(int64_t len, int64_t chunk, int64_t first) {
  const int64_t r = (len + chunk - 1) / chunk - first;
  return r > 0 ? r : 0;
}

// Tape rows of one sequence of `len` tokens.
KDA_HD int64_t tape_rows_of(int64_t len) {
  return chunk_rows(len, kTapeChunk, 1);
}

// An upper bound from shapes alone (no host read of cu_seqlens) on the rows of all sequences, the size the
// ops allocate: fixed layout (B sequences of T tokens) exactly B chunk_rows(T); packed (T tokens in N
// sequences) T / chunk + N for first = 0 and T / chunk for the tapes (first = 1: a sequence of L tokens keeps
// at most floor(L / chunk) rows, and the floors sum to at most T / chunk).
KDA_HD int64_t chunk_rows_bound(bool packed, int64_t B, int64_t T, int64_t N, int64_t chunk) {
  return packed ? T / chunk + N : B * chunk_rows(T, chunk, 0);
}
KDA_HD int64_t tape_rows_bound(bool packed, int64_t B, int64_t T) {
  return packed ? T / kTapeChunk : B * tape_rows_of(T);
}

// The tape row of the state before token kTapeChunk * c (c >= 1) of sequence n, from the row prefix.
KDA_HD int64_t tape_row(const int64_t* tape_cu_starts, int64_t n, int64_t c) {
  return tape_cu_starts[n] + c - 1;
}

}  // namespace kda
