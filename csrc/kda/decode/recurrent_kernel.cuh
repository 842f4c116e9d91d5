// Token-serial KDA kernel ("recurrent" backend): decode (T=1), speculative decode (1+S tokens with a
// pool write after every token) and token-serial prefill (any T, checkpoints, final state), one kernel
// family for the full RecurrentParams contract (docs/contract.md, "Recurrence" and "Slots and
// checkpoints"; slot/activity/gate rules from kda/common/recurrent_rules.h, shared with the CPU loop).
//
// Anatomy. One warp owns a tile of value rows x all K of one (sequence, value head).
// Lanes: KL = K/8 lanes share one row, each holding 8 of its K values; the other lane bits (rg) pick one
// of RP = 32/KL rows; each lane keeps NR such rows, so a warp covers NR*RP rows. The tile's state is fp32
// in registers for the whole sequence: read once at the start, written once at the end (plus one write per
// token in speculative decode, and at checkpoint boundaries). A lane's 8 K values are `kChunks` runs of
// `kVec` contiguous elements (one 16-byte access each in the pool's dtype), chosen so that the 16 lanes of
// a row read one contiguous 256-byte run per instruction:
//     k(kl, e) = (e / kVec) * (KL * kVec) + kl * kVec + e % kVec,   e = 0..7.
// Per token (all math fp32): every lane normalises its slices of q and k (sums of squares over the KL
// lanes of its row group with xor shuffles), computes the gate and decay of its 8 channels, then for
// each of its rows decays the state and forms partial dots S·k; a reduce-scatter over the KL lanes leaves
// each lane with the complete prediction of one row, which it turns into r = β (v - p); an all-gather
// gives every lane the r of its NR rows for the rank-1 update, and a second reduce-scatter forms S·q.
// Both reductions combine lanes in the same xor order (KL/2, ..., 1) for every NR, so the result does not
// depend on the tile choice (bit-identical), and no atomics are used (deterministic).
// The next token's q, k, g, v, beta are loaded into registers while the current token is computed.
//
// Scheduling: a persistent grid (as many blocks as fit on the SMs); warp w handles items w, w+W, ...
// An item's start state is copied from the pool into a per-warp shared-memory ring with cp.async
// kStages items ahead (RingLayout), so a warp always has the next items' state in flight while it computes
// the current one, and the bytes in flight are bounded by shared memory, not by registers. The slot lookups
// of an item (cu_seqlens, ssm_state_indices, num_accepted_tokens) are resolved when it is prefetched and
// kept in the ring's ItemMeta. Prefetching ahead is safe because items of different sequences never
// share a slot (caller contract, docs/contract.md "Slots and checkpoints") and the items of one sequence
// touch disjoint rows.
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <mutex>

#include "kda/common/bf16_bits.cuh"
#include "kda/common/pdl.cuh"
#include "kda/common/recurrent_rules.h"
#include "kda/decode/recurrent_instantiations.h"
#include "kda/params.h"

namespace kda::decode {

constexpr unsigned kFullMask = 0xffffffffu;

template <int K_, typename StateT_, int NR_>
struct RecurrentTile {
  static constexpr int K = K_;
  using StateT = StateT_;
  static constexpr int NR = NR_;                          // state rows per lane
  static constexpr int KL = K / 8;                        // lanes per row (8 K values each)
  static constexpr int RP = 32 / KL;                      // rows per register row of the warp
  static constexpr int kRowsPerWarp = NR * RP;            // value rows owned by one warp
  static constexpr int kTilesPerHead = K / kRowsPerWarp;  // V == K
  static constexpr int kVec = 16 / int(sizeof(StateT));   // pool elements per 16-byte access
  static constexpr int kChunks = 8 / kVec;                // 16-byte accesses per lane per row
  static_assert(K == 64 || K == 128, "head dim must be 64 or 128");
  static_assert(NR >= 1 && NR <= KL && (NR & (NR - 1)) == 0, "NR must be a power of two <= K/8");
  static_assert(kTilesPerHead >= 1, "tile taller than the head");

