// The solve role (W, one warp) of the chunked kernel: per chunk, L = Km Knᵀ and Mqk = Qm Knᵀ on tensor
// cores (GEMM mode; in pairwise mode prep has formed them), A' = diag(β) strict_tril(L), and the blockwise fp32
// inverse INV = (I + A')^{-1}, stored as INVb = INV diag(β) with Mqk in the chunk's operand stage.
//   waits    KREADY[b]: prep's G -> W tiles (km, qm, kn, beta, pairwise) and its operands of chunk j;
//   releases FULL[b]:   the operand stage b is complete for the chain.
// Its own storage: SolveScratch (the lower diagonal block's inverse, reused every chunk).
#pragma once
#include "kda/chunked/chunked_config.cuh"

namespace kda::prefill {

struct alignas(16) SolveScratch {
  alignas(16) float i2s[8 * 8];  // the lower diagonal block's inverse
};

template <class Cfg, bool BWD, class Smem>
__device__ __forceinline__ void chunked_solve(Smem& sm, const int64_t n_chunks, const int lane, const int diag) {
  constexpr int kStages = Cfg::kStages;
  constexpr int kBarKReady0 = Cfg::kBarKReady0;
  constexpr int K = Cfg::K;
  for (int64_t j = 0; j < n_chunks; ++j) {
    const int b = static_cast<int>(j % kStages);
    named_sync(kBarKReady0 + b, Cfg::kCountKReady);  // G's tiles of chunk j
    typename Smem::Operands& op = sm.op[b];
    float* ap = sm.tiles.ap[b];
    const float* bt = sm.tiles.beta[b];
    if (diag & kDiagNoSolve) {
      named_arrive(kBarFull0 + b, Cfg::kCountFull);
      continue;
    }
    if (!sm.pairwise[b]) {
      // L = Km Knᵀ and Mqk = Qm Knᵀ, interleaved (shared B fragments), even/odd k-steps into separate
      // accumulators (half the dependent HMMA chain)
      const int gq = lane >> 2, cq = lane & 3;
      const TileOffsets toff_a(((lane >> 3) & 1) * 8 + (lane & 7), (lane >> 4) & 1);  // A fragments
      const TileOffsets toff_b(((lane >> 4) & 1) * 8 + (lane & 7), (lane >> 3) & 1);  // B fragments
      float al[2][4] = {}, aq[2][4] = {}, al2[2][4] = {}, aq2[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < K / 16; ++ks) {
        uint32_t fk[4], fq[4], fn[4];
        ldsm_x4(sm.tiles.km[b] + toff_a.at(ks), fk);
        ldsm_x4(sm.tiles.qm[b] + toff_a.at(ks), fq);
        ldsm_x4(sm.tiles.kn[b] + toff_b.at(ks), fn);
        float(&x)[2][4] = (ks & 1) ? al2 : al;
        float(&y)[2][4] = (ks & 1) ? aq2 : aq;
        mma_bf16(x[0], fk, fn[0], fn[1]);
        mma_bf16(x[1], fk, fn[2], fn[3]);
        mma_bf16(y[0], fq, fn[0], fn[1]);
        mma_bf16(y[1], fq, fn[2], fn[3]);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) al[nt][e] += al2[nt][e], aq[nt][e] += aq2[nt][e];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = gq + 8 * (e >> 1), jj = 8 * nt + 2 * cq + (e & 1);
          ap[i * kChunk + jj] = jj < i ? bt[i] * al[nt][e] : 0.f;
          put16<BWD>(op.mqk, i, jj, jj <= i ? aq[nt][e] : 0.f);
        }
      __syncwarp();
    }
    // INVb = (I + A')^{-1} diag(β), blockwise in fp32 (chunk_math.cuh)
    unit_lower_inverse16(ap, sm.solve.i2s, bt, lane, [&](int r, int c, float x) { put16<BWD>(op.invb, r, c, x); });
    named_arrive(kBarFull0 + b, Cfg::kCountFull);  // operands of chunk j are ready
  }
}

}  // namespace kda::prefill
