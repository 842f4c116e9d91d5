// The chain role (NW warps, 16 value rows of the state each) of the chunked kernel: the state S[V, K] of
// the CTA's value rows lives in the warps' mma accumulator registers for the whole sequence; per chunk
//   forward (BWD = false): [Xᵀ | O_interᵀ] = S [K⁺ ; Q⁺]ᵀ, Yᵀ = Vᵀ - Xᵀ, Rᵀ = Yᵀ INVbᵀ,
//                          Oᵀ = O_interᵀ + Rᵀ Mqkᵀ (to the epilogue), S = S ⊙ γ_C + Rᵀ Kr;
//   backward chain (BWD):  dRᵀ = dS Krᵀ + dOᵀ Mqk, dXᵀ = -dRᵀ INVb, dS = dS ⊙ γ_C + dOᵀ Q⁺ + dXᵀ K⁺.
//   waits    FULL[b]:  the operand stage b of the chunk (prep and solve), and its own cp.async copies of v
//            (dO in the backward chain), kRawStages - 1 chunks ahead;
//   releases EMPTY[b]: the operand stage b, for prep's chunk j + kStages.
// Its own storage: ChainStorage (each warp's v ring and output staging tile). Checkpoints, the output and
// the final state leave through chunked_epilogue.cuh.
#pragma once
#include "kda/chunked/chunked_config.cuh"
#include "kda/chunked/chunked_epilogue.cuh"