  // Offset (elements) inside a row of the lane's chunk c.
  __device__ static __forceinline__ int chunk_offset(int kl, int c) { return c * (KL * kVec) + kl * kVec; }
};

// ---------------------------------------------------------------------------------------------------
// Warp reductions over the KL lanes of a row group.

// Reduce-scatter: on entry each lane holds NR partial sums x[0..NR) (one per register row); on exit x[0] is
// the complete sum (over the KL lanes) of register row rs_row_index(lane). log2(KL) xor steps; steps that
// still hold more than one value exchange half of them (NR-1 shuffles in all), the rest are all-reduce.
template <int O, int C, int NR>
__device__ __forceinline__ void reduce_scatter_step(float (&x)[NR], int lane) {
  if constexpr (O >= 1) {
    if constexpr (C > 1) {
      constexpr int H = C / 2;
      const bool upper = (lane & O) != 0;
#pragma unroll
      for (int j = 0; j < H; ++j) {
        const float send = upper ? x[j] : x[j + H];
        const float keep = upper ? x[j + H] : x[j];
        x[j] = keep + __shfl_xor_sync(kFullMask, send, O);
      }
      reduce_scatter_step<O / 2, H, NR>(x, lane);
    } else {
      x[0] += __shfl_xor_sync(kFullMask, x[0], O);
      reduce_scatter_step<O / 2, 1, NR>(x, lane);
    }
  }
}

template <int KL, int NR>
__device__ __forceinline__ float reduce_scatter(float (&x)[NR], int lane) {
  reduce_scatter_step<KL / 2, NR, NR>(x, lane);
  return x[0];
}

// Register row whose sum reduce_scatter leaves in `lane`.
template <int KL, int NR>
__device__ __forceinline__ int rs_row_index(int lane) {
  int idx = 0, c = NR;
#pragma unroll
  for (int o = KL / 2; o >= 1; o >>= 1) {
    if (c > 1) {
      c >>= 1;
      if (lane & o) idx += c;
    }
  }
  return idx;
}

// Lane bits that only duplicate a reduce_scatter result (lanes with these bits 0 are the writers).
template <int KL, int NR>
__host__ __device__ constexpr int rs_duplicate_bits() {
  int m = 0, c = NR;
  for (int o = KL / 2; o >= 1; o >>= 1) {
    if (c > 1)
      c >>= 1;
    else
      m |= o;
  }
  return m;
}

// Lane (within the row group) that holds register row i after reduce_scatter.
template <int KL, int NR>
__host__ __device__ constexpr int rs_source_lane(int i) {
  int src = 0, c = NR;
  for (int o = KL / 2; o >= 1; o >>= 1) {
    if (c > 1) {
      c >>= 1;
      if (i & c) src |= o;
    }
  }
  return src;
}

template <int KL>
__device__ __forceinline__ void allreduce2(float& a, float& b) {
#pragma unroll
  for (int o = KL / 2; o >= 1; o >>= 1) {
    a += __shfl_xor_sync(kFullMask, a, o);
    b += __shfl_xor_sync(kFullMask, b, o);
  }
}

// ---------------------------------------------------------------------------------------------------
// Numerics.

// exp(a) to about 1 ulp for the per-channel decay. The fast-math __expf (ex2.approx, ~2 ulp) is kept for
// the gate and beta sigmoids, whose error does not compound; the decay multiplies the state every token,
// and with slow decay (a near 0) a biased 2-ulp error would add up over thousands of decode steps.
// |a| is clamped to the fp32 range: exp(-87) ~ 1.6e-38 (a state times it flushes to 0 under ftz).
__device__ __forceinline__ float exp_decay(float a) {
  a = fminf(fmaxf(a, -87.0f), 88.0f);
  const float n = rintf(a * 1.44269504088896341f);
  float r = fmaf(n, -0.693145751953125f, a);   // ln2 high part: n * it is exact
  r = fmaf(n, -1.428606765330187045e-06f, r);  // ln2 low part; |r| <= 0.35
  float e = 1.0f / 5040.0f;                    // Taylor to degree 7: truncation < 6e-9 relative
  e = fmaf(e, r, 1.0f / 720.0f);
  e = fmaf(e, r, 1.0f / 120.0f);
  e = fmaf(e, r, 1.0f / 24.0f);
  e = fmaf(e, r, 1.0f / 6.0f);
  e = fmaf(e, r, 0.5f);
  e = fmaf(e, r, 1.0f);
  e = fmaf(e, r, 1.0f);
  return e * __int_as_float((static_cast<int>(n) + 127) << 23);  // n in [-126, 127]
}

// ---------------------------------------------------------------------------------------------------
// Memory: N (4 or 8) contiguous values <-> fp32. Alignment: N * sizeof(T) bytes, at most 16.

// (bf16_lo / bf16_hi / pack_bf16x2: kda/common/bf16_bits.cuh)

template <int N>
__device__ __forceinline__ void load_vals(const float* p, float* out) {
#pragma unroll
  for (int i = 0; i < N; i += 4) {
    const float4 w = *reinterpret_cast<const float4*>(p + i);
    out[i] = w.x, out[i + 1] = w.y, out[i + 2] = w.z, out[i + 3] = w.w;
  }
}
template <int N>
__device__ __forceinline__ void load_vals(const __nv_bfloat16* p, float* out) {
  if constexpr (N == 8) {
    const uint4 w = *reinterpret_cast<const uint4*>(p);
    const uint32_t ws[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) out[2 * i] = bf16_lo(ws[i]), out[2 * i + 1] = bf16_hi(ws[i]);
  } else {
    static_assert(N == 4);
    const uint2 w = *reinterpret_cast<const uint2*>(p);
    out[0] = bf16_lo(w.x), out[1] = bf16_hi(w.x), out[2] = bf16_lo(w.y), out[3] = bf16_hi(w.y);
  }
}
template <int N>
__device__ __forceinline__ void store_vals(float* p, const float* in) {
#pragma unroll
  for (int i = 0; i < N; i += 4)
    *reinterpret_cast<float4*>(p + i) = make_float4(in[i], in[i + 1], in[i + 2], in[i + 3]);
}
template <int N>
__device__ __forceinline__ void store_vals(__nv_bfloat16* p, const float* in) {
  if constexpr (N == 8) {
    *reinterpret_cast<uint4*>(p) = make_uint4(pack_bf16x2(in[0], in[1]), pack_bf16x2(in[2], in[3]),
                                              pack_bf16x2(in[4], in[5]), pack_bf16x2(in[6], in[7]));
  } else {
    static_assert(N == 4);
    *reinterpret_cast<uint2*>(p) = make_uint2(pack_bf16x2(in[0], in[1]), pack_bf16x2(in[2], in[3]));
  }
}

// The warp's tile of one [V, K] head block: register row i is value row row0 + i*RP + rg.
template <class Tile, typename T>
__device__ __forceinline__ void load_tile(const T* head, int row0, int rg, int kl, float (&s)[Tile::NR][8]) {
#pragma unroll
  for (int i = 0; i < Tile::NR; ++i) {
    const T* row = head + int64_t(row0 + i * Tile::RP + rg) * Tile::K;
#pragma unroll
    for (int c = 0; c < Tile::kChunks; ++c)
      load_vals<Tile::kVec>(row + Tile::chunk_offset(kl, c), &s[i][c * Tile::kVec]);
  }
}
template <class Tile, typename T>
__device__ __forceinline__ void store_tile(T* head, int row0, int rg, int kl, const float (&s)[Tile::NR][8]) {
#pragma unroll
  for (int i = 0; i < Tile::NR; ++i) {
    T* row = head + int64_t(row0 + i * Tile::RP + rg) * Tile::K;
#pragma unroll
    for (int c = 0; c < Tile::kChunks; ++c)
      store_vals<Tile::kVec>(row + Tile::chunk_offset(kl, c), &s[i][c * Tile::kVec]);
  }
}
// Same, for buffers whose dtype is only known at run time (source pool, checkpoints): fp32 or bf16.
template <class Tile>
__device__ __forceinline__ void load_tile_dt(const void* base, DType dt, int64_t head_off, int row0, int rg, int kl,
                                             float (&s)[Tile::NR][8]) {
  if (dt == DType::kBFloat16)
    load_tile<Tile>(static_cast<const __nv_bfloat16*>(base) + head_off, row0, rg, kl, s);
  else
    load_tile<Tile>(static_cast<const float*>(base) + head_off, row0, rg, kl, s);
}
template <class Tile>
__device__ __forceinline__ void store_tile_dt(void* base, DType dt, int64_t head_off, int row0, int rg, int kl,
                                              const float (&s)[Tile::NR][8]) {
  if (dt == DType::kBFloat16)
    store_tile<Tile>(static_cast<__nv_bfloat16*>(base) + head_off, row0, rg, kl, s);
  else
    store_tile<Tile>(static_cast<float*>(base) + head_off, row0, rg, kl, s);
}

// The start state of an item whose tile is not staged in shared memory: slot `slot` of the read-only source
// pool when `from_source` (StartState kind 2), else zeros (no start state, or a skipped item).
template <class Tile>
__device__ __forceinline__ void load_unstaged_start(const RecurrentParams& p, bool from_source, int64_t slot,
                                                    int64_t head_off, int row0, int rg, int kl,
                                                    float (&s)[Tile::NR][8]) {
  if (from_source) {
    load_tile_dt<Tile>(p.state_source, p.state_source_dtype, slot * p.source_slot_stride + head_off, row0, rg, kl, s);
  } else {
#pragma unroll
    for (int i = 0; i < Tile::NR; ++i)
#pragma unroll
      for (int e = 0; e < 8; ++e) s[i][e] = 0.f;
  }
}

// One token's inputs as this lane needs them: its 8 values of q, k, g (bf16 pairs, Tile order), the v of
// the row it reduces (rs_row_index), and beta.
struct TokenRaw {
  uint32_t q[4], k[4], g[4];
  float v, beta;
};

template <class Tile>
__device__ __forceinline__ void load_token_slice(const __nv_bfloat16* base, int kl, uint32_t (&w)[4]) {
#pragma unroll
  for (int c = 0; c < Tile::kChunks; ++c) {
    const __nv_bfloat16* ptr = base + Tile::chunk_offset(kl, c);
    if constexpr (Tile::kVec == 8) {
      const uint4 x = __ldg(reinterpret_cast<const uint4*>(ptr));
      w[0] = x.x, w[1] = x.y, w[2] = x.z, w[3] = x.w;
    } else {
      const uint2 x = __ldg(reinterpret_cast<const uint2*>(ptr));
      w[2 * c] = x.x, w[2 * c + 1] = x.y;
    }
  }
}

template <class Tile>
__device__ __forceinline__ void load_token(const RecurrentParams& p, int64_t batch, int64_t tok, int h, int hv, int kl,
                                           int my_row, TokenRaw& r) {
  const auto* q = p.q.row<__nv_bfloat16>(batch, tok, h);
  const auto* k = p.k.row<__nv_bfloat16>(batch, tok, h);
  const auto* g = p.g.row<__nv_bfloat16>(batch, tok, hv);
  const auto* v = p.v.row<uint16_t>(batch, tok, hv) + my_row;
  const auto* b = p.beta.row<uint16_t>(batch, tok, hv);
  load_token_slice<Tile>(q, kl, r.q);
  load_token_slice<Tile>(k, kl, r.k);
  load_token_slice<Tile>(g, kl, r.g);
  r.v = bf16_bits_to_float(__ldg(v));
  r.beta = bf16_bits_to_float(__ldg(b));
}

// ---------------------------------------------------------------------------------------------------
// The item pipeline of a warp (items w, w + W, w + 2W, ... in "pipeline order" j = 0, 1, 2, ...):
//  * item metadata (sequence range, start slot) is resolved 32 items at a time, one item per lane, into a
//    double-buffered per-warp table in shared memory: the slot lookups (cu_seqlens, ssm_state_indices,
//    num_accepted_tokens, initial_state_indices) cost one stall per 32 items instead of one per item;
//  * an item's start state is copied from the pool into a per-warp ring with cp.async (L2 only, no registers
//    held) kStages items ahead, so the bytes in flight per SM are bounded by shared memory, not registers;
//    a lane reads back only the 16-byte pieces it copied itself (lane-major, conflict-free), so
//    cp.async.wait_group plus __syncwarp is all the synchronisation needed;
//  * when an item's copy is issued, its first token's q, k, g, v, beta, its gate parameters and (spec
//    decode) its slot row are prefetched into L1, so the loads at the start of the item hit L1.

__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void prefetch_l1(const void* ptr) {
  asm volatile("prefetch.global.L1 [%0];\n" ::"l"(ptr));
}

// What the resolution found about an item. kind: StartState kind (0 zeros, 1 pool, 2 source, -1 inactive);
// kNoItem: past the end or a broken seq_order entry.
struct ItemMeta {
  int64_t bos, len;  // SeqRange (token range along T)
  int64_t slot;      // StartState slot
  int32_t batch;     // SeqRange batch row
  int32_t n;         // sequence
  int32_t kind;
  int32_t tile, hv;
  int32_t pad;
};
constexpr int kNoItem = -100;
constexpr int kMetaBatch = 16;  // items resolved at once (one per lane of the first half-warp)

template <class Tile>
struct RingLayout {
  static constexpr int kTileBytes = Tile::NR * Tile::kChunks * 32 * 16;
  // About 12 KB of ring per warp: 2 to 4 items deep (bf16 NR=8: 3 x 4 KB; fp32 NR=8: 2 x 8 KB).
  static constexpr int kStages = kTileBytes >= 6144 ? 2 : (kTileBytes >= 3072 ? 3 : 4);
  static constexpr int kRingBytes = kStages * kTileBytes;
  static constexpr int kMetaBytes = 2 * kMetaBatch * int(sizeof(ItemMeta));
  // Per warp: the ring, then the two meta tables; a multiple of 128 bytes keeps every warp's ring aligned.
  static constexpr int kWarpBytes = (kRingBytes + kMetaBytes + 127) / 128 * 128;
  static_assert(kStages < kMetaBatch, "a meta table must outlive the items in flight");
};

__device__ __forceinline__ bool decode_item(const RecurrentParams& p, int64_t item, int tiles_per_head, int& tile,
                                            int& hv, int64_t& n) {
  // tile fastest, then value head, then sequence: the warps of one block share one head's q/k/g in L1.
  tile = static_cast<int>(item % tiles_per_head);
  const int64_t nh = item / tiles_per_head;
  if (nh <= 0xffffffffll) {  // the common case: 32-bit division by the run-time HV is far cheaper
    const uint32_t nh32 = static_cast<uint32_t>(nh), hv32 = static_cast<uint32_t>(p.HV);
    hv = static_cast<int>(nh32 % hv32);
    n = nh32 / hv32;
  } else {
    hv = static_cast<int>(nh % p.HV);
    n = nh / p.HV;
  }
  if (p.seq_order != nullptr) {  // scheduling hint (a permutation); a broken one never reads out of bounds
    n = p.seq_order[n];
    if (n < 0 || n >= p.N) return false;
  }
  return true;
}

// Lane l resolves pipeline item j0 + l into table[l] (SeqRange and StartState: the shared rules).
template <class Tile>
__device__ __forceinline__ void resolve_items(const RecurrentParams& p, int64_t j0, int64_t first, int64_t stride,
                                              int64_t total, ItemMeta* table, int lane) {
  if (lane < kMetaBatch) {
    const int64_t item = first + (j0 + lane) * stride;
    ItemMeta m{};
    m.kind = kNoItem;
    int tile, hv;
    int64_t n;
    if (item < total && decode_item(p, item, Tile::kTilesPerHead, tile, hv, n)) {
      const SeqRange sr = seq_range(p, n);
      const StartState st = start_state(p, n);
      m.bos = sr.bos, m.len = sr.len, m.slot = st.slot, m.batch = static_cast<int32_t>(sr.batch);
      m.n = static_cast<int32_t>(n), m.kind = st.kind, m.tile = tile, m.hv = hv;
    }
    table[lane] = m;
  }
  __syncwarp();
}

// Kernel flags (kDiag*, kFlagNoL1Prefetch, kFlagNoStateUpdate): recurrent_instantiations.h.

// Issue the start-state copy of item m into `ring` (one cp.async group, empty or not, so the wait_group
// counts stay uniform) and prefetch its first token's inputs into L1.
template <class Tile>
__device__ __forceinline__ void prefetch_item(const RecurrentParams& p, const ItemMeta& m, uint4* ring, int lane,
                                              bool l1) {
  using StateT = typename Tile::StateT;
  const int kl = lane % Tile::KL, rg = lane / Tile::KL;
  if (m.kind >= 0 && m.len > 0) {  // a zero-length or inactive sequence's pool state is never needed
    if (m.kind == 1) {
      const StateT* head =
          static_cast<const StateT*>(p.state) + m.slot * p.state_slot_stride + int64_t(m.hv) * Tile::K * Tile::K;
#pragma unroll
      for (int i = 0; i < Tile::NR; ++i)
#pragma unroll
        for (int c = 0; c < Tile::kChunks; ++c)
          cp_async_16(
              ring + (i * Tile::kChunks + c) * 32 + lane,
              head + int64_t(m.tile * Tile::kRowsPerWarp + i * Tile::RP + rg) * Tile::K + Tile::chunk_offset(kl, c));
    }
    if (!l1) {
      cp_async_commit();
      return;
    }
    const int h = qk_head(p, m.hv);
    const int64_t b = m.batch, t = m.bos;
    const auto* q = p.q.row<__nv_bfloat16>(b, t, h);
    const auto* k = p.k.row<__nv_bfloat16>(b, t, h);
    const auto* g = p.g.row<__nv_bfloat16>(b, t, m.hv);
#pragma unroll
    for (int c = 0; c < Tile::kChunks; ++c) {
      prefetch_l1(q + Tile::chunk_offset(kl, c));
      prefetch_l1(k + Tile::chunk_offset(kl, c));
      prefetch_l1(g + Tile::chunk_offset(kl, c));
    }
    if (lane < 2) {  // the warp's rows of v (<= 64 contiguous bytes): its first and last element
      const int row = m.tile * Tile::kRowsPerWarp + lane * (Tile::kRowsPerWarp - 1);
      prefetch_l1(p.v.row<__nv_bfloat16>(b, t, m.hv) + row);
    }
    if (lane == 0) {
      prefetch_l1(p.beta.row<__nv_bfloat16>(b, t, m.hv));
      if (p.gate_mode != GateMode::kPrecomputed) prefetch_l1(p.A_log + m.hv);
      if (p.num_spec_tokens > 0) prefetch_l1(p.ssm_state_indices + int64_t(m.n) * (p.num_spec_tokens + 1));
    }
    if (p.dt_bias != nullptr && p.gate_mode != GateMode::kPrecomputed && lane < Tile::K / 32)
      prefetch_l1(p.dt_bias + int64_t(m.hv) * Tile::K + lane * 32);  // 128-byte lines
  }
  cp_async_commit();
}

template <class Tile>
__device__ __forceinline__ void unpack_ring_tile(const uint4* ring, int lane, float (&s)[Tile::NR][8]) {
  using StateT = typename Tile::StateT;
#pragma unroll
  for (int i = 0; i < Tile::NR; ++i)
#pragma unroll
    for (int c = 0; c < Tile::kChunks; ++c) {
      const uint4 w = ring[(i * Tile::kChunks + c) * 32 + lane];
      load_vals<Tile::kVec>(reinterpret_cast<const StateT*>(&w), &s[i][c * Tile::kVec]);
    }
}

// dt_bias[hv, k(kl, e)], 0 when absent. A plain (coherent) load inside the token loop: the compiler cannot
// hoist it past the loop's stores, so it is re-read from L1 per token instead of pinning 8 registers.
template <class Tile>
__device__ __forceinline__ float dt_bias_at(const float* dtb, int kl, int e) {
  return dtb != nullptr ? dtb[Tile::chunk_offset(kl, e / Tile::kVec) + e % Tile::kVec] : 0.f;
}

// ---------------------------------------------------------------------------------------------------

// The token loop of one item (docs/contract.md "Recurrence" per token; checkpoints; speculative per-token
// slot writes; the output row of each token). On entry `s` holds the item's start state and `cur` its
// first token's inputs; on exit `s` holds the state after the last token (the caller writes it to the pool
// / final state). Shared by the cp.async-ring kernel and the warp-specialised kernel
// (recurrent_ring_kernel.cuh), so both compute the same bits.
// `dtb`: dt_bias[hv, :] (global or shared memory), null when absent; `A` = exp(A_log[hv]).
template <class Tile>
__device__ __forceinline__ void run_item_tokens(const RecurrentParams& p, const int flags, const ItemMeta& m,
                                                const int lane, TokenRaw cur, const int32_t spec_slot, const float A,
                                                const float* dtb, float (&s)[Tile::NR][8]) {
  using StateT = typename Tile::StateT;
  constexpr int K = Tile::K, NR = Tile::NR, KL = Tile::KL, RP = Tile::RP;
  const int kl = lane % KL, rg = lane / KL;
  const int my_idx = rs_row_index<KL, NR>(lane);
  const bool writer = (lane & rs_duplicate_bits<KL, NR>()) == 0;
  const int64_t inner = int64_t(p.HV) * K * K;
  const int S = p.num_spec_tokens;
  const int every = p.checkpoint_every_n_tokens;
  const int hv = m.hv;
  const int64_t n = m.n;
  const int row0 = m.tile * Tile::kRowsPerWarp;
  const int my_row = row0 + my_idx * RP + rg;
  const int h = qk_head(p, hv);
  const int64_t head_off = int64_t(hv) * K * K;
  uint16_t* out =
      static_cast<uint16_t*>(p.out) + int64_t(m.batch) * p.out_batch_stride + int64_t(hv) * p.out_head_stride + my_row;
  const int64_t ckpt_row0 = every > 0 ? p.checkpoint_cu_starts[n] : 0;

  int64_t next_ckpt = 0;
  for (int64_t t = 0; t < m.len; ++t) {
    TokenRaw nxt;
    if (t + 1 < m.len) load_token<Tile>(p, m.batch, m.bos + t + 1, h, hv, kl, my_row, nxt);

    if (every > 0 && t == next_ckpt) {  // the state BEFORE token t
      const int64_t row = t / every >= p.checkpoint_first ? ckpt_row0 + t / every - p.checkpoint_first : -1;
      if (row >= 0 && row < p.n_checkpoint_rows)
        store_tile_dt<Tile>(p.state_checkpoints, p.checkpoint_dtype, row * inner + head_off, row0, rg, kl, s);
      next_ckpt += every;
    }

    // Speculative decode: the state after token t goes to slot ssm_state_indices[n, t]; a token whose slot
    // is outside the pool is inactive (token_active in recurrent_rules.h), as is a token past column S
    // (a sequence longer than 1+S, a broken contract, never indexes past its row).
    int64_t wslot = -1;
    if (S > 0 && t <= S) wslot = S < 32 ? __shfl_sync(kFullMask, spec_slot, static_cast<int>(t)) : write_slot(p, n, t);
    const bool active = S == 0 || (t <= S && slot_in_pool(wslot, p.n_pool));
    if (!active) {
      if (writer) out[(m.bos + t) * p.out_token_stride] = 0;
      cur = nxt;
      continue;
    }

    float o = 0.f;
    if (!(flags & kDiagNoMath)) {
      // ---- token prep: normalised q (with scale) and k, decay, beta (docs/contract.md "Recurrence", steps 1-3)
      float qf[8], kf[8], dec[8];
#pragma unroll
      for (int w = 0; w < 4; ++w) {
        qf[2 * w] = bf16_lo(cur.q[w]), qf[2 * w + 1] = bf16_hi(cur.q[w]);
        kf[2 * w] = bf16_lo(cur.k[w]), kf[2 * w + 1] = bf16_hi(cur.k[w]);
        dec[2 * w] = bf16_lo(cur.g[w]), dec[2 * w + 1] = bf16_hi(cur.g[w]);
      }
      float qscale = p.scale, kscale = 1.f;
      if (p.use_qk_l2norm) {
        float sq = 0.f, sk = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) sq = fmaf(qf[e], qf[e], sq), sk = fmaf(kf[e], kf[e], sk);
        allreduce2<KL>(sq, sk);
        qscale = rsqrtf(sq + kL2NormEps) * p.scale;
        kscale = rsqrtf(sk + kL2NormEps);
      }
      // Gate (docs/contract.md "Recurrence", step 2): one branch per token, not per channel.
      if (p.gate_mode == GateMode::kLowerBound) {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          dec[e] = gate_log_decay<float>(GateMode::kLowerBound, dec[e], A, dt_bias_at<Tile>(dtb, kl, e), p.lower_bound);
      } else if (p.gate_mode == GateMode::kSoftplus) {
#pragma unroll
        for (int e = 0; e < 8; ++e)
          dec[e] = gate_log_decay<float>(GateMode::kSoftplus, dec[e], A, dt_bias_at<Tile>(dtb, kl, e), p.lower_bound);
      }
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        qf[e] *= qscale;
        kf[e] *= kscale;
        dec[e] = exp_decay(dec[e]);
      }
      const float beta = p.beta_is_logit ? kda_sigmoid(cur.beta) : cur.beta;

      // ---- decay and prediction p = S k ("Recurrence", steps 4-5)
      float acc[NR];
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        float a0 = 0.f, a1 = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[i][e] *= dec[e];
          a0 = fmaf(s[i][e], kf[e], a0);
          s[i][e + 4] *= dec[e + 4];
          a1 = fmaf(s[i][e + 4], kf[e + 4], a1);
        }
        acc[i] = a0 + a1;
      }
      const float pred = reduce_scatter<KL, NR>(acc, lane);
      const float r = beta * (cur.v - pred);

      // ---- rank-1 update S += r k^T and output o = S q (steps 6-7)
