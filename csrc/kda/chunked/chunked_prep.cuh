// The prep role (G, 4 warps, one thread per channel) of the chunked kernel: per chunk, the raw q/k/g tiles
// (cp.async ring, kRawStages - 1 chunks ahead) and beta -> the gate's log-decay prefix Γ', the L2 norms, β,
// the decayed operand tiles K⁺, Q⁺, Kr, γ_C of the chain, and the relative-exponent tiles Km, Qm, Kn of the
// solve role (GEMM mode) or L / Mqk themselves (pairwise mode).
//   waits    EMPTY[b] (from chunk kStages on): the chain is done with operand stage b, and so, transitively,
//            the solve role with its G -> W tiles of stage b;
//   releases KREADY[b]: the G -> W tiles and the prep operands of the chunk.
// Its own storage: PrepRaw (the cp.async ring of raw token tiles) and PrepScratch (per-chunk channel values).
#pragma once
#include "kda/chunked/chunked_config.cuh"

namespace kda::prefill {

struct alignas(16) PrepRaw {  // one slot of the cp.async ring
  static constexpr int K = kHeadDim;
  __nv_bfloat16 q[kChunk * K], k[kChunk * K], g[kChunk * K];
};

struct alignas(16) PrepScratch {
  static constexpr int K = kHeadDim;
  alignas(16) float gp[kChunk * K];  // Γ' = Γ - Γ_0
  alignas(16) float e0[K], ecp[K];   // e^{Γ_0}, e^{Γ'_15}
  alignas(16) float a0[K], gc[K];    // Γ_0, Γ'_15
  alignas(16) float rq[kChunk], rk[kChunk];
};

// The gate (gate_a, gate_prefix_of: chunk_math.cuh) works in log2 units, a·log2 e, so that every later
// exponential is one ex2, with fast-math intrinsics: A, Adtb and lb arrive pre-scaled (A log2e,
// A dt_bias log2e, λ log2e).

__device__ __forceinline__ void load8f(const float* p, float (&x)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}

template <class Cfg, bool BWD, class Smem>
__device__ __forceinline__ void chunked_prep(const RecurrentParams& p, Smem& sm, const ChunkedTask<BWD>& task,
                                             const int tid, const int diag) {
  constexpr int kStages = Cfg::kStages, kRawStages = Cfg::kRawStages;
  constexpr int kBarEmpty0 = Cfg::kBarEmpty0, kBarKReady0 = Cfg::kBarKReady0;
  constexpr int K = Cfg::K, NC = Cfg::NC;
  const int hv = task.hv, h = task.h;
  const SeqRange& sr = task.sr;
  const int64_t n_chunks = task.n_chunks;
  const auto phys = [&](int64_t j) { return task.phys(j); };
  const auto chunk_len = [&](int64_t c) { return task.chunk_len(c); };
  const int ptid = tid - NC;
  const int d = ptid;  // the gate channel of this thread
  const bool in_gate = p.gate_mode != GateMode::kPrecomputed;
  const float A = in_gate ? __expf(p.A_log[hv]) : 0.f;
  const float dtb = (in_gate && p.dt_bias != nullptr) ? p.dt_bias[int64_t(hv) * K + d] : 0.f;
  // pre-scaled gate constants (gate_a works in log2 units)
  const float A2 = A * kLog2e;
  const float Adtb = A2 * dtb;
  const float lb2 = p.lower_bound * kLog2e;
  const __nv_bfloat16* src3[3] = {
      static_cast<const __nv_bfloat16*>(p.q.ptr) + sr.batch * p.q.batch_stride + int64_t(h) * p.q.head_stride,
      static_cast<const __nv_bfloat16*>(p.k.ptr) + sr.batch * p.k.batch_stride + int64_t(h) * p.k.head_stride,
      static_cast<const __nv_bfloat16*>(p.g.ptr) + sr.batch * p.g.batch_stride + int64_t(hv) * p.g.head_stride};
  const int64_t stride3[3] = {p.q.token_stride, p.k.token_stride, p.g.token_stride};
  const auto* bsrc =
      static_cast<const __nv_bfloat16*>(p.beta.ptr) + sr.batch * p.beta.batch_stride + int64_t(hv) * p.beta.head_stride;

  // raw q, k, g of chunk c into ring slot c % kRawStages: 3 tiles x 256 pieces of 16 bytes, 6 per thread
  auto issue = [&](int64_t c) {
    if (c < n_chunks) {
      typename Smem::Raw& rb = sm.raw[c % kRawStages];
      __nv_bfloat16* dst3[3] = {rb.q, rb.k, rb.g};
      const int64_t t0 = sr.bos + phys(c) * kChunk;
      const int cl = chunk_len(phys(c));
#pragma unroll
      for (int u = 0; u < 6; ++u) {
        const int which = u >> 1, within = ptid + kPrepThreads * (u & 1), r = within >> 4, pc = within & 15;
        const bool ok = r < cl;
        cp_async_16(dst3[which] + r * K + pc * 8, src3[which] + (t0 + (ok ? r : 0)) * stride3[which] + pc * 8, ok);
      }
    }
    cp_async_commit();
  };
  // raw beta bits of chunk c (threads 0..15); converted one chunk later, so the global load's latency is
  // never waited on
  auto load_beta = [&](int64_t c) {
    __nv_bfloat16 bv = __float2bfloat16_rn(0.f);
    if (ptid < kChunk && c < n_chunks && phys(c) * kChunk + ptid < sr.len)
      bv = bsrc[(sr.bos + phys(c) * kChunk + ptid) * p.beta.token_stride];
    return bv;
  };

#pragma unroll
  for (int c = 0; c < kRawStages - 1; ++c) issue(c);
  __nv_bfloat16 beta_next = load_beta(0);
  for (int64_t j = 0; j < n_chunks; ++j) {
    const int b = static_cast<int>(j % kStages);
    const int cl = chunk_len(phys(j));
    const __nv_bfloat16 beta_raw = beta_next;
    beta_next = load_beta(j + 1);
    // The chain is done with chunk j-kStages' operands (and so, transitively, is W with its G -> W tiles).
    if (j >= kStages) named_sync(kBarEmpty0 + b, Cfg::kCountEmpty);
    cp_async_wait<kRawStages - 2>();
    // raw(j) visible to every G thread, and every G thread is done with chunk j-1 (incl. its raw slot,
    // refilled right below: issuing before this barrier would race with slower threads' reads)
    named_sync(kBarPrep, kPrepThreads);
    issue(j + kRawStages - 1);
    const typename Smem::Raw& rb = sm.raw[j % kRawStages];
    typename Smem::Operands& op = sm.op[b];

    if (diag & kDiagNoPrep) {
      if (ptid == 0) sm.pairwise[b] = 0;
      named_arrive(kBarKReady0 + b, Cfg::kCountKReady);
      continue;
    }
    // ---- P1: gate prefix of channel d, per-channel constants, L2 norms, beta
    float a0 = 0.f, gc = 0.f;
    gate_prefix_of(p.gate_mode, rb.g, sm.prep.gp, d, cl, A2, Adtb, dtb, lb2, a0, gc);
    sm.prep.e0[d] = exp2f(a0);  // (a0, gc, Γ' are in log2 units)
    sm.prep.ecp[d] = exp2f(gc);
    sm.prep.a0[d] = a0;  // the raw exponents, for the pairwise fallback
    sm.prep.gc[d] = gc;
    op.gamma_c[d] = exp2f(a0 + gc);
    const int wide = !(-gc <= kSpanLimit);  // (NaN counts as wide)
    {
      const int row = ptid >> 2, part4 = ptid & 3;  // 32 rows (q then k), 4 threads x 32 elements each
      const __nv_bfloat16* src = row < kChunk ? rb.q + row * K : rb.k + (row - kChunk) * K;
      const float ss = row_sumsq_quad(src, part4, row & 1);
      if (part4 == 0) {
        const float r = p.use_qk_l2norm ? rsqrtf(ss + kL2NormEps) : 1.f;
        if (row < kChunk)
          sm.prep.rq[row] = r * p.scale;
        else
          sm.prep.rk[row - kChunk] = r;
      }
    }
    if (ptid < kChunk) {
      const float x = bf(beta_raw);
      sm.tiles.beta[b][ptid] = ptid < cl ? beta_value(x, p.beta_is_logit) : 0.f;
    }
    const bool pairwise = named_sync_or(kBarPrep, kPrepThreads, wide);

    // ---- P3: decayed operand tiles (2 items of 8 channels per thread)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int idx = ptid + kPrepThreads * u, i = idx >> 4, pc = idx & 15, d0 = pc * 8;
      float gi[8];
      load8f(sm.prep.gp + i * K + d0, gi);
      const uint4 kw = *reinterpret_cast<const uint4*>(rb.k + i * K + d0);
      const uint4 qw = *reinterpret_cast<const uint4*>(rb.q + i * K + d0);
      const uint32_t kws[4] = {kw.x, kw.y, kw.z, kw.w}, qws[4] = {qw.x, qw.y, qw.z, qw.w};
      float kk[8], qq[8];
      const float rk = sm.prep.rk[i], rq = sm.prep.rq[i];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        kk[2 * e] = bf16_lo(kws[e]) * rk, kk[2 * e + 1] = bf16_hi(kws[e]) * rk;
        qq[2 * e] = bf16_lo(qws[e]) * rq, qq[2 * e + 1] = bf16_hi(qws[e]) * rq;
      }
      float kp[8], qp[8], kr[8];
      const int o = swz(i, pc);
      if (!pairwise) {
        float e0v[8], ecv[8], km[8], qm[8], kn[8];
        load8f(sm.prep.e0 + d0, e0v);
        load8f(sm.prep.ecp + d0, ecv);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float ex = exp2f(gi[e]), ei = __fdividef(1.f, ex);  // e^{±Γ'}, Γ' in [-80, 0] (nats)
          km[e] = kk[e] * ex, qm[e] = qq[e] * ex, kn[e] = kk[e] * ei;
          kp[e] = km[e] * e0v[e], qp[e] = qm[e] * e0v[e], kr[e] = kn[e] * ecv[e];
        }
        *reinterpret_cast<uint4*>(sm.tiles.km[b] + o) = pack8_bf16(km);
        *reinterpret_cast<uint4*>(sm.tiles.qm[b] + o) = pack8_bf16(qm);
        *reinterpret_cast<uint4*>(sm.tiles.kn[b] + o) = pack8_bf16(kn);
      } else {
        // exact exponentials of the absolute (<= 0) exponents: Γ_i = a_0 + Γ'_i, Γ_C - Γ_i = Γ'_15 - Γ'_i
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float e1 = exp2f(sm.prep.a0[d0 + e] + gi[e]);
          kp[e] = kk[e] * e1, qp[e] = qq[e] * e1;
          kr[e] = kk[e] * exp2f(sm.prep.gc[d0 + e] - gi[e]);
        }
      }
      *reinterpret_cast<uint4*>(op.kp + o) = pack8_bf16(kp);
      *reinterpret_cast<uint4*>(op.qp + o) = pack8_bf16(qp);
      // |Kr| <= |k̂| <= 1 with the L2 norm: no saturation needed
      if constexpr (BWD)  // bf16: the B operand of dS Krᵀ, whose A (dS) is bf16
        *reinterpret_cast<uint4*>(op.kr + o) = pack8_bf16(kr);
      else
        *reinterpret_cast<uint4*>(op.kr + o) = p.use_qk_l2norm ? pack8_f16_nosat(kr) : pack8_f16(kr);
    }
    if (pairwise) {
      // Exact pairwise exponents on CUDA cores (Γ_i - Γ_j = Γ'_i - Γ'_j), masked entries written as 0
      // and never exponentiated; W then only inverts.
      for (int e = ptid; e < kChunk * kChunk; e += kPrepThreads) {
        const int i = e / kChunk, jj = e % kChunk;
        float l = 0.f, mq = 0.f;
        if (jj <= i) {
          for (int dd = 0; dd < K; ++dd) {
            const float w = exp2f(sm.prep.gp[i * K + dd] - sm.prep.gp[jj * K + dd]) * bf(rb.k[jj * K + dd]);
            l = fmaf(bf(rb.k[i * K + dd]), w, l);
            mq = fmaf(bf(rb.q[i * K + dd]), w, mq);
          }
          l *= sm.prep.rk[i] * sm.prep.rk[jj];
          mq *= sm.prep.rq[i] * sm.prep.rk[jj];
        }
        sm.tiles.ap[b][e] = jj < i ? sm.tiles.beta[b][i] * l : 0.f;
        put16<BWD>(op.mqk, i, jj, mq);
      }
    }
    if (ptid == 0) sm.pairwise[b] = pairwise;
    named_arrive(kBarKReady0 + b, Cfg::kCountKReady);
  }
  // Match the chain's EMPTY arrivals of the last kStages chunks, so no barrier is left half-arrived.
  for (int64_t j = n_chunks > kStages ? n_chunks : kStages; j < n_chunks + kStages; ++j)
    named_sync(kBarEmpty0 + static_cast<int>(j % kStages), Cfg::kCountEmpty);
  cp_async_wait<0>();
}

}  // namespace kda::prefill
