// Token-serial KDA kernel, bulk-copy variant (sm_90+; selected by KDA_RECURRENT_BULK in the launcher).
//
// Same tile, lane layout, token math and reduction order as kda_recurrent_kernel (recurrent_kernel.cuh:
// both call run_item_tokens), so the two give bit-identical results. What differs is how an item's inputs
// reach the warp:
//  * the item's start state (its kRowsPerWarp rows are contiguous in the pool: one run of
//    kRowsPerWarp * K * sizeof(StateT) bytes, 4 KB for bf16 NR=8), its first token's q, k and g rows and
//    its dt_bias row are fetched by lane 0 with 1-D bulk copies (cp.async.bulk ... mbarrier::complete_tx)
//    into one stage of a per-warp shared-memory ring; the stage's mbarrier completes when all bytes have
//    landed. The copies are done by the TMA unit, so the bytes in flight per SM are bounded by the ring
//    (stages x ~5 KB per warp), not by the LSU's outstanding 16-byte requests nor by registers;
//  * the per-lane scalars of the NEXT item (v of the row the lane reduces, beta, A_log) are loaded into
//    registers while the current item computes (3 registers), so no global load sits between the stage's
//    mbarrier and the math; for a single item per warp (B=1) they are issued together with the bulk copies,
//    and the chain is slot lookup -> {state, tokens} -> math -> store;
//  * optionally (kFlagBulkStore) the updated tile is written back into its stage and stored to the pool
//    with one bulk store (cp.async.bulk.global.shared::cta), which drains while the warp runs the next item.
//
// Ring protocol (per warp, `stages` >= 3 stages, lane 0 issues every copy):
//   prologue: items 0 .. stages-2 are issued into stages 0 .. stages-2;
//   item j (stage j % stages): all lanes wait on the stage's mbarrier (parity = (j / stages) & 1), read
//   the state and first-token inputs, run the tokens (dt_bias is read from the stage on every token, so the
//   stage stays pinned until the item ends), store; then lane 0 refills stage (j-1) % stages with item
//   j + stages - 1, after cp.async.bulk.wait_group.read has confirmed that item j-1's bulk store (if any)
//   has finished reading that stage.
// So during the math of item j, items j+1 .. j+stages-2 are in flight and item j-1's store may be draining.
// Optionally (`l2_ahead` = D > 0, KDA_RECURRENT_BULK_L2_AHEAD) lane 0 also issues cp.async.bulk.prefetch.L2
// for the state of item j + stages - 1 + D when it refills a stage: D more items per warp stream from HBM into
// L2 without holding shared memory, so the ring's own copies hit L2. The slot tables are then resolved D items
// earlier (at (j + stages - 1 + D) % 16 == 0); stages + D <= 16 keeps every needed entry in the two tables.
// Every item, including an empty, inactive or past-the-end one, arrives once on its stage's mbarrier (with
// the byte count it expects, possibly 0), so the parities stay uniform.
#pragma once
#include <cute/arch/copy_sm90_tma.hpp>
#include <cutlass/arch/barrier.h>

#include "kda/decode/recurrent_kernel.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(CUTE_ARCH_TMA_SM90_ENABLED)
#define KDA_DECODE_BULK_COPY 1
#else
#define KDA_DECODE_BULK_COPY 0
#endif

namespace kda::decode {

// One stage of the ring, bytes; every piece starts 16-byte aligned (bulk-copy rule).
template <class Tile>
struct BulkStage {
  using StateT = typename Tile::StateT;
  static constexpr int kStateBytes = Tile::kRowsPerWarp * Tile::K * int(sizeof(StateT));  // the tile, row-major
  static constexpr int kTokenBytes = Tile::K * 2;                                          // one bf16 row
  static constexpr int kQ = kStateBytes;
  static constexpr int kKey = kQ + kTokenBytes;
  static constexpr int kGate = kKey + kTokenBytes;
  static constexpr int kDtBias = kGate + kTokenBytes;  // fp32 [K]
  static constexpr int kBytes = kDtBias + Tile::K * 4;
  static_assert(kStateBytes % 16 == 0 && kTokenBytes % 16 == 0 && kBytes % 16 == 0, "bulk copies move 16-byte units");
};

// Register cap (__launch_bounds__ min blocks of 128 threads). sm_90: 3 blocks (<= 168 registers; NR=8 bf16
// took 202 without it, which left 2 blocks = 8 warps per SM) where the ring lets 12 warps share an SM; 2 where
// a stage of more than 4 KB of state makes shared memory the limit anyway (fp32 NR=8 spilled 16 bytes at 168).
// Other arches (unmeasured): no cap; at 168 NR=8 bf16 spilled 68-120 bytes on sm_100a/103a/120a.
template <class Tile>
constexpr int bulk_min_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
  return 1;
#else
  return BulkStage<Tile>::kStateBytes > 4096 ? 2 : 3;
#endif
}