#pragma unroll
      for (int i = 0; i < NR; ++i) {
        const float ri = __shfl_sync(kFullMask, r, rg * KL + rs_source_lane<KL, NR>(i));
        float o0 = 0.f, o1 = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          s[i][e] = fmaf(ri, kf[e], s[i][e]);
          o0 = fmaf(s[i][e], qf[e], o0);
          s[i][e + 4] = fmaf(ri, kf[e + 4], s[i][e + 4]);
          o1 = fmaf(s[i][e + 4], qf[e + 4], o1);
        }
        acc[i] = o0 + o1;
      }
      o = reduce_scatter<KL, NR>(acc, lane);
    }
    if (writer) {
      const __nv_bfloat16 ob = __float2bfloat16_rn(o);
      out[(m.bos + t) * p.out_token_stride] = *reinterpret_cast<const uint16_t*>(&ob);
    }
    // spec decode: the state after token t goes to its own slot (not in a verify pass, kFlagNoStateUpdate)
    if (S > 0 && !(flags & (kDiagNoStateStore | kFlagNoStateUpdate)))
      store_tile<Tile>(static_cast<StateT*>(p.state) + wslot * p.state_slot_stride + head_off, row0, rg, kl, s);
    cur = nxt;
  }
}

// Persistent warps: warp w of the grid handles items w, w + W, w + 2W, ... (W = warps in the grid); an item
// is (sequence, value head, row tile). Per item: wait for its ring slot, read the start state into
// registers, refill the slot with the item kStages ahead, then run the item's tokens.
// Register budget (__launch_bounds__ min blocks of 128 threads): 3 blocks = 12 warps per SM, 168 registers a
// thread, on sm_90+. Unforced, nvcc 13.0 gives the NR=8 tiles 212-222 registers on sm_90a (2 blocks, 8 warps
// per SM) and up to 255 on sm_100a/103a; at the cap every tile compiles without spills (sm_90a: NR=8 168,
// NR=4 158-160, NR=2 157, NR=1 148).
template <class Tile>
constexpr int recurrent_min_blocks() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  return 3;
#else
  return 1;
