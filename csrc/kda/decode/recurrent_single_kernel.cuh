// Token-serial KDA kernel, one item per warp (selected by KDA_RECURRENT_SINGLE in the launcher): the
// latency path for small batches (B=1 decode: 32 heads x a few tiles, fewer items than the SMs' warps).
//
// Same tile, lane layout and token math as kda_recurrent_kernel (both call run_item_tokens, so results are
// bit-identical). With one item per warp the persistent ring buys nothing and its chain is long (slot
// lookup -> cp.async of the state -> wait -> token loads -> math). Here a warp (item = global warp index,
// a plain grid, no shared memory) issues, in this order and without waiting in between:
//   its first token's q, k, g, v, beta loads, A_log, an L1 prefetch of dt_bias (independent of the slot),
//   the slot lookup (ssm_state_indices / cu_seqlens / num_accepted_tokens, every lane the same address),
//   the state loads straight into registers (they depend on the slot only),
// so the token loads overlap the slot -> state chain, and the per-token prep (L2 norms, gate, decay, beta
// sigmoid; it reads no state) can run while the state is in flight. Chain: max(slot -> state, tokens ->
// prep) -> state math -> store.
// Correct for any size (a grid of one warp per item); the launcher uses it only when the items fit the
// resident warps (or when forced, for tests).
#pragma once
#include "kda/decode/recurrent_kernel.cuh"

namespace kda::decode {

template <class Tile>
__global__ void __launch_bounds__(128) kda_recurrent_single_kernel(const RecurrentParams p, const int flags) {
  using StateT = typename Tile::StateT;
  constexpr int K = Tile::K, NR = Tile::NR, KL = Tile::KL, RP = Tile::RP;
  const int lane = threadIdx.x & 31;
  const int64_t item = int64_t(blockIdx.x) * (blockDim.x >> 5) + (threadIdx.x >> 5);
  const int64_t total = p.N * p.HV * Tile::kTilesPerHead;
  ItemMeta m{};
  {
    int tile, hv;
    int64_t n;
    if (item >= total || !decode_item(p, item, Tile::kTilesPerHead, tile, hv, n)) return;  // warp-uniform
    const SeqRange sr = seq_range(p, n);
    m.bos = sr.bos, m.len = sr.len, m.batch = static_cast<int32_t>(sr.batch);
    m.n = static_cast<int32_t>(n), m.tile = tile, m.hv = hv;
  }
  const int kl = lane % KL, rg = lane / KL;
  const int my_idx = rs_row_index<KL, NR>(lane);
  const int row0 = m.tile * Tile::kRowsPerWarp;
  const int my_row = row0 + my_idx * RP + rg;
  const int h = m.hv / (p.HV / p.H);
  const int64_t head_off = int64_t(m.hv) * K * K;
  const int S = p.num_spec_tokens;

  // 1. slot-independent loads: the first token's inputs and the gate constant.
  TokenRaw cur;
  if (m.len > 0) load_token<Tile>(p, m.batch, m.bos, h, m.hv, kl, my_row, cur);
  const float alog = p.gate_mode != GateMode::kPrecomputed ? __ldg(p.A_log + m.hv) : 0.f;
  // dt_bias is read per token inside run_item_tokens with plain loads that cannot move above its stores:
  // pull its row into L1 now, so the first token's gate does not wait on an L2 round trip.
  if (p.dt_bias != nullptr && p.gate_mode != GateMode::kPrecomputed && lane < K / 32)
    prefetch_l1(p.dt_bias + int64_t(m.hv) * K + lane * 32);  // 128-byte lines

  // 2. the slot lookups (the shared rules), then 3. the state, straight into registers.
  const StartState st = start_state(p, m.n);
  m.kind = st.kind, m.slot = st.slot;
  int32_t spec_slot = -1;  // lane t holds the write slot of token t (t <= S < 32)
  if (m.kind >= 0 && m.len > 0 && S > 0 && S < 32 && lane <= S)
    spec_slot = p.ssm_state_indices[int64_t(m.n) * (S + 1) + lane];
  float s[NR][8];
  if (m.kind == 1 && m.len > 0) {
    load_tile<Tile>(static_cast<const StateT*>(p.state) + m.slot * p.state_slot_stride + head_off, row0, rg, kl, s);
  } else if (m.kind == 2) {
    load_tile_dt<Tile>(p.state_source, p.state_source_dtype, m.slot * p.source_slot_stride + head_off, row0, rg, kl,
                       s);
  } else {
#pragma unroll
    for (int i = 0; i < NR; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) s[i][e] = 0.f;
  }

  if (m.kind < 0) {
    // Inactive sequence: zero output, no state read or write (as kda_recurrent_kernel).
    if ((lane & rs_duplicate_bits<KL, NR>()) == 0) {
      uint16_t* out = static_cast<uint16_t*>(p.out) + int64_t(m.batch) * p.out_batch_stride +
                      int64_t(m.hv) * p.out_head_stride + my_row;
      for (int64_t t = 0; t < m.len; ++t) out[(m.bos + t) * p.out_token_stride] = 0;
    }
    return;
  }
  const float A = p.gate_mode != GateMode::kPrecomputed ? __expf(alog) : 0.f;
  const float* dtb = p.dt_bias != nullptr ? p.dt_bias + int64_t(m.hv) * K : nullptr;
  run_item_tokens<Tile>(p, flags, m, lane, cur, spec_slot, A, dtb, s);

  // A zero-length sequence leaves its slot bit-identical; a non-speculative pool item (kind 1) writes the
  // slot it read (m.slot == write_slot(p, n, 0)).
  if (S == 0 && p.state != nullptr && m.len > 0 && !(flags & kDiagNoStateStore))
    store_tile<Tile>(static_cast<StateT*>(p.state) +
                         (m.kind == 1 ? m.slot : write_slot(p, m.n, 0)) * p.state_slot_stride + head_off,
                     row0, rg, kl, s);
  if (p.final_state != nullptr)
    store_tile<Tile>(p.final_state + int64_t(m.n) * int64_t(p.HV) * K * K + head_off, row0, rg, kl, s);
}

template <int K, typename StateT, int NR>
void run_recurrent_single_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream) {
  using Tile = RecurrentTile<K, StateT, NR>;
  const int64_t warps = p.N * p.HV * Tile::kTilesPerHead;
  const int64_t blocks = (warps + cfg.warps_per_block - 1) / cfg.warps_per_block;
  kda_recurrent_single_kernel<Tile>
      <<<dim3(static_cast<unsigned>(blocks)), cfg.warps_per_block * 32, 0, stream>>>(p, cfg.flags);
}

}  // namespace kda::decode
