// Token-serial KDA kernel, warp-specialised variant (sm_90+): the launcher's default on bandwidth-bound
// grids for bf16 tiles and for fp32 tiles at K=128 (the 4-rows tile, 4 KB of state per stage as the bf16
// 8-rows tile); KDA_DECODE_KERNEL=ring forces it, =serial turns it off.
//
// Why: in kda_recurrent_kernel every warp runs its items' chain serially (slot lookup -> state copy ->
// token loads -> math -> store) and hides the latency only by having other warps in flight. A bf16 item
// carries half the bytes of an fp32 one for the same chain, so at 12 warps per SM the chain's latency is no
// longer covered and bf16 decode stays near 2.9 TB/s. Here the memory side runs ahead of the math:
//
//  * a block is one producer warp and kMathWarps math warps. Lane w of the producer warp feeds math warp w
//    (the lanes issue in step: they meet after their stage waits, see the producer loop):
//    it resolves the warp's items (sequence range, start slot, write slot: the shared rules of
//    recurrent_rules.h) two items ahead in registers, loads the per-item scalars (beta, A_log) one item
//    ahead, and for each item issues 1-D bulk copies (cp.async.bulk ... mbarrier::complete_tx, the TMA
//    unit) of the start-state tile, the first token's q, k, g rows, the tile's v values and dt_bias[hv]
//    into one stage of the warp's ring (the token copies first: their addresses do not wait for the slot
//    lookup), announcing each group's bytes on the stage's "full" mbarrier, then writes the item's metadata
//    into the stage and arrives;
//  * a math warp waits on "full", reads everything from shared memory (no global load between the wait and
//    the math for a decode item), runs the tokens with the same code as kda_recurrent_kernel
//    (run_item_tokens: same tile, lane layout, reduction order, so the results are bit-identical), writes
//    the updated tile back into the stage and stores it to the pool slot with one bulk store
//    (cp.async.bulk.global.shared::cta), which drains while the warp runs its next item;
//  * the stage is handed back ("empty" mbarrier) by the math warp's lane 0 once the bulk store has read it
//    (cp.async.bulk.wait_group.read), one item later.
//
// Ring protocol per math warp (kStages stages; item j of the warp uses stage j % kStages, phase
// (j / kStages) & 1): the producer waits on empty[stage] with the opposite parity (a fresh barrier
// passes), fills the stage, arrives on full[stage]; the math warp waits on full[stage], computes, and
// releases stage (j-1) % kStages after item j's bulk store is committed. Every item, also an inactive,
// zero-length or broken (seq_order) one, goes through the ring with the bytes it expects (possibly 0), so
// the parities stay uniform. Producer and math warp walk the same item sequence (items w', w' + W, ...;
// w' = block * kMathWarps + w, W = grid * kMathWarps), so no end marker is needed.
//
// Speculative decode and prefill items (more than one token) take the first token from the stage and the
// others from global memory (run_item_tokens), and write per-token spec states from registers as in
// kda_recurrent_kernel; a source start state (initial_state_source, its own dtype) is read by the lanes.
#pragma once
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "kda/decode/recurrent_kernel.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(CUTE_ARCH_TMA_SM90_ENABLED)
#define KDA_DECODE_RING_COPY 1
#else
#define KDA_DECODE_RING_COPY 0
#endif