#endif
}

template <class Tile>
__global__ void __launch_bounds__(128, recurrent_min_blocks<Tile>())
    kda_recurrent_kernel(const RecurrentParams p, const int flags) {
  pdl_wait_and_release_dependents();
  using StateT = typename Tile::StateT;
  using Ring = RingLayout<Tile>;
  constexpr int K = Tile::K, NR = Tile::NR, KL = Tile::KL, RP = Tile::RP, kStages = Ring::kStages;
  constexpr int kTileU4 = Ring::kTileBytes / 16;
  extern __shared__ __align__(16) unsigned char smem_raw[];

  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int warps_per_block = blockDim.x >> 5;
  uint4* ring = reinterpret_cast<uint4*>(smem_raw + warp * Ring::kWarpBytes);
  ItemMeta* metas = reinterpret_cast<ItemMeta*>(smem_raw + warp * Ring::kWarpBytes + Ring::kRingBytes);

  const int64_t total = p.N * p.HV * Tile::kTilesPerHead;
  const int64_t stride = int64_t(gridDim.x) * warps_per_block;
  const int64_t first = int64_t(blockIdx.x) * warps_per_block + warp;
  auto meta_at = [&](int64_t j) -> ItemMeta* { return metas + ((j / kMetaBatch) & 1) * kMetaBatch + j % kMetaBatch; };

  resolve_items<Tile>(p, 0, first, stride, total, metas, lane);
  const bool l1 = !(flags & kFlagNoL1Prefetch);
#pragma unroll
  for (int st = 0; st < kStages; ++st) prefetch_item<Tile>(p, *meta_at(st), ring + st * kTileU4, lane, l1);

  const int kl = lane % KL, rg = lane / KL;
  const int my_idx = rs_row_index<KL, NR>(lane);
  const bool writer = (lane & rs_duplicate_bits<KL, NR>()) == 0;
  const int64_t inner = int64_t(p.HV) * K * K;  // elements of one [HV, V, K] block
  const int S = p.num_spec_tokens;

  int stage = 0;
  int64_t j = 0;
  for (int64_t item = first; item < total; item += stride, ++j, stage = stage + 1 == kStages ? 0 : stage + 1) {
    // The item's metadata was resolved when its copy was issued (the table is complete after
    // resolve_items' __syncwarp), so everything that does not need the state is loaded BEFORE waiting for
    // the state copy: the first token's q, k, g, v, beta, (spec decode) the slot row, A_log and, for the
    // warp's first item, an L1 prefetch of dt_bias. A warp with one item (small batches: the chain is
    // slot lookup -> state -> math -> store) then waits for one global round trip instead of two.
    const ItemMeta m = *meta_at(j);
    const bool skip = m.kind == kNoItem;
    const int tile = m.tile, hv = m.hv;
    const int64_t n = m.n;
    const int row0 = tile * Tile::kRowsPerWarp;
    const int my_row = row0 + my_idx * RP + rg;  // row this lane reduces and writes
    const int h = qk_head(p, hv);                // GQA: contiguous groups of value heads per q/k head
    const int64_t head_off = int64_t(hv) * K * K;

    TokenRaw cur;
    int32_t spec_slot = -1;  // lane t holds the write slot of token t (t <= S < 32)
    float A = 0.f;           // exp(A_log[hv]): the gate constant of this value head
    const float* dtb = nullptr;
    if (!skip && m.kind >= 0 && m.len > 0) {
      load_token<Tile>(p, m.batch, m.bos, h, hv, kl, my_row, cur);
      if (S > 0 && S < 32 && lane <= S) spec_slot = p.ssm_state_indices[n * (S + 1) + lane];
      if (p.gate_mode != GateMode::kPrecomputed) A = __expf(__ldg(p.A_log + hv));
      if (p.dt_bias != nullptr) {
        dtb = p.dt_bias + int64_t(hv) * K;
        if (j == 0 && p.gate_mode != GateMode::kPrecomputed) {
#pragma unroll
          for (int c = 0; c < Tile::kChunks; ++c) prefetch_l1(dtb + Tile::chunk_offset(kl, c));
        }
      }
    }
    cp_async_wait<kStages - 1>();  // this item's state copy (the oldest group) has landed
    __syncwarp();
    float s[NR][8];
    if (!skip && m.kind == 1 && m.len > 0) {
      unpack_ring_tile<Tile>(ring + stage * kTileU4, lane, s);
    } else {
      load_unstaged_start<Tile>(p, !skip && m.kind == 2, m.slot, head_off, row0, rg, kl, s);
    }
    __syncwarp();                         // every lane has read its ring slot before it is refilled
    if ((j + kStages) % kMetaBatch == 0)  // the next table, one stall per 32 items (its buffer is consumed)
      resolve_items<Tile>(p, j + kStages, first, stride, total, meta_at(j + kStages), lane);
    prefetch_item<Tile>(p, *meta_at(j + kStages), ring + stage * kTileU4, lane, l1);
    if (skip) continue;

    uint16_t* out = static_cast<uint16_t*>(p.out) + int64_t(m.batch) * p.out_batch_stride +
                    int64_t(hv) * p.out_head_stride + my_row;

    if (m.kind < 0) {
      // Inactive sequence: zero output, no state read or write (its final-state and checkpoint rows are
      // left as they are, the same as the CPU loop; the Python layer allocates them zero-filled).
      if (writer)
        for (int64_t t = 0; t < m.len; ++t) out[(m.bos + t) * p.out_token_stride] = 0;
      continue;
    }
    // (dt_bias is re-read per token from L1 instead of held in registers)
    run_item_tokens<Tile>(p, flags, m, lane, cur, spec_slot, A, dtb, s);

    // A zero-length sequence leaves its slot bit-identical.
    if (S == 0 && p.state != nullptr && m.len > 0 && !(flags & (kDiagNoStateStore | kFlagNoStateUpdate)))
      store_tile<Tile>(static_cast<StateT*>(p.state) + write_slot(p, n, 0) * p.state_slot_stride + head_off, row0, rg,
                       kl, s);
    if (p.final_state != nullptr) store_tile<Tile>(p.final_state + n * inner + head_off, row0, rg, kl, s);
  }
  cp_async_wait<0>();  // no copy outlives the block (the tail prefetches are empty groups, but be exact)
}