namespace kda::prefill {

template <int VB, int kRawStages>
struct alignas(16) ChainStorage {  // per warp: v of the ring's chunks and the output staging tile
  alignas(16) __nv_bfloat16 vbuf[VB / 16][kRawStages][kChunk * 16];
  alignas(16) __nv_bfloat16 ostage[VB / 16][kChunk * 16];
};

// kOut = false (the state-only forward kernel, p.out null: the sequence split's end-state passes): the
// output product O = S Q⁺ᵀ + R Mqkᵀ and its store are left out; the state path is the same arithmetic.
template <class Cfg, bool BWD, bool kOut = true, class Smem>
__device__ __forceinline__ void chunked_chain(const RecurrentParams& p, Smem& sm, const ChunkedTask<BWD>& task,
                                              const int lane, const int warp, const bool out_vec16, const int diag) {
  constexpr int kStages = Cfg::kStages, kRawStages = Cfg::kRawStages;
  constexpr int kBarEmpty0 = Cfg::kBarEmpty0;
  constexpr int K = Cfg::K;
  const int64_t n = task.n;
  const int hv = task.hv;
  const SeqRange& sr = task.sr;
  const StartState& st = task.st;
  const int64_t head_off = task.head_off, inner = task.inner, n_chunks = task.n_chunks;
  const auto phys = [&](int64_t j) { return task.phys(j); };
  const auto chunk_len = [&](int64_t c) { return task.chunk_len(c); };
  const int v0 = task.part * Cfg::VB + warp * 16;  // a chain warp's first value row
  const auto out_row = [&](int64_t t) { return chunked_out_row(p, sr, hv, v0, t); };

  const int gq = lane >> 2, cq = lane & 3;  // mma fragment coordinates: row group, column pair

  // start state into the accumulator layout: s[nt][e] = S[v0 + gq + 8 (e >= 2)][8 nt + 2 cq + (e & 1)]
  float s[K / 8][4];
  {
    const void* base = nullptr;
    DType dt = DType::kFloat32;
    int64_t off = 0;
    if (st.kind == 1 && sr.len > 0) base = p.state, dt = p.state_dtype, off = st.slot * p.state_slot_stride;
    if (st.kind == 2) base = p.state_source, dt = p.state_source_dtype, off = st.slot * p.source_slot_stride;
#pragma unroll
    for (int nt = 0; nt < K / 8; ++nt)
#pragma unroll
      for (int hr = 0; hr < 2; ++hr) {
        float x0 = 0.f, x1 = 0.f;
        if (base != nullptr) {
          const int64_t e = off + head_off + int64_t(v0 + gq + 8 * hr) * K + 8 * nt + 2 * cq;
          if (dt == DType::kBFloat16) {
            const __nv_bfloat162 w =
                *reinterpret_cast<const __nv_bfloat162*>(static_cast<const __nv_bfloat16*>(base) + e);
            x0 = __low2float(w), x1 = __high2float(w);
          } else {
            const float2 w = *reinterpret_cast<const float2*>(static_cast<const float*>(base) + e);
            x0 = w.x, x1 = w.y;
          }
        }
        s[nt][2 * hr] = x0, s[nt][2 * hr + 1] = x1;
      }
  }
  auto store_state = [&](void* base, DType dt, int64_t off) {
    store_state_regs<K>(s, base, dt, off, head_off, v0, gq, cq);
  };

  const int every = p.checkpoint_every_n_tokens;
  const int64_t ckpt_row0 = every > 0 ? p.checkpoint_cu_starts[n] : 0;
  // this warp's 16 columns of v, kRawStages - 1 chunks ahead: lane -> (token lane / 2, 8 columns (lane & 1) * 8)
  const auto* vsrc = static_cast<const __nv_bfloat16*>(p.v.ptr) + sr.batch * p.v.batch_stride +
                     int64_t(hv) * p.v.head_stride + v0 + (lane & 1) * 8;
  auto issue_v = [&](int64_t c) {  // (dO in the backward chain)
    if (c < n_chunks) {
      const int t = lane >> 1;
      const int64_t pc = phys(c);
      const bool ok = pc * kChunk + t < sr.len;
      cp_async_16(&sm.chain.vbuf[warp][c % kRawStages][t * 16 + (lane & 1) * 8],
                  vsrc + (sr.bos + (ok ? pc * kChunk + t : 0)) * p.v.token_stride, ok);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int c = 0; c < kRawStages - 1; ++c) issue_v(c);
  // this lane's ldmatrix offsets: B fragments of K⁺/Q⁺ (n = token rows), transposed B fragments of Kr
  const TileOffsets toff_b(((lane >> 4) & 1) * 8 + (lane & 7), (lane >> 3) & 1);
  const TileOffsets toff_t(((lane >> 3) & 1) * 8 + (lane & 7), (lane >> 4) & 1);

  for (int64_t c = 0; c < n_chunks; ++c) {
    const int b = static_cast<int>(c % kStages);
    const int64_t t0 = phys(c) * kChunk;  // chunk start within the sequence
    const int cl = chunk_len(phys(c));
    __syncwarp();  // every lane is done with the v slot refilled below (chunk c - 1's)
    issue_v(c + kRawStages - 1);

    if constexpr (BWD) {
      // dS at the end of every `every`-token chunk j (the sequence's last 16-token chunk ends the last one): row
      // checkpoint_cu_starts[n] + j, written when the walk enters that chunk's last 16-token chunk.
      if (every > 0) {
        const int64_t sub = every / kChunk, pc = t0 / kChunk;
        if ((pc + 1) % sub == 0 || pc == n_chunks - 1) {
          const int64_t row = ckpt_row0 + pc / sub;
          if (row >= 0 && row < p.n_checkpoint_rows) store_state(p.state_checkpoints, p.checkpoint_dtype, row * inner);
        }
      }
    } else if (every > 0 && t0 % every == 0 && t0 / every >= p.checkpoint_first) {
      // Checkpoint: the state BEFORE token t0 (t0 a multiple of the interval, itself a multiple of 16).
      const int64_t row = ckpt_row0 + t0 / every - p.checkpoint_first;
      if (row >= 0 && row < p.n_checkpoint_rows) store_state(p.state_checkpoints, p.checkpoint_dtype, row * inner);
    }
    cp_async_wait<kRawStages - 1>();
    __syncwarp();
    named_sync(kBarFull0 + b, Cfg::kCountFull);  // the operands of chunk c
    const typename Smem::Operands& op = sm.op[b];
    const __nv_bfloat16* vb = sm.chain.vbuf[warp][c % kRawStages];
    if (diag & kDiagNoChain) {
      named_arrive(kBarEmpty0 + b, Cfg::kCountEmpty);
      continue;
    }
    if constexpr (BWD) {
      // A operand dOᵀ [16 value rows][16 tokens] from this warp's dO tile vb[t][v] (bf16 pairs along t)
      const auto pk = [&](int vr, int t) {
        __nv_bfloat162 w;
        w.x = vb[t * 16 + vr], w.y = vb[(t + 1) * 16 + vr];
        return *reinterpret_cast<uint32_t*>(&w);
      };
      const uint32_t oa[4] = {pk(gq, 2 * cq), pk(gq + 8, 2 * cq), pk(gq, 2 * cq + 8), pk(gq + 8, 2 * cq + 8)};
      // ---- dRᵀ = dS Krᵀ + dOᵀ Mqk (op.mqk holds Mqkᵀ)
      float ax[2][4], ax2[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ax[nt][e] = 0.f, ax2[nt][e] = 0.f;
      {
        uint32_t bm[4];
        load_b16x16(op.mqk, lane, bm);
        mma_bf16(ax2[0], oa, bm[0], bm[1]);
        mma_bf16(ax2[1], oa, bm[2], bm[3]);
        uint32_t bk[2][4];
        ldsm_x4(op.kr + toff_b.at(0), bk[0]);
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) {
          const int cur = ks & 1;
          if (ks + 1 < K / 16) ldsm_x4(op.kr + toff_b.at(ks + 1), bk[cur ^ 1]);
          const uint32_t a[4] = {pack_bf16x2(s[2 * ks][0], s[2 * ks][1]), pack_bf16x2(s[2 * ks][2], s[2 * ks][3]),
                                 pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                 pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
          float(&x)[2][4] = cur ? ax2 : ax;
          mma_bf16(x[0], a, bk[cur][0], bk[cur][1]);
          mma_bf16(x[1], a, bk[cur][2], bk[cur][3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ax[nt][e] += ax2[nt][e];
      }
      // ---- dXᵀ = -dRᵀ INVb (op.invb holds INVbᵀ)
      float ar[2][4];
      {
        const uint32_t ya[4] = {pack_bf16x2(ax[0][0], ax[0][1]), pack_bf16x2(ax[0][2], ax[0][3]),
                                pack_bf16x2(ax[1][0], ax[1][1]), pack_bf16x2(ax[1][2], ax[1][3])};
        uint32_t bi[4];
        load_b16x16(op.invb, lane, bi);
#pragma unroll
        for (int e = 0; e < 4; ++e) ar[0][e] = 0.f, ar[1][e] = 0.f;
        mma_bf16(ar[0], ya, bi[0], bi[1]);
        mma_bf16(ar[1], ya, bi[2], bi[3]);
      }
      const uint32_t xa[4] = {pack_bf16x2(-ar[0][0], -ar[0][1]), pack_bf16x2(-ar[0][2], -ar[0][3]),
                              pack_bf16x2(-ar[1][0], -ar[1][1]), pack_bf16x2(-ar[1][2], -ar[1][3])};
      // ---- dS = dS ⊙ γ_C + dOᵀ Q⁺ + dXᵀ K⁺
#pragma unroll
      for (int pp = 0; pp < K / 16; ++pp) {
        uint32_t bq[4], bk[4];
        ldsm_x4_t(op.qp + toff_t.at(pp), bq);
        ldsm_x4_t(op.kp + toff_t.at(pp), bk);
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const int nt = 2 * pp + hh;
          const float2 gmm = *reinterpret_cast<const float2*>(op.gamma_c + 8 * nt + 2 * cq);
          s[nt][0] *= gmm.x, s[nt][1] *= gmm.y, s[nt][2] *= gmm.x, s[nt][3] *= gmm.y;
          mma_bf16(s[nt], oa, bq[2 * hh], bq[2 * hh + 1]);
          mma_bf16(s[nt], xa, bk[2 * hh], bk[2 * hh + 1]);
        }
      }
    } else {
      // ---- [Xᵀ | O_interᵀ] = S [K⁺ ; Q⁺]ᵀ and Yᵀ = Vᵀ - Xᵀ
      // Two accumulator sets (even / odd k-steps) halve the dependent HMMA chain; the B fragments of step
      // ks + 1 are loaded before the HMMAs of step ks (ldmatrix and mma are ordered asm).
      float ax[2][4], ao[2][4], ax2[2][4], ao2[2][4];
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) ax[nt][e] = 0.f, ao[nt][e] = 0.f, ax2[nt][e] = 0.f, ao2[nt][e] = 0.f;
      {
        uint32_t bk[2][4], bq[2][4];
        ldsm_x4(op.kp + toff_b.at(0), bk[0]);
        if constexpr (kOut) ldsm_x4(op.qp + toff_b.at(0), bq[0]);
#pragma unroll
        for (int ks = 0; ks < K / 16; ++ks) {
          const int cur = ks & 1;
          if (ks + 1 < K / 16) {
            ldsm_x4(op.kp + toff_b.at(ks + 1), bk[cur ^ 1]);
            if constexpr (kOut) ldsm_x4(op.qp + toff_b.at(ks + 1), bq[cur ^ 1]);
          }
          const uint32_t a[4] = {pack_bf16x2(s[2 * ks][0], s[2 * ks][1]), pack_bf16x2(s[2 * ks][2], s[2 * ks][3]),
                                 pack_bf16x2(s[2 * ks + 1][0], s[2 * ks + 1][1]),
                                 pack_bf16x2(s[2 * ks + 1][2], s[2 * ks + 1][3])};
          float(&x)[2][4] = cur ? ax2 : ax;
          float(&o)[2][4] = cur ? ao2 : ao;
          mma_bf16(x[0], a, bk[cur][0], bk[cur][1]);
          mma_bf16(x[1], a, bk[cur][2], bk[cur][3]);
          if constexpr (kOut) {
            mma_bf16(o[0], a, bq[cur][0], bq[cur][1]);
            mma_bf16(o[1], a, bq[cur][2], bq[cur][3]);
          }
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) ax[nt][e] += ax2[nt][e], ao[nt][e] += ao2[nt][e];
      }
      // Yᵀ[v][t] = V[t][v] - Xᵀ[v][t] (padding rows: V = 0 and K⁺ = 0, so Y = 0)
#pragma unroll
      for (int nt = 0; nt < 2; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int vr = gq + 8 * (e >> 1), t = 8 * nt + 2 * cq + (e & 1);
          ax[nt][e] = bf(vb[t * 16 + vr]) - ax[nt][e];
        }

      // ---- Rᵀ = Yᵀ INVbᵀ; Oᵀ += Rᵀ Mqkᵀ; S = S ⊙ γ_C + Rᵀ Kr
      float ar[2][4];
      {
        const uint32_t ya[4] = {pack_f16(ax[0][0], ax[0][1]), pack_f16(ax[0][2], ax[0][3]),
                                pack_f16(ax[1][0], ax[1][1]), pack_f16(ax[1][2], ax[1][3])};
        uint32_t bi[4];
        load_b16x16(op.invb, lane, bi);
#pragma unroll
        for (int e = 0; e < 4; ++e) ar[0][e] = 0.f, ar[1][e] = 0.f;
        mma_f16(ar[0], ya, bi[0], bi[1]);
        mma_f16(ar[1], ya, bi[2], bi[3]);
      }
      const uint32_t ra[4] = {pack_f16(ar[0][0], ar[0][1]), pack_f16(ar[0][2], ar[0][3]), pack_f16(ar[1][0], ar[1][1]),
                              pack_f16(ar[1][2], ar[1][3])};
      if constexpr (kOut) {
        uint32_t bm[4];
        load_b16x16(op.mqk, lane, bm);
        mma_f16(ao[0], ra, bm[0], bm[1]);
        mma_f16(ao[1], ra, bm[2], bm[3]);
        store_output_tile(sm.chain.ostage[warp], ao, lane, gq, cq, cl, sr.bos + t0, out_row, out_vec16);
      }
      {
#pragma unroll
        for (int pp = 0; pp < K / 16; ++pp) {
          uint32_t bb[4];
          ldsm_x4_t(op.kr + toff_t.at(pp), bb);
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const int nt = 2 * pp + hh;
            const float2 gmm = *reinterpret_cast<const float2*>(op.gamma_c + 8 * nt + 2 * cq);
            s[nt][0] *= gmm.x, s[nt][1] *= gmm.y, s[nt][2] *= gmm.x, s[nt][3] *= gmm.y;
            mma_f16(s[nt], ra, bb[2 * hh], bb[2 * hh + 1]);
          }
        }
      }
    }  // (forward)
    named_arrive(kBarEmpty0 + b, Cfg::kCountEmpty);  // done with chunk c's operands
  }
  cp_async_wait<0>();

  if (p.state != nullptr && sr.len > 0) store_state(p.state, p.state_dtype, write_slot(p, n, 0) * p.state_slot_stride);
  if (p.final_state != nullptr) store_state(p.final_state, DType::kFloat32, n * inner);
}

}  // namespace kda::prefill