namespace kda::decode {

// Block shapes of the ring kernel (KDA_EXPERIMENT=ring_shape=n; the same bits in every one, only the schedule
// differs): math warps per block (plus one producer warp), ring stages per math warp (0: about 22 KB of
// stages per math warp, at least 3), and the resident blocks per SM the register budget is set for. Every
// shape other than 0 keeps 12 warps per SM (3 per SM sub-partition: 168 registers a thread), where shape 0
// leaves two warp slots of the register file unused:
//   0: 4 math warps x 4 stages, 2 blocks per SM  ( 8 math warps per SM, 32 stages in flight)
//   1: 5 math warps x 4 stages, 2 blocks per SM  (10 math warps, 40 stages)
//   2: 3 math warps x 4 stages, 3 blocks per SM  ( 9 math warps, 36 stages)
//   3: 11 math warps x 3 stages, 1 block per SM  (11 math warps, 33 stages)
template <int kVariant>
struct RingShape {
  static_assert(kVariant >= 0 && kVariant <= 3, "ring kernel shapes 0..3");
  static constexpr int kMathWarps = kVariant == 1 ? 5 : kVariant == 2 ? 3 : kVariant == 3 ? 11 : 4;
  static constexpr int kStages = kVariant == 3 ? 3 : kVariant == 0 ? 0 : 4;
  static constexpr int kMinBlocks = kVariant == 2 ? 3 : kVariant == 3 ? 1 : 2;
};
constexpr int kRingVariants = 4;

// Kernel flags of the ring kernel only (kFlagRingDtBiasGlobal, kFlagRingStateFirst): recurrent_instantiations.h.

// What the producer writes into a stage besides the copied bytes.
struct RingItemMeta {
  ItemMeta m;     // sequence range, start slot, kind, tile, head (kind kNoItem: nothing to do)
  int64_t wslot;  // decode (S == 0) with a pool: the slot the final state goes to
  float beta;     // first token's beta as stored (a logit when beta_is_logit)
  float A;        // exp(A_log[hv]) (0 for the precomputed gate)
};

// One stage, bytes; every piece starts 16-byte aligned (bulk-copy rule).
template <class Tile, int kStagesWanted = 0>
struct RingStage {
  using StateT = typename Tile::StateT;
  static constexpr int kStateBytes = Tile::kRowsPerWarp * Tile::K * int(sizeof(StateT));  // the tile, row-major
  static constexpr int kTokenBytes = Tile::K * 2;                                         // one bf16 row
  static constexpr int kVBytes = Tile::kRowsPerWarp * 2;  // v[row0 .. row0 + kRowsPerWarp), bf16
  static constexpr int kQ = kStateBytes;
  static constexpr int kKey = kQ + kTokenBytes;
  static constexpr int kGate = kKey + kTokenBytes;
  static constexpr int kV = kGate + kTokenBytes;
  static constexpr int kDtBias = kV + kVBytes;  // fp32 [K]
  static constexpr int kMeta = kDtBias + Tile::K * 4;
  static constexpr int kBytes = (kMeta + int(sizeof(RingItemMeta)) + 127) / 128 * 128;
  static_assert(kStateBytes % 16 == 0 && kTokenBytes % 16 == 0 && kVBytes % 16 == 0 && kMeta % 16 == 0,
                "bulk copies move 16-byte units");
  // Ring depth: about 22 KB of stages per math warp (bf16 NR=8: 4 x 5.5 KB), at least 3 (item j computes
  // while j-1's store drains and j+1 lands).
  static constexpr int kStages = kStagesWanted > 0 ? kStagesWanted : kBytes <= 6144 ? 4 : 3;
};

template <class Tile, class Shape>
struct RingKernelLayout {
  using Stage = RingStage<Tile, Shape::kStages>;
  static constexpr int kMathWarps = Shape::kMathWarps;
  static constexpr int kWarpRingBytes = Stage::kStages * Stage::kBytes;
  static constexpr int kBarrierOffset = kMathWarps * kWarpRingBytes;
  static constexpr int kBlockBytes = kBarrierOffset + kMathWarps * Stage::kStages * 2 * 8;
  static constexpr int kThreads = (kMathWarps + 1) * 32;
  // the resident blocks must fit the SM's 228 KB (1 KB reserved per block)
  static_assert(Shape::kMinBlocks * (kBlockBytes + 1024) <= 228 * 1024, "ring shape does not fit shared memory");
  static_assert(kMathWarps <= 32, "one producer lane per math warp");
};

// Resident blocks the register budget is set for (__launch_bounds__, RingShape::kMinBlocks). Shape 0: two
// 160-thread blocks per SM (8 math warps); ten warps on four SM sub-partitions put three on one, whose 16K
// registers then cap a thread at 168, the same cap as the 12 warps of shapes 1-3. K=128 NR=8 fits in 168
// without spills on sm_90a, sm_100a and sm_103a (194 on sm_90a uncapped) once the item metadata is read
// from the stage instead of held in registers; K=64 uses the NR=4 tile in this kernel (its NR=8 tile
// spilled 40 bytes at 168 before that change; not retried). No build reaches 255.
template <class Tile, class Shape>
constexpr int ring_min_blocks() {
  return Shape::kMinBlocks;
}

// Producer lane: item -> metadata (the rules of resolve_items, for one item).
template <class Tile>
__device__ __forceinline__ void ring_resolve(const RecurrentParams& p, int64_t item, int64_t total, RingItemMeta& r) {
  r.m = ItemMeta{};
  r.m.kind = kNoItem;
  r.wslot = -1;
  int tile, hv;
  int64_t n;
  if (item < total && decode_item(p, item, Tile::kTilesPerHead, tile, hv, n)) {
    const SeqRange sr = seq_range(p, n);
    const StartState st = start_state(p, n);
    r.m.bos = sr.bos, r.m.len = sr.len, r.m.slot = st.slot, r.m.batch = static_cast<int32_t>(sr.batch);
    r.m.n = static_cast<int32_t>(n), r.m.kind = st.kind, r.m.tile = tile, r.m.hv = hv;
    if (p.num_spec_tokens == 0 && p.state != nullptr && st.kind >= 0)
      r.wslot = st.kind == 1 ? st.slot : write_slot(p, n, 0);  // decode reads and writes one slot
  }
}

// Producer lane: the item's first-token scalars (loaded one item ahead of their use). Their addresses do not
// depend on the slot lookup, so they are loaded for every decoded item with tokens, active or not: the loads
// then overlap the slot lookup instead of waiting for it.
template <class Tile>
__device__ __forceinline__ void ring_scalars(const RecurrentParams& p, RingItemMeta& r) {
  r.beta = 0.f;
  r.A = 0.f;
  if (r.m.kind != kNoItem && r.m.len > 0) {
    r.beta = bf16_bits_to_float(__ldg(p.beta.row<uint16_t>(r.m.batch, r.m.bos, r.m.hv)));
    if (p.gate_mode != GateMode::kPrecomputed) r.A = __expf(__ldg(p.A_log + r.m.hv));
  }
}

// Producer lane: issue the stage's bulk copies for item r, then write its metadata and arrive on `full`.
// The token rows and dt_bias (addresses known without the slot lookup) go first, then the state tile (its
// slot came from a global load); each group's bytes are announced (expect_tx) before its copies, and the
// single arrive comes last, after the metadata store, so the math warp sees both. Tokens of an inactive
// sequence are copied too (valid addresses, never read): it keeps the token copies independent of the
// slot lookup.
template <class Tile, class Stage>
__device__ __forceinline__ void ring_issue(const RecurrentParams& p, const RingItemMeta& r, const int flags,
                                           unsigned char* stage, uint64_t* full) {
#if KDA_DECODE_RING_COPY
  using StateT = typename Tile::StateT;
  constexpr int K = Tile::K;
  const ItemMeta& m = r.m;
  const bool tokens = m.kind != kNoItem && m.len > 0;
  const bool dtb =
      tokens && p.dt_bias != nullptr && p.gate_mode != GateMode::kPrecomputed && !(flags & kFlagRingDtBiasGlobal);
  auto state_copy = [&] {
    if (tokens && m.kind == 1) {  // a pool start state (a zero-length or inactive sequence's is never needed)
      cutlass::arch::ClusterTransactionBarrier::expect_transaction(full, Stage::kStateBytes);
      const StateT* src = static_cast<const StateT*>(p.state) + m.slot * p.state_slot_stride + int64_t(m.hv) * K * K +
                          int64_t(m.tile) * Tile::kRowsPerWarp * K;
      cute::SM90_BULK_COPY_G2S::copy(src, full, stage, Stage::kStateBytes);
    }
  };
  const bool state_first = (flags & kFlagRingStateFirst) != 0;
  if (state_first) state_copy();
  if (tokens) {
    cutlass::arch::ClusterTransactionBarrier::expect_transaction(
        full, 3 * Stage::kTokenBytes + Stage::kVBytes + (dtb ? K * 4 : 0));
    const int h = qk_head(p, m.hv);
    const int64_t b = m.batch, t = m.bos;
    cute::SM90_BULK_COPY_G2S::copy(p.q.row<__nv_bfloat16>(b, t, h), full, stage + Stage::kQ, Stage::kTokenBytes);
    cute::SM90_BULK_COPY_G2S::copy(p.k.row<__nv_bfloat16>(b, t, h), full, stage + Stage::kKey, Stage::kTokenBytes);
    cute::SM90_BULK_COPY_G2S::copy(p.g.row<__nv_bfloat16>(b, t, m.hv), full, stage + Stage::kGate, Stage::kTokenBytes);
    cute::SM90_BULK_COPY_G2S::copy(p.v.row<__nv_bfloat16>(b, t, m.hv) + m.tile * Tile::kRowsPerWarp, full,
                                   stage + Stage::kV, Stage::kVBytes);
    if (dtb) cute::SM90_BULK_COPY_G2S::copy(p.dt_bias + int64_t(m.hv) * K, full, stage + Stage::kDtBias, K * 4);
  }
  if (!state_first) state_copy();
  *reinterpret_cast<RingItemMeta*>(stage + Stage::kMeta) = r;
  cutlass::arch::ClusterBarrier::arrive(full);  // release: the metadata store is visible after the wait
#endif
}

// Token slice (Tile order) from shared memory: the layout of load_token_slice.
template <class Tile>
__device__ __forceinline__ void ring_token_slice(const unsigned char* row, int kl, uint32_t (&w)[4]) {
  const auto* base = reinterpret_cast<const __nv_bfloat16*>(row);
#pragma unroll
  for (int c = 0; c < Tile::kChunks; ++c) {
    const __nv_bfloat16* ptr = base + Tile::chunk_offset(kl, c);
    if constexpr (Tile::kVec == 8) {
      const uint4 x = *reinterpret_cast<const uint4*>(ptr);
      w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else {
      const uint2 x = *reinterpret_cast<const uint2*>(ptr);
      w[2 * c] = x.x, w[2 * c + 1] = x.y;
    }
  }
}

template <class Tile, class Shape>
__global__ void __launch_bounds__(RingKernelLayout<Tile, Shape>::kThreads, ring_min_blocks<Tile, Shape>())
    kda_recurrent_ring_kernel(const RecurrentParams p, const int flags) {
#if KDA_DECODE_RING_COPY
  pdl_wait_and_release_dependents();
  using StateT = typename Tile::StateT;
  using Layout = RingKernelLayout<Tile, Shape>;
  using Stage = typename Layout::Stage;
  constexpr int kRingMathWarps = Layout::kMathWarps;
  constexpr int K = Tile::K, NR = Tile::NR, KL = Tile::KL, RP = Tile::RP, kStages = Stage::kStages;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem_raw + Layout::kBarrierOffset);
  // full[w][s] = bars[(w * kStages + s) * 2], empty[w][s] = the next one
  auto full_bar = [&](int w, int s) { return bars + (w * kStages + s) * 2; };
  auto empty_bar = [&](int w, int s) { return bars + (w * kStages + s) * 2 + 1; };

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  if (threadIdx.x < kRingMathWarps * kStages) {
    cutlass::arch::ClusterBarrier::init(bars + threadIdx.x * 2, 1);
    cutlass::arch::ClusterBarrier::init(bars + threadIdx.x * 2 + 1, 1);
  }
  cutlass::arch::fence_barrier_init();
  __syncthreads();

  const int64_t total = p.N * p.HV * Tile::kTilesPerHead;
  const int64_t stride = int64_t(gridDim.x) * kRingMathWarps;

  if (warp == kRingMathWarps) {
    // ---- producer: lane w feeds math warp w (the other lanes have nothing to do)
    if (lane >= kRingMathWarps) return;
    const int w = lane;
    unsigned char* ring = smem_raw + w * Layout::kWarpRingBytes;
    const int64_t first = int64_t(blockIdx.x) * kRingMathWarps + w;
    RingItemMeta cur, nxt;
    ring_resolve<Tile>(p, first, total, cur);
    ring_scalars<Tile>(p, cur);
    ring_resolve<Tile>(p, first + stride, total, nxt);
    // In step (default): every lane waits for its own math warp's stage, then the lanes meet (__syncwarp)
    // and issue their items together, so one instruction of the slot lookups and copies serves all the
    // lanes. Each on its own (kFlagRingProducerDiverged): the lanes leave their waits at different times and
    // the warp runs the same instructions once per group of lanes that happen to be together (on H200, B=256
    // bf16: ~2.6 of 5 lanes per instruction). In step couples the rings only loosely: a lane waits for the
    // slowest math warp's stage release, and each ring is kStages items deep.
    const bool in_step = !(flags & kFlagRingProducerDiverged);
    constexpr unsigned kLanes = kRingMathWarps >= 32 ? 0xffffffffu : (1u << kRingMathWarps) - 1u;
    int stage = 0;
    uint32_t phase = 0;
    // lane 0 has the most items: every lane runs its trip count, lanes past their last item only meet
    for (int64_t base = int64_t(blockIdx.x) * kRingMathWarps; base < total; base += stride) {
      const int64_t item = base + w;
      const bool mine = item < total;
      if (mine) cutlass::arch::ClusterBarrier::wait(empty_bar(w, stage), phase ^ 1u);  // the math warp released it
      if (in_step) __syncwarp(kLanes);
      if (mine) {
        ring_issue<Tile, Stage>(p, cur, flags, ring + stage * Stage::kBytes, full_bar(w, stage));
        cur = nxt;
        ring_scalars<Tile>(p, cur);                            // item j+1: used at the next issue
        ring_resolve<Tile>(p, item + 2 * stride, total, nxt);  // item j+2
        if (++stage == kStages) stage = 0, phase ^= 1u;
      }
    }
    return;
  }

  // ---- math warp
  const int w = warp;
  unsigned char* ring = smem_raw + w * Layout::kWarpRingBytes;
  const int64_t first = int64_t(blockIdx.x) * kRingMathWarps + w;
  const int kl = lane % KL, rg = lane / KL;
  const int my_idx = rs_row_index<KL, NR>(lane);
  const bool writer = (lane & rs_duplicate_bits<KL, NR>()) == 0;
  const int64_t inner = int64_t(p.HV) * K * K;
  const int S = p.num_spec_tokens;
  const bool dtb_global = (flags & kFlagRingDtBiasGlobal) != 0;

  int stage = 0;
  uint32_t phase = 0;
  int64_t j = 0;
  for (int64_t item = first; item < total; item += stride, ++j) {
    unsigned char* st = ring + stage * Stage::kBytes;
    cutlass::arch::ClusterBarrier::wait(full_bar(w, stage), phase);  // this item's bytes have landed
    // The metadata stays in the stage (pinned until the item ends) and is read where it is used, rather
    // than copied into 16 registers that would be live across the token loop.
    const RingItemMeta& rm = *reinterpret_cast<const RingItemMeta*>(st + Stage::kMeta);
    const ItemMeta& m = rm.m;
    const bool skip = m.kind == kNoItem;
    const int hv = m.hv;
    const int64_t n = m.n;
    const int row0 = m.tile * Tile::kRowsPerWarp;
    const int my_row = row0 + my_idx * RP + rg;
    const int64_t head_off = int64_t(hv) * K * K;

    TokenRaw cur;
    int32_t spec_slot = -1;  // lane t holds the write slot of token t (t <= S < 32)
    const bool load = !skip && m.kind >= 0 && m.len > 0;
    if (load) {
      ring_token_slice<Tile>(st + Stage::kQ, kl, cur.q);
      ring_token_slice<Tile>(st + Stage::kKey, kl, cur.k);
      ring_token_slice<Tile>(st + Stage::kGate, kl, cur.g);
      cur.v = bf16_bits_to_float(reinterpret_cast<const uint16_t*>(st + Stage::kV)[my_row - row0]);
      cur.beta = rm.beta;
      if (S > 0 && S < 32 && lane <= S) spec_slot = p.ssm_state_indices[n * (S + 1) + lane];
    }
    float s[NR][8];
    if (load && m.kind == 1) {
      load_tile<Tile>(reinterpret_cast<const StateT*>(st), 0, rg, kl, s);  // the stage holds the tile's rows
    } else {
      load_unstaged_start<Tile>(p, !skip && m.kind == 2, m.slot, head_off, row0, rg, kl, s);
    }

    bool stored = false;
    if (!skip && m.kind < 0) {
      // Inactive sequence: zero output, no state read or write (as kda_recurrent_kernel).
      if (writer) {
        uint16_t* out = static_cast<uint16_t*>(p.out) + int64_t(m.batch) * p.out_batch_stride +
                        int64_t(hv) * p.out_head_stride + my_row;
        for (int64_t t = 0; t < m.len; ++t) out[(m.bos + t) * p.out_token_stride] = 0;
      }
    } else if (!skip) {
      const float* dtb =
          p.dt_bias == nullptr || p.gate_mode == GateMode::kPrecomputed
              ? nullptr
              : (dtb_global ? p.dt_bias + int64_t(hv) * K : reinterpret_cast<const float*>(st + Stage::kDtBias));
      run_item_tokens<Tile>(p, flags, m, lane, cur, spec_slot, rm.A, dtb, s);
      // A zero-length sequence leaves its slot bit-identical; a verify pass writes no slot.
      if (S == 0 && rm.wslot >= 0 && m.len > 0 && !(flags & (kDiagNoStateStore | kFlagNoStateUpdate))) {
        // Each lane overwrites exactly the stage elements it read (load_tile / store_tile share the layout).
        store_tile<Tile>(reinterpret_cast<StateT*>(st), 0, rg, kl, s);
        cute::tma_store_fence();  // this lane's generic-proxy writes -> visible to the bulk copy (async proxy)
        __syncwarp();
        if (lane == 0)
          cute::SM90_BULK_COPY_S2G::copy(
              st, static_cast<StateT*>(p.state) + rm.wslot * p.state_slot_stride + head_off + int64_t(row0) * K,
              Stage::kStateBytes);
        stored = true;
      }
      if (p.final_state != nullptr) store_tile<Tile>(p.final_state + n * inner + head_off, row0, rg, kl, s);
    }
    (void)stored;
    __syncwarp();  // every lane is done with this stage's inputs
    if (lane == 0) {
      cute::tma_store_arrive();   // one bulk group per item (empty when nothing was stored)
      cute::tma_store_wait<1>();  // item j-1's store has read its stage
      if (j > 0) cutlass::arch::ClusterBarrier::arrive(empty_bar(w, stage == 0 ? kStages - 1 : stage - 1));
    }
    if (++stage == kStages) stage = 0, phase ^= 1u;
  }
  if (lane == 0) cute::tma_store_wait<0>();  // the stores have read shared memory before the block exits
#else
  // Built only for sm_90+ targets with bulk copies; the launcher never selects it elsewhere.
  __trap();
#endif
}

template <int K, typename StateT, int NR, int kVariant>
void run_recurrent_ring_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream) {
  using Tile = RecurrentTile<K, StateT, NR>;
  using Shape = RingShape<kVariant>;
  using Layout = RingKernelLayout<Tile, Shape>;
  constexpr int kRingMathWarps = Layout::kMathWarps;
  auto kernel = kda_recurrent_ring_kernel<Tile, Shape>;
  // Occupancy per device queried once (first eager call) with the dynamic-smem opt-in and the carveout (as
  // run_recurrent_, for this kernel's one block shape); concurrent first calls are serialised.
  static std::once_flag once[kMaxDevices];
  static int max_blocks[kMaxDevices] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) dev = 0;
  std::call_once(once[dev], [&] {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Layout::kBlockBytes);
    int v = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, Layout::kThreads, Layout::kBlockBytes) !=
            cudaSuccess ||
        v <= 0)
      v = 1;
    max_blocks[dev] = v;
    const int b = cfg.max_blocks_per_sm > 0 && cfg.max_blocks_per_sm < v ? cfg.max_blocks_per_sm : v;
    if (cfg.carveout_percent != kCarveoutUntouched)
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           carveout_percent_for(cfg.carveout_percent, resident_smem_bytes(b, Layout::kBlockBytes)));
    (void)cudaGetLastError();
  });
  int blocks_per_sm = max_blocks[dev];
  if (cfg.max_blocks_per_sm > 0 && cfg.max_blocks_per_sm < blocks_per_sm) blocks_per_sm = cfg.max_blocks_per_sm;
  int flags = cfg.flags;
  if (reinterpret_cast<uintptr_t>(p.dt_bias) % 16 != 0) flags |= kFlagRingDtBiasGlobal;
  const int64_t blocks =
      persistent_blocks(p.N * p.HV * Tile::kTilesPerHead, kRingMathWarps, blocks_per_sm, cfg.num_sms);
  (void)launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(Layout::kThreads), Layout::kBlockBytes, stream,
                      cfg.pdl, p, flags);
}

}  // namespace kda::decode