// Launch helpers shared by the decode launchers (this file's kernel, recurrent_ring_kernel.cuh).
// Shared memory `blocks` resident blocks of `block_bytes` occupy (the system reserves 1 KB per block).
inline int resident_smem_bytes(int blocks, int block_bytes) {
  return blocks * (block_bytes + 1024);
}

// The carveout percent a launch asks for: kCarveoutUntouched (-2) leaves the driver's, kCarveoutMin takes
// the smallest percent of the SM's 228 KB that holds `need` bytes, any other value is a percent (-1: the
// driver default).
inline int carveout_percent_for(int setting, int need) {
  if (setting == kCarveoutMin) return std::min(100, (need * 100 + 228 * 1024 - 1) / (228 * 1024));
  return setting;
}

// Persistent grid: enough blocks for `warps` work items, at most what stays resident on the device.
inline int64_t persistent_blocks(int64_t warps, int warps_per_block, int blocks_per_sm, int num_sms) {
  const int64_t needed = (warps + warps_per_block - 1) / warps_per_block;
  const int64_t resident = int64_t(blocks_per_sm) * num_sms;
  return needed < resident ? needed : resident;
}

// What a kernel instantiation needs set up once per device before its first launch: the dynamic-smem
// opt-in, the occupancy of each block shape (1, 2, 4 warps) and the shared-memory carveout. Filled under a
// per-device std::call_once, so concurrent first calls from several host threads neither race on the
// tables nor launch before the attributes are set; later calls (and graph capture) only read it.
struct KernelSetup {
  int max_blocks[5] = {};  // resident blocks per SM, indexed by warps per block (1, 2, 4)
};
constexpr int kMaxDevices = 64;