// Per-warp shared memory: `stages` stages, the two item-meta tables, one mbarrier per stage.
template <class Tile>
struct BulkLayout {
  static constexpr int kMinStages = 3;  // item j+1's metadata must be resolved when item j starts
  static constexpr int kMaxStages = 8;  // < kMetaBatch: a meta table outlives the items in flight
  static_assert(kMaxStages + 1 < kMetaBatch, "meta table too small for the deepest ring");
  __host__ __device__ static constexpr int meta_offset(int stages) { return stages * BulkStage<Tile>::kBytes; }
  __host__ __device__ static constexpr int barrier_offset(int stages) {
    return meta_offset(stages) + RingLayout<Tile>::kMetaBytes;
  }
  __host__ __device__ static constexpr int warp_bytes(int stages) {
    return (barrier_offset(stages) + stages * 8 + 127) / 128 * 128;
  }
};

// Token slice (Tile order) from shared memory: the layout of load_token_slice, plain 16/8-byte loads.
template <class Tile>
__device__ __forceinline__ void load_token_slice_shared(const unsigned char* row, int kl, uint32_t (&w)[4]) {
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

// Lane 0: an L2 prefetch of item m's pool state (a hint: no completion to track).
template <class Tile>
__device__ __forceinline__ void bulk_prefetch_item_l2(const RecurrentParams& p, const ItemMeta& m) {
#if KDA_DECODE_BULK_COPY
  if (m.kind == 1 && m.len > 0) {
    constexpr int K = Tile::K;
    const auto* src = static_cast<const typename Tile::StateT*>(p.state) + m.slot * p.state_slot_stride +
                      int64_t(m.hv) * K * K + int64_t(m.tile) * Tile::kRowsPerWarp * K;
    cute::SM90_BULK_COPY_G2S::PREFETCH::copy(src, BulkStage<Tile>::kStateBytes);
  }
#endif
}

// Lane 0: arrive on the stage's mbarrier with the bytes item m will bring, then issue its bulk copies.
// A zero-length or inactive sequence needs nothing (0 bytes: the phase completes at the arrive); a source
// start state (kind 2) is read from global memory by the lanes (its dtype may differ from the pool's).
template <class Tile>
__device__ __forceinline__ void bulk_issue_item(const RecurrentParams& p, const ItemMeta& m, unsigned char* stage,
                                                uint64_t* bar) {
#if KDA_DECODE_BULK_COPY
  using Stage = BulkStage<Tile>;
  using StateT = typename Tile::StateT;
  constexpr int K = Tile::K;
  const bool load = m.kind >= 0 && m.len > 0;
  const bool pool = load && m.kind == 1;
  const bool dtb = load && p.dt_bias != nullptr && p.gate_mode != GateMode::kPrecomputed;
  const uint32_t bytes = (pool ? Stage::kStateBytes : 0) + (load ? 3 * Stage::kTokenBytes : 0) + (dtb ? K * 4 : 0);
  cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(bar, bytes);
  if (pool) {
    const StateT* src = static_cast<const StateT*>(p.state) + m.slot * p.state_slot_stride + int64_t(m.hv) * K * K +
                        int64_t(m.tile) * Tile::kRowsPerWarp * K;
    cute::SM90_BULK_COPY_G2S::copy(src, bar, stage, Stage::kStateBytes);
  }
  if (load) {
    const int h = m.hv / (p.HV / p.H);
    const int64_t b = m.batch, t = m.bos;
    const auto* q = p.q.row<__nv_bfloat16>(b, t, h);
    const auto* k = p.k.row<__nv_bfloat16>(b, t, h);
    const auto* g = p.g.row<__nv_bfloat16>(b, t, m.hv);
    cute::SM90_BULK_COPY_G2S::copy(q, bar, stage + Stage::kQ, Stage::kTokenBytes);
    cute::SM90_BULK_COPY_G2S::copy(k, bar, stage + Stage::kKey, Stage::kTokenBytes);
    cute::SM90_BULK_COPY_G2S::copy(g, bar, stage + Stage::kGate, Stage::kTokenBytes);
  }
  if (dtb) cute::SM90_BULK_COPY_G2S::copy(p.dt_bias + int64_t(m.hv) * K, bar, stage + Stage::kDtBias, K * 4);
#endif
}

// The lane's scalars of item m: v[row it reduces] (low 16 bits) and beta (high 16 bits) as bf16 bits, A_log.
template <class Tile>
__device__ __forceinline__ void load_item_scalars(const RecurrentParams& p, const ItemMeta& m, int my_idx, int rg,
                                                  uint32_t& vb, float& alog) {
  if (m.kind >= 0 && m.len > 0) {
    const int my_row = m.tile * Tile::kRowsPerWarp + my_idx * Tile::RP + rg;
    const auto* v = p.v.row<uint16_t>(m.batch, m.bos, m.hv) + my_row;
    const auto* b = p.beta.row<uint16_t>(m.batch, m.bos, m.hv);
    vb = uint32_t(__ldg(v)) | (uint32_t(__ldg(b)) << 16);
    alog = p.gate_mode != GateMode::kPrecomputed ? __ldg(p.A_log + m.hv) : 0.f;
  }
}

// Persistent warps as in kda_recurrent_kernel (warp w handles items w, w + W, ...); the ring protocol is
// described at the top of this file. `stages` is BulkLayout::kMinStages .. kMaxStages (the launcher clamps).
template <class Tile>
__global__ void __launch_bounds__(128, bulk_min_blocks<Tile>())
    kda_recurrent_bulk_kernel(const RecurrentParams p, const int flags, const int stages, const int l2_ahead) {
#if KDA_DECODE_BULK_COPY
  using StateT = typename Tile::StateT;
  using Stage = BulkStage<Tile>;
  using Layout = BulkLayout<Tile>;
  constexpr int K = Tile::K, NR = Tile::NR, KL = Tile::KL, RP = Tile::RP;
  extern __shared__ __align__(128) unsigned char smem_raw[];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps_per_block = blockDim.x >> 5;
  unsigned char* ring = smem_raw + warp * Layout::warp_bytes(stages);
  ItemMeta* metas = reinterpret_cast<ItemMeta*>(ring + Layout::meta_offset(stages));
  uint64_t* bars = reinterpret_cast<uint64_t*>(ring + Layout::barrier_offset(stages));
  const bool store_bulk = (flags & kFlagBulkStore) != 0;

  const int64_t total = p.N * p.HV * Tile::kTilesPerHead;
  const int64_t stride = int64_t(gridDim.x) * warps_per_block;
  const int64_t first = int64_t(blockIdx.x) * warps_per_block + warp;
  auto meta_at = [&](int64_t j) -> ItemMeta* { return metas + ((j / kMetaBatch) & 1) * kMetaBatch + j % kMetaBatch; };

  if (lane == 0) {
    for (int st = 0; st < stages; ++st) cutlass::arch::ClusterBarrier::init(bars + st, 1);
    cutlass::arch::fence_barrier_init();
  }
  resolve_items<Tile>(p, 0, first, stride, total, metas, lane);  // ends with __syncwarp (also for the inits)
  if (lane == 0) {
    for (int st = 0; st < stages - 1; ++st)
      bulk_issue_item<Tile>(p, *meta_at(st), ring + st * Stage::kBytes, bars + st);
    for (int a = 0; a < l2_ahead; ++a) bulk_prefetch_item_l2<Tile>(p, *meta_at(stages - 1 + a));  // < 16: table 0
  }

  const int kl = lane % KL, rg = lane / KL;
  const int my_idx = rs_row_index<KL, NR>(lane);
  const bool writer = (lane & rs_duplicate_bits<KL, NR>()) == 0;
  const int64_t inner = int64_t(p.HV) * K * K;  // elements of one [HV, V, K] block
  const int S = p.num_spec_tokens;

  uint32_t vb_next = 0;  // item j+1's scalars, loaded during item j
  float alog_next = 0.f;
  load_item_scalars<Tile>(p, *meta_at(0), my_idx, rg, vb_next, alog_next);

  int stage = 0;
  uint32_t phase = 0;
  int64_t j = 0;
  for (int64_t item = first; item < total; ++j, item += stride) {
    const uint32_t vb = vb_next;
    const float alog = alog_next;
    const ItemMeta m = *meta_at(j);
    load_item_scalars<Tile>(p, *meta_at(j + 1), my_idx, rg, vb_next, alog_next);  // issued stages-2 items ago
    const bool skip = m.kind == kNoItem;
    unsigned char* st = ring + stage * Stage::kBytes;
    cutlass::arch::ClusterBarrier::wait(bars + stage, phase);  // this item's bytes have landed

    const int hv = m.hv;
    const int64_t n = m.n;
    const int row0 = m.tile * Tile::kRowsPerWarp;
    const int64_t head_off = int64_t(hv) * K * K;

    TokenRaw cur;
    int32_t spec_slot = -1;  // lane t holds the write slot of token t (t <= S < 32)
    if (!skip && m.kind >= 0 && m.len > 0) {
      load_token_slice_shared<Tile>(st + Stage::kQ, kl, cur.q);
      load_token_slice_shared<Tile>(st + Stage::kKey, kl, cur.k);
      load_token_slice_shared<Tile>(st + Stage::kGate, kl, cur.g);
      cur.v = bf16_lo(vb);
      cur.beta = bf16_hi(vb);
      if (S > 0 && S < 32 && lane <= S) spec_slot = p.ssm_state_indices[n * (S + 1) + lane];
    }
    float s[NR][8];
    if (!skip && m.kind == 1 && m.len > 0) {
      load_tile<Tile>(reinterpret_cast<const StateT*>(st), 0, rg, kl, s);  // the stage holds the tile's rows
    } else if (!skip && m.kind == 2) {
      load_tile_dt<Tile>(p.state_source, p.state_source_dtype, m.slot * p.source_slot_stride + head_off, row0, rg,
                         kl, s);
    } else {
#pragma unroll
      for (int i = 0; i < NR; ++i)
#pragma unroll
        for (int e = 0; e < 8; ++e) s[i][e] = 0.f;
    }

    bool stored = false;  // lane 0: a bulk store of this stage was committed
    if (!skip && m.kind < 0) {
      // Inactive sequence: zero output, no state read or write (as kda_recurrent_kernel).
      if (writer) {
        const int my_row = row0 + my_idx * RP + rg;
        uint16_t* out = static_cast<uint16_t*>(p.out) + int64_t(m.batch) * p.out_batch_stride +
                        int64_t(hv) * p.out_head_stride + my_row;
        for (int64_t t = 0; t < m.len; ++t) out[(m.bos + t) * p.out_token_stride] = 0;
      }
    } else if (!skip) {
      const float A = p.gate_mode != GateMode::kPrecomputed ? __expf(alog) : 0.f;
      // dt_bias[hv] from the stage (bulk-copied with the item; read on every token, so the stage is pinned).
      const float* dtb = p.dt_bias == nullptr || p.gate_mode == GateMode::kPrecomputed
                             ? nullptr
                             : reinterpret_cast<const float*>(st + Stage::kDtBias);
      run_item_tokens<Tile>(p, flags, m, lane, cur, spec_slot, A, dtb, s);

      // A zero-length sequence leaves its slot bit-identical. Non-speculative pool items (kind 1) read and
      // write the same slot, already resolved in m.slot.
      if (S == 0 && p.state != nullptr && m.len > 0 && !(flags & kDiagNoStateStore)) {
        StateT* dst = static_cast<StateT*>(p.state) + (m.kind == 1 ? m.slot : write_slot(p, n, 0)) * p.state_slot_stride +
                      head_off;
        if (store_bulk) {
          // Each lane overwrites exactly the stage elements it read (load_tile / store_tile use one layout).
          store_tile<Tile>(reinterpret_cast<StateT*>(st), 0, rg, kl, s);
          cute::tma_store_fence();  // this lane's generic-proxy writes -> visible to the bulk copy (async proxy)
          __syncwarp();
          if (lane == 0) {
            cute::SM90_BULK_COPY_S2G::copy(st, dst + int64_t(row0) * K, Stage::kStateBytes);
            cute::tma_store_arrive();  // commit_group
          }
          stored = true;
        } else {
          store_tile<Tile>(dst, row0, rg, kl, s);
        }
      }
      if (p.final_state != nullptr) store_tile<Tile>(p.final_state + n * inner + head_off, row0, rg, kl, s);
    }

    // Refill stage (j-1) % stages (== (j + stages - 1) % stages) with item j + stages - 1.
    __syncwarp();  // every lane is done with item j-1's stage (and, for a skipped item, with this one)
    const int64_t jn = j + stages - 1;
    const int64_t jr = jn + l2_ahead;  // the furthest item this refill needs resolved
    if (jr % kMetaBatch == 0)  // the next table, one stall per 16 items (its buffer is consumed)
      resolve_items<Tile>(p, jr, first, stride, total, meta_at(jr), lane);
    const int prev = stage == 0 ? stages - 1 : stage - 1;
    if (lane == 0) {
      // item j-1's bulk store (the newest group before this item's) has read its stage
      if (stored)
        cute::tma_store_wait<1>();
      else
        cute::tma_store_wait<0>();
      bulk_issue_item<Tile>(p, *meta_at(jn), ring + prev * Stage::kBytes, bars + prev);
      if (l2_ahead > 0) bulk_prefetch_item_l2<Tile>(p, *meta_at(jr));
    }
    if (++stage == stages) stage = 0, phase ^= 1u;
  }
  if (lane == 0) cute::tma_store_wait<0>();  // the stores have read shared memory before the block exits
#else
  // Built only for sm_90+ targets with bulk copies; the launcher never selects it elsewhere.
  __trap();
#endif
}

template <int K, typename StateT, int NR>
void run_recurrent_bulk_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream) {
  using Tile = RecurrentTile<K, StateT, NR>;
  using Layout = BulkLayout<Tile>;
  auto kernel = kda_recurrent_bulk_kernel<Tile>;
  int stages = cfg.bulk_stages;
  stages = stages < Layout::kMinStages ? Layout::kMinStages : (stages > Layout::kMaxStages ? Layout::kMaxStages : stages);
  const int warp_bytes = Layout::warp_bytes(stages);
  int l2_ahead = cfg.bulk_l2_ahead;  // stages + l2_ahead <= kMetaBatch: the two slot tables cover the window
  l2_ahead = l2_ahead < 0 ? 0 : (l2_ahead > kMetaBatch - stages ? kMetaBatch - stages : l2_ahead);
  const int threads = cfg.warps_per_block * 32;
  const int smem = cfg.warps_per_block * warp_bytes;
  // Occupancy per (device, block shape, ring depth), queried once (first eager call), with the dynamic-smem
  // opt-in; carveout as in run_recurrent_ (smallest that holds the resident blocks, unless overridden).
  constexpr int kMaxDev = 64;
  static int max_blocks[kMaxDev][5][Layout::kMaxStages + 1] = {};
  static int carveout_set[kMaxDev] = {};
  static bool opted_in[kMaxDev] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDev) dev = 0;
  if (!opted_in[dev]) {
    int optin = 0;
    if (cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess || optin <= 0)
      optin = 48 * 1024;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin);
    (void)cudaGetLastError();
    opted_in[dev] = true;
  }
  auto blocks_for = [&](int w) {
    int& v = max_blocks[dev][w][stages];
    if (v == 0) {
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, w * 32, w * warp_bytes) != cudaSuccess || v <= 0) {
        (void)cudaGetLastError();
        v = 1;
      }
    }
    int b = v;
    if (cfg.max_blocks_per_sm > 0 && cfg.max_blocks_per_sm < b) b = cfg.max_blocks_per_sm;
    return b;
  };
  const int blocks_per_sm = blocks_for(cfg.warps_per_block);
  int need = 0;  // shared memory of the most resident blocks of any block shape
  if (cfg.carveout_percent == kCarveoutMin)
    for (int w : {1, 2, 4}) need = std::max(need, resident_smem_bytes(blocks_for(w), w * warp_bytes));
  apply_carveout(kernel, carveout_set, dev, cfg.carveout_percent, need);
  const int64_t blocks =
      persistent_blocks(p.N * p.HV * Tile::kTilesPerHead, cfg.warps_per_block, blocks_per_sm, cfg.num_sms);
  kernel<<<dim3(static_cast<unsigned>(blocks)), threads, smem, stream>>>(p, cfg.flags, stages, l2_ahead);
}

}  // namespace kda::decode