template <typename Kernel>
const KernelSetup& kernel_setup(Kernel kernel, std::once_flag (&once)[kMaxDevices], KernelSetup (&setup)[kMaxDevices],
                                int warp_bytes, const RecurrentLaunch& cfg) {
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= kMaxDevices) dev = 0;
  std::call_once(once[dev], [&] {
    KernelSetup& s = setup[dev];
    if (warp_bytes * 4 > 48 * 1024)
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, warp_bytes * 4);
    int need = 0;  // shared memory of the most resident blocks of any block shape
    for (int w : {1, 2, 4}) {
      int v = 0;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&v, kernel, w * 32, w * warp_bytes) != cudaSuccess || v <= 0)
        v = 1;
      s.max_blocks[w] = v;
      const int b = cfg.max_blocks_per_sm > 0 && cfg.max_blocks_per_sm < v ? cfg.max_blocks_per_sm : v;
      need = std::max(need, resident_smem_bytes(b, w * warp_bytes));
    }
    // The carveout setting is read once per process (RecurrentLaunch comes from the launcher's knobs), so
    // one attribute call per device is enough.
    if (cfg.carveout_percent != kCarveoutUntouched)
      cudaFuncSetAttribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                           carveout_percent_for(cfg.carveout_percent, need));
    (void)cudaGetLastError();  // a refused attribute is not a launch error
  });
  return setup[dev];
}

template <int K, typename StateT, int NR>
void run_recurrent_(const RecurrentParams& p, const RecurrentLaunch& cfg, cudaStream_t stream) {
  using Tile = RecurrentTile<K, StateT, NR>;
  using Ring = RingLayout<Tile>;
  auto kernel = kda_recurrent_kernel<Tile>;
  const int threads = cfg.warps_per_block * 32;
  const int smem = cfg.warps_per_block * Ring::kWarpBytes;
  // Occupancy is a property of the instantiation, the block shape and the device: queried once per device
  // for every block shape, on the first (eager) call, together with the dynamic-smem opt-in above 48 KB and
  // the shared-memory carveout. The carveout defaults to the smallest one that holds the resident blocks of
  // any block shape, leaving the rest of the SM's 256 KB to L1 (token inputs, gate parameters): on H200
  // that was up to 22% faster at large batch than the driver's choice (bench_decode, B=1024 bf16) and never
  // slower. Graph capture sees no attribute call after the first call.
  static std::once_flag once[kMaxDevices];
  static KernelSetup setup[kMaxDevices];
  const KernelSetup& ks = kernel_setup(kernel, once, setup, Ring::kWarpBytes, cfg);
  int blocks_per_sm = ks.max_blocks[cfg.warps_per_block];
  if (cfg.max_blocks_per_sm > 0 && cfg.max_blocks_per_sm < blocks_per_sm) blocks_per_sm = cfg.max_blocks_per_sm;
  const int64_t blocks =
      persistent_blocks(p.N * p.HV * Tile::kTilesPerHead, cfg.warps_per_block, blocks_per_sm, cfg.num_sms);
  (void)launch_kernel(kernel, dim3(static_cast<unsigned>(blocks)), dim3(threads), smem, stream, cfg.pdl, p, cfg.flags);
}

}  // namespace kda::decode
