// Chunked ("WY form") KDA prefill for Hopper (sm_90a) in CuTe/CUTLASS: the same per-chunk math as the
// mma.sync kernel (csrc/kda/chunked/chunked_kernel.cuh, docs/design.md "Chunked form"), C = 16 tokens per
// chunk, K = V = 128, with the Hopper machinery. Seven designs (template kVariant, Cfg below;
// KDA_EXPERIMENT=sm90_variant per call, default 3; 4, design
// 3 with the folded WY operands, an experiment: a lighter chain but a slower prep, not yet shown faster than 3
// (docs/performance.md); 5-7, a cluster of two CTAs per head sharing prep, each with half the value rows (Cfg<5>);
// the backward chain runs 2):
//   * TMA loads (SM90_TMA_LOAD, tensor maps encoded on the host) of the raw q, k, g tiles [16 tokens][128]
//     into rings guarded by cutlass::PipelineTmaAsync, and of the v tiles into a ring consumed by both chain
//     WGs (variant 4: by the prep WG of the chunk, which folds v into V'; the chain's loop below describes the
//     unfolded products, Cfg<4> and fold_wy the folded ones). Packed input uses per-sequence coordinates into the
//     packed tensor (domain_offset); rows past a sequence's end are real tokens of the next sequence (or TMA's zero
//     fill at the tensor's end) and are masked by the consumers. Variant 1: one thread of a producer WG issues every
//     load. Variants 2, 3: no producer WG; in each prep WG one thread (lane 0 of its leader warp: warp 3, or (w + 3)
//     mod 4 in prep WG w under the role rotation, kRotateRoles) issues the loads of that WG's chunks.
//   * Prep (variant 1: WG1 for every chunk; variant 2: WG0 for the even chunks, WG1 for the odd ones; variant 3: WG w
//     for the chunks c = w mod 3; each with its own raw ring, scratch and named barrier; a chunk's prep depends on
//     nothing before it): gate + in-chunk prefix (fp32), L2 norms, β, the decayed operands written as swizzled wgmma B
//     tiles (K⁺, Q⁺ bf16 K-major, Kr fp16 MN-major), L and Mqk (one warp each of mma.sync m16n8k16 with relative
//     exponents; exact pairwise exponentials on CUDA cores when an in-chunk decay span is too wide), the 16x16
//     unit-lower inverse in fp32 (8x8 blocks by forward substitution, then the off-diagonal block), INVb = INV diag(β)
//     and Mqk as fp16 B tiles. Hands the chunk's operands to the chain through a cutlass::PipelineAsync ring kOpStages
//     deep (chunk c in stage c mod kOpStages, whichever WG made it).
//   * the last two WGs (WG2 / WG3; variant 3: WG3 / WG4), chain: value rows 0-63 / 64-127 of the state
//     S[V, K] as an fp32 wgmma accumulator (64 registers per thread) for the whole sequence. Per chunk
//     (ᵀ: value rows first):
//       Xᵀ = S K⁺ᵀ, O_interᵀ = S Q⁺ᵀ   (RS wgmma m64n16k16 x 8, A = bf16(S) converted in registers; two
//                                       batches, v read while they run)
//       Yᵀ = Vᵀ - Xᵀ (padding tokens 0),  Uᵀ = Yᵀ INVbᵀ   (RS m64n16k16, fp16; S ⊙ γ_C while U runs)
//       S = S ⊙ γ_C + Uᵀ Kr              (RS m64n128k16, fp16, accumulating into the state registers)
//       Oᵀ = O_interᵀ + Uᵀ Mqkᵀ          (RS m64n16k16) -> bf16, registers to global
//     The two chain WGs share only read-only pipeline stages; each stage is released after both consumed it.
//   * setmaxnreg: variant 1: producer 40, prep 128, chain 168; variant 2: prep 112, chain 144 (ptxas: no
//     spill in either); variant 3: prep 64 (ptxas: ~100 bytes of spills), chain 144.
// Numerics: fp32 state and accumulators, bf16 operands for S and the unbounded factors, fp16 for the bounded
// R path (as the mma.sync kernel). Variants 1 and 2 give the same bits (3 does the same operations in the
// same order per chunk: the same bits as 2 on the benchmark shapes).
// Covered (chunked_sm90_launch.cu, chunked_sm90_supported): the prefill calls of the chunked
// kernel, bf16 tokens, fixed or packed, GQA, the three gate modes, logit or plain β, L2 norm on/off, bf16/fp32
// pool slots with inactive slots, zero, pool or read-only source (initial_state_source) start states, final
// state to the pool or to final_state, checkpoints every multiple of 16 tokens (and so the training forward's
// tapes), state-only calls (no output: an instantiation of variant 3 without q, Q⁺, Mqk and the output product,
// kStateOnly), seq_order, and the training backward's chain (kBwd: the chunks last first, dRᵀ = dS Krᵀ + dOᵀ Mqk,
// dXᵀ = -dRᵀ INVb, dS = dS ⊙ γ_C + dOᵀ Q⁺ + dXᵀ K⁺ with bf16 operands, the mma.sync kernel's BWD mode). seq_order
// (the longest-first task order the Python layer sets for packed calls) maps blockIdx to the sequence.
// The profile instantiation (kProfile, KDA_EXPERIMENT=sm90_profile=1): clock cycles per role and segment of CTA 0 into
// kda_sm90_prof.
// Known limits (profile and Nsight Compute of H=96 T=8192 on the H200, docs/performance.md), in the order they
// matter for speed:
//   * prep is still the limit in variant 3: each prep WG takes ~12.7k cycles per chunk (three chunks in flight,
//     so ~4.2k a chunk), the chain ~2.6k of its own and ~1.7k waiting for operands. The largest prep parts:
//     operand tiles ~2.8k, the inverse (one warp) ~2.4k before its 16-byte row loads, gate + norms ~2.0k,
//     L / Mqk ~1.7k, waits at the warpgroup's named barrier ~1.3k. ncu: 2.2 instructions issued per cycle per SM
//     (of 4), one eligible warp per scheduler, the mbarrier waits the largest stall. (Variant 3's profile
//     instantiation spills ~450 bytes, which distorts its segment table; variant 2's does not spill.)
//   * shared memory: the chain's v read (16-bit loads across token rows) has 4-way bank conflicts;
//   * the chain: X / O_inter are one N=32 GEMM over the stacked [K⁺; Q⁺] tile; ptxas serialises it (C7511, register
//     resources), though it measured faster than two N=16 batches;
//   * the two chain warpgroups are not ping-ponged (no ordered barrier): they only share read-only stages.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "kda/chunked/chunk_math.cuh"
#include "kda/common/bf16_bits.cuh"
#include "kda/common/gmma_swizzle.cuh"
#include "kda/common/ptx.cuh"
#include "kda/common/recurrent_rules.h"
#include "kda/params.h"

#if defined(__CUDA_ARCH__) && (__CUDA_ARCH__ == 900) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define KDA_SM90_DEVICE 1
#endif

namespace kda::chunked_sm90 {

using namespace cute;
using namespace ::kda::chunk_math;  // gate prefix, norms, β, the 16x16 inverse (shared with the mma.sync kernel)
using bf16_t = cutlass::bfloat16_t;
using f16_t = cutlass::half_t;

constexpr int kC = 16;   // tokens per chunk
constexpr int kD = 128;  // K = V
// The designs (template kVariant, KDA_EXPERIMENT=sm90_variant, default 3; the backward chain: 1 or 2, default 2):
//   1: a producer warpgroup (one thread issues every TMA load) and one prep warpgroup for all chunks;
//   2: two prep warpgroups, each for every other chunk (prep of a chunk depends on nothing before it), each
//      issuing the TMA loads of its own chunks (raw q/k/g into its own ring, v into the shared v ring); no
//      producer warpgroup. Prep throughput doubles; registers: prep 112, chain 144 (v1: producer 40, prep 128,
//      chain 168).
//   3: three prep warpgroups (chunk c on warpgroup c mod 3, a raw ring of one stage each), 640 threads; prep
//      is latency-bound (a warpgroup issues a small part of the cycles it takes per chunk), so a third one
//      in flight raises its throughput; registers: prep 64, chain 144 (the pool of 640 threads x 96).
// The operand ring's depth (a build-time knob for timing it, -DKDA_SM90_OP_STAGES=N): 5, the deepest that fits the
// 227 KB with variant 3 (6 does not); 4 measured 2-5% slower on every prefill case (the prep warpgroups and the
// chain waited on each other more). The v ring follows it (the static_asserts below).
#ifndef KDA_SM90_OP_STAGES
#define KDA_SM90_OP_STAGES 5
#endif
constexpr int kOpStagesDefault = KDA_SM90_OP_STAGES;                                  // operand ring (prep -> chain)
constexpr int kVStagesDefault = kOpStagesDefault + 4 > 8 ? kOpStagesDefault + 4 : 8;  // raw v ring (TMA -> chain)
template <int kVariant>
struct Cfg;
struct CfgRings {  // variants 1-3: the default ring depths, the chain reads v
  static constexpr int kOpStages = kOpStagesDefault, kVStages = kVStagesDefault;
  static constexpr bool kFold = false;
  static constexpr int kCluster = 1, kChainWGs = 2;  // one CTA per (sequence, head), both chain WGs in it
  static constexpr bool kSepOi = false;              // (see Cfg<8>)
};
template <>
struct Cfg<1> : CfgRings {
  static constexpr int kPrepWGs = 1, kRawStages = 4;  // one raw ring of 4 stages
  static constexpr int kPrepRegs = 128, kChainRegs = 168, kProducerRegs = 40;
  static constexpr int kThreads = 512;  // producer, prep, 2 chain warpgroups
  static constexpr int kChainWG0 = 2;   // the first chain warpgroup
};
template <>
struct Cfg<2> : CfgRings {
  static constexpr int kPrepWGs = 2, kRawStages = 2;  // a raw ring of 2 stages per prep warpgroup
  static constexpr int kPrepRegs = 112, kChainRegs = 144, kProducerRegs = 0;
  static constexpr int kThreads = 512;  // 2 prep, 2 chain warpgroups
  static constexpr int kChainWG0 = 2;
};
template <>
struct Cfg<3> : CfgRings {
  static constexpr int kPrepWGs = 3, kRawStages = 1;  // a raw ring of 1 stage per prep warpgroup
  static constexpr int kPrepRegs = 64, kChainRegs = 144, kProducerRegs = 0;
  static constexpr int kThreads = 640;  // 3 prep, 2 chain warpgroups
  static constexpr int kChainWG0 = 3;
};
// 4: variant 3 with the WY inverse folded into the chain's operands (docs/design.md "Folded WY operands"): prep
//    consumes the v tiles and makes −W' = −INVb K⁺ (bf16, in the K⁺ half of the stacked tile) and V'ᵀ = (INVb V)ᵀ
//    (fp16, the chain's seed tile) on all four warps after the inverse (fold_wy below); the chain runs two dependent
//    wgmma batches per chunk instead of three and reads no v. Four operand stages (the V' tiles take the fifth's
//    room); a v ring of 6 (prep warpgroup w's leader refills it for chunk c + 3 once chunk c - 3, its own, released
//    it: no wait on another warpgroup).
template <>
struct Cfg<4> : Cfg<3> {
  static constexpr int kOpStages = 4, kVStages = 6;
  static constexpr bool kFold = true, kSepOi = true;
};
// 5: prep shared by a cluster of two CTAs that split a head's value rows (docs/design.md "Prep shared by a CTA
//    pair"). CTA r of the pair runs the chain of value rows 64 r .. 64 r + 63 (one chain warpgroup) and preps the
//    chunks c with c mod 2 = r (prep warpgroup (c / 2) mod 2 of it): each chunk is prepped once for both chains,
//    so a CTA's two prep warpgroups make every fourth chunk. The producing warpgroup writes the chunk's operand
//    stage in its own CTA and one of its threads copies the stage into the peer's (cp.async.bulk shared::cluster,
//    completing on the peer's full barrier); a stage is free when the chain warps of both CTAs released it (their
//    arrivals on the producing CTA's empty barrier; stage s is always made by CTA s mod 2, kOpStages even). The
//    chain's thread 0 loads the v tiles itself. Registers: 384 threads, prep 160, chain 184 (no spills).
template <>
struct Cfg<5> {
  static constexpr int kPrepWGs = 2, kRawStages = 2;
  static constexpr int kOpStages = 6, kVStages = 8;
  static constexpr bool kFold = false;
  static constexpr int kCluster = 2, kChainWGs = 1;
  static constexpr bool kSepOi = false;
  static constexpr int kPrepRegs = 160, kChainRegs = 184, kProducerRegs = 0;
  static constexpr int kThreads = 384;
  static constexpr int kChainWG0 = 2;
};
static_assert(Cfg<5>::kOpStages % Cfg<5>::kCluster == 0, "variant 5: stage s is made by CTA s mod kCluster");
// 6: design 5 with design 4's folded operands: the producing warpgroup folds v into V'ᵀ for all 128 value rows
//    (its leader loads the chunk's v, a ring of 4 per CTA, stage (c / 2) mod 4, two per prep warpgroup) and sends
//    the peer its 64 rows of V'ᵀ with −W', Q⁺, Kr, Mqk and γ; the chain loads nothing. One raw stage per warpgroup.
template <>
struct Cfg<6> : Cfg<5> {
  static constexpr int kRawStages = 1, kVStages = 4;
  static constexpr bool kFold = true, kSepOi = true;
};
// 7: design 5 with three prep warpgroups per CTA (chunk c on CTA c mod 2, warpgroup (c / 2) mod 3), 512 threads:
//    prep 3 x 104 registers, chain 200; one raw stage per warpgroup, a v ring of 4.
template <>
struct Cfg<7> : Cfg<5> {
  static constexpr int kPrepWGs = 3, kRawStages = 1, kVStages = 4;
  static constexpr int kPrepRegs = 104, kChainRegs = 200;
  static constexpr int kThreads = 512;
  static constexpr int kChainWG0 = 3;
};
// 8: design 5 with O_intra = Uᵀ Mqkᵀ in an accumulator of its own (as design 4), which removes ptxas's wgmma
//    serialisation (C7511) of the chain; not design 3's bits (O_inter + O_intra rounded in another order).
template <>
struct Cfg<8> : Cfg<5> {
  static constexpr bool kSepOi = true;
};
constexpr int kOpStages = kOpStagesDefault, kVStages = kVStagesDefault;  // (variants 1-3)
// Variants 2 and 3: a leader at chunk c holds operand stage c mod kOpStages uncommitted while it issues the loads
// of chunk c + kPrepWGs * kRawStages; its v acquire needs the chain to have released v of that chunk minus
// kVStages, which must be a chunk the chain already finished (it did, when operand stage c was free, for every
// chunk up to c - kOpStages), else the leader and the chain wait on each other. Variant 4: prep releases v, and the
// chunk c + 3 - kVStages is one of the leader's own warpgroup, prepped before chunk c.
static_assert(kVStages >= Cfg<2>::kPrepWGs * Cfg<2>::kRawStages + kOpStages, "variant 2: the v acquire must not wait");
static_assert(kVStages >= Cfg<3>::kPrepWGs * Cfg<3>::kRawStages + kOpStages, "variant 3: the v acquire must not wait");
static_assert(Cfg<4>::kVStages % Cfg<4>::kPrepWGs == 0 && Cfg<4>::kVStages >= 2 * Cfg<4>::kPrepWGs &&
                  Cfg<6>::kVStages % Cfg<6>::kPrepWGs == 0 && Cfg<6>::kVStages >= 2 * Cfg<6>::kPrepWGs,
              "variants 4, 6: the v acquire waits only on the leader's own warpgroup");
// registers: setmaxnreg moves registers within the CTA's pool, the registers it was launched with (65536 /
// threads per thread, rounded down to a multiple of 8): the warpgroups' counts together must fit in it, else
// the chain's increase waits forever
// (the launcher also checks the count ptxas chose, cudaFuncGetAttributes' numRegs, against setmaxnreg_sum)
template <int V>
constexpr int setmaxnreg_sum() {  // per thread of each warpgroup, summed over the warpgroups
  using C = Cfg<V>;
  return C::kProducerRegs + C::kPrepWGs * C::kPrepRegs + C::kChainWGs * C::kChainRegs;
}
template <int V>
constexpr bool regs_fit() {
  return setmaxnreg_sum<V>() <= (Cfg<V>::kThreads / 128) * ((65536 / Cfg<V>::kThreads) / 8 * 8);
}
static_assert(regs_fit<1>() && regs_fit<2>() && regs_fit<3>() && regs_fit<4>() && regs_fit<5>() && regs_fit<6>() &&
                  regs_fit<7>() && regs_fit<8>(),
              "setmaxnreg counts exceed the CTA's register pool");
constexpr int kBarPrep = 1;   // named barrier of prep warpgroup w: kBarPrep + w (0 is __syncthreads)
constexpr int kBarOut = 4;    // named barrier of chain warpgroup w (output staging): kBarOut + w
constexpr int kOStride = 72;  // output staging row (64 value rows + 8: 16-byte rows, no 2-way bank conflicts)
// per-warp output staging (kWarpOutput): [16 tokens][16 value rows], rows of 24 elements (48 bytes: 16-byte
// aligned; the accumulator's writes, tokens 2 apart per lane quad, fall on banks 0, 24, 16, 8: no conflicts)
constexpr int kWStride = 24, kWStage = kC * kWStride;

// ---- shared-memory layouts
// raw token tiles as TMA writes them: [16 tokens][128] row-major, no swizzle (read by CUDA cores)
using LayoutRaw = Layout<Shape<_16, _128>, Stride<_128, _1>>;
template <int kStages>
using LayoutRawRing = Layout<Shape<_16, _128, Int<kStages>>, Stride<_128, _1, _2048>>;
template <int kStages>
using LayoutVRingS = Layout<Shape<_16, _128, Int<kStages>>, Stride<_128, _1, _2048>>;
// wgmma B tiles. K⁺, Q⁺: (N = 16 tokens, K = 128 channels), K-major, 128-byte swizzle.
template <int kStages>
using LayoutKdS = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_16, _128, Int<kStages>>{}));
// The forward's stacked [K⁺; Q⁺] tile (variant 4: [−W'; Q⁺]): (N = 32: K⁺ tokens 0-15, then Q⁺ tokens 0-15, K = 128
// channels), K-major, 128-byte swizzle, so Xᵀ and O_interᵀ are one N = 32 product. The backward chain uses its two
// halves as separate tiles (LayoutKd and LayoutKr), SharedStorage::kd / qd.
template <int kStages>
using LayoutKQS = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_32, _128, Int<kStages>>{}));
// Kr: (N = 128 channels, K = 16 tokens), MN-major (channels contiguous), 128-byte swizzle.
template <int kStages>
using LayoutKrS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<f16_t>{}, Shape<_128, _16, Int<kStages>>{}));
// INVb, Mqk: (N = 16 output tokens, K = 16 tokens), K-major, 32-byte swizzle.
template <int kStages>
using LayoutT16S = decltype(tile_to_shape(GMMA::Layout_K_SW32_Atom<f16_t>{}, Shape<_16, _16, Int<kStages>>{}));
// (the default depths: variants 1-3; the kernel takes its variant's from Cfg)
using LayoutVRing = LayoutVRingS<kVStages>;
using LayoutKd = LayoutKdS<kOpStages>;
using LayoutKQ = LayoutKQS<kOpStages>;
using LayoutKr = LayoutKrS<kOpStages>;
using LayoutT16 = LayoutT16S<kOpStages>;
static_assert(cosize_v<LayoutKQ> == 2 * cosize_v<LayoutKd>, "the stacked tile holds the K⁺ and Q⁺ tiles");
// (variant 5 copies stage s of each operand tile as one block: the stage is the outermost mode)
static_assert(cosize_v<LayoutKQS<6>> == 6 * cosize_v<LayoutKQS<1>> &&
                  cosize_v<LayoutKdS<6>> == 6 * cosize_v<LayoutKdS<1>> &&
                  cosize_v<LayoutKrS<6>> == 6 * cosize_v<LayoutKrS<1>> &&
                  cosize_v<LayoutT16S<6>> == 6 * cosize_v<LayoutT16S<1>>,
              "operand stages are contiguous blocks");
// Variant 4's V'ᵀ seed tile: [128 value rows][16 tokens] fp16 per stage, the pair of tokens (2 p, 2 p + 1) of row m
// at pair slot p ^ (4 ((m >> 2) & 1)): the accumulator's reads (and prep's writes), 8 rows x 4 pairs per
// instruction, then fall on 32 distinct banks.
__device__ __forceinline__ int vp_offset(int m, int t) {
  return m * kC + 2 * ((t >> 1) ^ (4 * ((m >> 2) & 1))) + (t & 1);
}

// Element offsets in the swizzled layouts above: swz_offset (kda/common/gmma_swizzle.cuh).

// ---- the rings of the cluster design (variant 5). cutlass's PipelineTmaAsync built for a cluster of one sends every
// consumer release to the CTA of rank 0, which inside a real cluster is the wrong CTA for rank 1: the TMA rings
// local to a CTA use LocalTmaPipe (PipelineTmaAsync's interface and protocol on this CTA's own barriers).
// A ring's full and empty mbarriers, initialised by one lane of `warp` with the counts full_count(s), empty_count.
template <int S>
struct RingBarriers {
  alignas(8) uint64_t full[S];
  alignas(8) uint64_t empty[S];
  template <class FullCount>
  __device__ void init(int warp, FullCount full_count, uint32_t empty_count) {
    if (cutlass::canonical_warp_idx_sync() == warp && cute::elect_one_sync()) {
      for (int s = 0; s < S; ++s) {
        cutlass::arch::ClusterBarrier::init(&full[s], full_count(s));
        cutlass::arch::ClusterBarrier::init(&empty[s], empty_count);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
};
// The interface types of the cutlass pipeline a ring stands in for (Pipe: PipelineTmaAsync or PipelineAsync).
template <int S, class Pipe>
struct RingTypes {
  static constexpr uint32_t Stages = S;
  using PipelineState = cutlass::PipelineState<S>;
  using ThreadCategory = typename Pipe::ThreadCategory;
  using Params = typename Pipe::Params;
  using SharedStorage = RingBarriers<S>;
};
template <int S>
class LocalTmaPipe : public RingTypes<S, cutlass::PipelineTmaAsync<S>> {
 public:
  using typename RingTypes<S, cutlass::PipelineTmaAsync<S>>::PipelineState;
  using typename RingTypes<S, cutlass::PipelineTmaAsync<S>>::Params;
  using typename RingTypes<S, cutlass::PipelineTmaAsync<S>>::SharedStorage;
  template <class ClusterShape>
  __device__ LocalTmaPipe(SharedStorage& st, Params params, ClusterShape)
      : full_(st.full), empty_(st.empty), p_(params) {
    st.init(params.initializing_warp, [&](int) { return params.num_producers; }, params.num_consumers);
  }
  __device__ void producer_acquire(PipelineState st) {  // (the leader thread)
    cutlass::arch::ClusterBarrier::wait(&empty_[st.index()], st.phase());
    if (p_.is_leader)
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full_[st.index()], p_.transaction_bytes);
  }
  __device__ uint64_t* producer_get_barrier(PipelineState st) { return &full_[st.index()]; }
  __device__ void consumer_wait(PipelineState st) {
    cutlass::arch::ClusterBarrier::wait(&full_[st.index()], st.phase());
  }
  __device__ void consumer_release(PipelineState st) { cutlass::arch::ClusterBarrier::arrive(&empty_[st.index()]); }

 private:
  uint64_t* full_;
  uint64_t* empty_;
  Params p_;
};

// The operand ring of the cluster design: PipelineAsync's interface, stage s made by CTA s mod kCS. Its full barrier
// takes the producing warpgroup's 128 arrivals in that CTA (producer_commit) and, in the peers, one arrival with the
// stage's bytes (send: one thread of the producing warpgroup, once the warpgroup's writes are complete and fenced);
// its empty barrier in the producing CTA takes one arrival per chain warp of every CTA (consumer_release).
template <int S, int kCS>
class ClusterOpPipe : public RingTypes<S, cutlass::PipelineAsync<S>> {
 public:
  using typename RingTypes<S, cutlass::PipelineAsync<S>>::PipelineState;
  using typename RingTypes<S, cutlass::PipelineAsync<S>>::Params;
  using typename RingTypes<S, cutlass::PipelineAsync<S>>::SharedStorage;
  __device__ ClusterOpPipe(SharedStorage& st, Params params)
      : full_(st.full), empty_(st.empty), rank_(static_cast<int>(cute::block_rank_in_cluster())) {
    st.init(
        params.initializing_warp, [&](int s) { return owner(s) == rank_ ? params.producer_arv_count : 1u; },
        params.consumer_arv_count);
  }
  static __device__ int owner(int s) { return s % kCS; }
  __device__ void producer_acquire(PipelineState st) {
    cutlass::arch::ClusterBarrier::wait(&empty_[st.index()], st.phase());
  }
  __device__ void producer_commit(PipelineState st) { cutlass::arch::ClusterBarrier::arrive(&full_[st.index()]); }
  __device__ void consumer_wait(PipelineState st) {
    cutlass::arch::ClusterBarrier::wait(&full_[st.index()], st.phase());
  }
  // one arrival per warp (after its wgmmas reading the stage completed) on the producing CTA's empty barrier
  __device__ void consumer_release(PipelineState st) {
    __syncwarp();
    if ((threadIdx.x & 31) == 0) cutlass::arch::ClusterBarrier::arrive(&empty_[st.index()], owner(st.index()), 1u);
  }
  // the stage's n pieces (this CTA's shared addresses, 16-byte aligned, multiples of 16 bytes) into every peer's same
  // addresses, completing on the peer's full barrier of the stage (one thread)
  template <int N>
  __device__ void send(PipelineState st, const void* const (&src)[N], const uint32_t (&bytes)[N]) {
    uint32_t total = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) total += bytes[i];
    const uint32_t bar = cute::cast_smem_ptr_to_uint(&full_[st.index()]);
#pragma unroll
    for (int d = 1; d < kCS; ++d) {
      const uint32_t peer = static_cast<uint32_t>((rank_ + d) % kCS);
      cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(&full_[st.index()], total, peer, 1u);
      const uint32_t rbar = map_to(bar, peer);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const uint32_t a = cute::cast_smem_ptr_to_uint(src[i]);
        asm volatile(
            "cp.async.bulk.shared::cluster.shared::cta.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                map_to(a, peer)),
            "r"(a), "r"(bytes[i]), "r"(rbar)
            : "memory");
      }
    }
  }

 private:
  static __device__ uint32_t map_to(uint32_t a, uint32_t rank) {
    uint32_t r;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(rank));
    return r;
  }
  uint64_t* full_;
  uint64_t* empty_;
  int rank_;
};

template <int kVariant>
using PipeRaw = std::conditional_t<(Cfg<kVariant>::kCluster > 1), LocalTmaPipe<Cfg<kVariant>::kRawStages>,
                                   cutlass::PipelineTmaAsync<Cfg<kVariant>::kRawStages>>;
template <int kVariant>
using PipeVOf = std::conditional_t<(Cfg<kVariant>::kCluster > 1), LocalTmaPipe<Cfg<kVariant>::kVStages>,
                                   cutlass::PipelineTmaAsync<Cfg<kVariant>::kVStages>>;
template <int kVariant>
using PipeOpOf =
    std::conditional_t<(Cfg<kVariant>::kCluster > 1), ClusterOpPipe<Cfg<kVariant>::kOpStages, Cfg<kVariant>::kCluster>,
                       cutlass::PipelineAsync<Cfg<kVariant>::kOpStages>>;

// prep-only scratch of one prep warpgroup (one chunk at a time; that warpgroup's named barrier orders it)
struct PrepScratch {
  alignas(16) __nv_bfloat16 km[kC * kD], qm[kC * kD], kn[kC * kD];  // XOR-swizzled for ldmatrix
  alignas(16) float gp[kC * kD];                                    // Γ' = Γ - Γ_0 (log2 units)
  alignas(16) float e0[kD], ecp[kD], a0[kD], gc[kD];
  alignas(16) float rq[kC], rk[kC], beta[kC];
  alignas(16) float ap[kC * kC];  // A' = diag(β) strict_tril(L)
  alignas(16) float i2s[8 * 8];
};
struct PrepScratchFold : PrepScratch {  // variant 4: INVb in fp32 (the inverse's output, the fold products' input)
  alignas(16) float inv[kC * kC];
};

template <int kVariant>
struct SharedStorage {
  using Cf = Cfg<kVariant>;
  static constexpr int kRawSlots = Cf::kPrepWGs * Cf::kRawStages;  // raw q/k/g tile slots
  static constexpr int kPrepWGs = Cf::kPrepWGs, kOp = Cf::kOpStages;
  static constexpr bool kFold = Cf::kFold;
  // prep -> chain operands (ring of kOpStages)
  alignas(1024) bf16_t kq[cosize_v<LayoutKQS<kOp>>];  // forward: LayoutKQ; backward chain: the kd and qd halves below
  alignas(1024) f16_t kr[cosize_v<LayoutKrS<kOp>>];
  alignas(1024) f16_t invb[kFold ? 8 : cosize_v<LayoutT16S<kOp>>];  // (variant 4: none, INVb is folded)
  alignas(1024) f16_t mqk[cosize_v<LayoutT16S<kOp>>];
  alignas(16) f16_t vp[kFold ? kOp * kD * kC : 8];  // variant 4: V'ᵀ per stage (vp_offset)
  alignas(16) float gamma[kOp][kD];                 // e^{Γ_C} per channel
  // TMA destinations: raw q/k/g slots (variant 1: one ring of all of them; 2: a ring of half of them per
  // prep warpgroup), the v ring
  alignas(128) bf16_t q[kRawSlots * kC * kD];
  alignas(128) bf16_t k[kRawSlots * kC * kD];
  alignas(128) bf16_t g[kRawSlots * kC * kD];
  alignas(128) bf16_t v[cosize_v<LayoutVRingS<Cf::kVStages>>];
  std::conditional_t<kFold, PrepScratchFold, PrepScratch> prep[kPrepWGs];
  // output staging of the chain WGs: O[token][value row] of a chunk's 64 value rows, double-buffered
  alignas(16) __nv_bfloat16 ostage[2][2][kC * kOStride];
  alignas(16) typename PipeRaw<kVariant>::SharedStorage pipe_raw[kPrepWGs];  // one raw ring per prep warpgroup
  alignas(16) typename PipeVOf<kVariant>::SharedStorage pipe_v;
  alignas(16) typename PipeOpOf<kVariant>::SharedStorage pipe_op;
  // the backward chain's two tiles in kq (each half 1024-byte aligned: cosize_v<LayoutKd> * 2 bytes is a multiple)
  __device__ bf16_t* kd() { return kq; }
  __device__ bf16_t* qd() { return kq + cosize_v<LayoutKdS<kOp>>; }
};
static_assert(cosize_v<LayoutKd> * 2 % 1024 == 0, "the qd half of kq is 1024-byte aligned");
static_assert(2 * 4 * kWStage <= 2 * 2 * kC * kOStride, "the per-warp output buffers live in ostage");
static_assert(sizeof(SharedStorage<1>) + 1024 <= 227 * 1024 && sizeof(SharedStorage<2>) + 1024 <= 227 * 1024 &&
                  sizeof(SharedStorage<3>) + 1024 <= 227 * 1024 && sizeof(SharedStorage<4>) + 1024 <= 227 * 1024 &&
                  sizeof(SharedStorage<5>) + 1024 <= 227 * 1024 && sizeof(SharedStorage<6>) + 1024 <= 227 * 1024 &&
                  sizeof(SharedStorage<7>) + 1024 <= 227 * 1024,
              "shared memory per block (227 KB on sm_90)");

// ---- TMA of one token tensor [B, T, heads, 128] (bf16): gmem modes (T, 128, heads, B), box (16, 128).
inline auto make_token_tma(const void* ptr, int T, int heads, int B, int64_t ts, int64_t hs, int64_t bs) {
  Tensor g = make_tensor(make_gmem_ptr(static_cast<const bf16_t*>(ptr)),
                         make_layout(make_shape(T, Int<kD>{}, heads, B), make_stride(ts, Int<1>{}, hs, bs)));
  return make_tma_copy(SM90_TMA_LOAD{}, g, LayoutRaw{}, Shape<_16, _128>{}, Int<1>{});
}
using TmaToken = decltype(make_token_tma(nullptr, 1, 1, 1, int64_t(8), int64_t(8), int64_t(8)));

// schedule (KDA_EXPERIMENT=sm90_schedule, default 11: every bit but kWarpOutput, which measured no gain; it stays for
// when the chain limits): with kRotateRoles, prep warpgroup w runs its serial roles (L and the inverse; Mqk; the TMA
// leader) on warps w, w + 1, w + 3 (mod 4) rather than 0, 1, 3, so the serial parts of the prep warpgroups issue from
// different SM sub-partitions (warp i issues from sub-partition i mod 4; unrotated, every L/inverse warp shared
// sub-partition 0). Measured on the H200 (docs/performance.md): 5-6% faster at H=96. (Acquiring the operand stage after
// the gate and norms instead of before them measured no gain and was removed.) With kVectorInverse, the 16x16 inverse
// reads its rows with 16-byte loads (chunk_math.cuh; without it, scalar loads, the earlier form): 3% faster at H=96 in
// variant 3, 5% in variant 2. With kWarpOutput, each chain warp transposes and stores its own 16 output rows (no named
// barrier of the chain warpgroup per chunk; the chain loop below). With kSplitInverseRows (which implies the vector
// loads), the inverse's last phase (the off-diagonal block's products and every store) runs on all 32 lanes, half the
// rows each, instead of lanes 0-15.
constexpr int kRotateRoles = 1, kVectorInverse = 2, kWarpOutput = 4, kSplitInverseRows = 8;
// Diagnostic schedule bits of the forward (the profile instantiation only, itself an experiment, so that the timed
// instantiations carry none of their code; the results are then meaningless):
// kDiagChainOnly, prep makes the operands of the first kOpStages chunks only and the chain reuses them for every later
// chunk (no operand or v wait after those): the chain's own cycles per chunk; kDiagPrepOnly, the chain waits for each
// stage and releases it at once (no products, no output): prep's throughput alone.
constexpr int kDiagChainOnly = 16, kDiagPrepOnly = 32;
struct KernelArgs {
  RecurrentParams p;
  TmaToken tma_q, tma_k, tma_g, tma_v;
  int schedule;
};

// ---- small device helpers
__device__ __forceinline__ int swz(int row, int piece) {
  return row * kD + ((piece ^ (row & 7)) << 3);
}
struct TileOffsets {
  int off[4];
  __device__ __forceinline__ TileOffsets(int row, int bit) {
#pragma unroll
    for (int q = 0; q < 4; ++q) off[q] = row * kD + (((2 * q + bit) ^ (row & 7)) << 3);
  }
  __device__ __forceinline__ int at(int ks) const { return off[ks & 3] + (ks >> 2) * 64; }
};
// ldmatrix, mma.sync, named barriers: the shared device primitives (kda/common/ptx.cuh).
using ptx::ldsm_x4;
using ptx::named_sync;
using ptx::named_sync_or;
__device__ __forceinline__ float sat_f16(float x) {
  return fminf(fmaxf(x, -65504.f), 65504.f);
}
__device__ __forceinline__ float bfv(const __nv_bfloat16 x) {
  return __bfloat162float(x);
}
__device__ __forceinline__ void load8f(const float* p, float (&x)[8]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z, x[7] = b.w;
}
__device__ __forceinline__ uint4 pack8_bf16(const float (&x)[8]) {
  return make_uint4(pack_bf16x2(x[0], x[1]), pack_bf16x2(x[2], x[3]), pack_bf16x2(x[4], x[5]), pack_bf16x2(x[6], x[7]));
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}
__device__ __forceinline__ uint4 pack8_f16(const float (&x)[8]) {
  return make_uint4(pack_f16x2(x[0], x[1]), pack_f16x2(x[2], x[3]), pack_f16x2(x[4], x[5]), pack_f16x2(x[6], x[7]));
}

// ---- variant 4's fold (prep, all four warps of the chunk's warpgroup, after the inverse; waits for INVb in `inv`
// and the chunk's v tile, releases nothing: the caller releases v and commits the operand stage). Warp w makes
// channels / value rows [32 w, 32 w + 32):
//   −W' = −INVb K⁺   over the K⁺ half of the stacked tile, in place (fp16 K⁺ from the operand phase; the warp reads
//                   and writes only its own 32 channels, every read done before its first write), bf16;
//   V'ᵀ = Vᵀ INVbᵀ   into the stage's seed tile (vp_offset), fp16 saturated; v's tokens past the chunk's end are
//                   zeroed in the fragment (INVb's columns there are 0, but the tile holds another sequence's rows).
// mma.sync m16n8k16 with fp16 operands and fp32 accumulators; INVb rounded to fp16 once, the A operand of W' and
// the B operand of V'ᵀ (reference_chunked.py folded_wy: "INVb" and "KV" fp16, "W" bf16, "Vp" fp16).
// Per warp: 4 fp32 pair loads, 4 ldmatrix.x4, 8 mma, 16 4-byte stores.
template <class LayoutKQ>
__device__ __forceinline__ void fold_wy(const float* inv, bf16_t* kq, int os, const __nv_bfloat16* vt, int cl,
                                        f16_t* vp, int warp, int lane) {
  const int g = lane >> 2, c = lane & 3;
  auto pair16 = [&](int r, int col) {
    const float2 x = *reinterpret_cast<const float2*>(inv + r * kC + col);
    return pack_f16x2(sat_f16(x.x), sat_f16(x.y));
  };
  // INVb as the A fragment: (row g, cols 2c, 2c + 1), (g + 8, ..), (g, 2c + 8, ..), (g + 8, 2c + 8, ..)
  const uint32_t ai[4] = {pair16(g, 2 * c), pair16(g + 8, 2 * c), pair16(g, 2 * c + 8), pair16(g + 8, 2 * c + 8)};
  // ldmatrix.x4.trans row addresses: lanes 0-7 tokens 0-7 / column block 0, 8-15 tokens 8-15 / 0, 16-23 tokens
  // 0-7 / block 1, 24-31 tokens 8-15 / block 1 (registers: b0, b1 of the block-0 n-tile, then of block 1)
  const int lrow = (lane & 7) + 8 * ((lane >> 3) & 1), lblk = lane >> 4;
  {
    uint32_t b[2][4];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      ptx::ldsm_x4_t(kq + swz_offset(LayoutKQ{}, lrow, 32 * warp + 16 * h + 8 * lblk, os), b[h]);
    float acc[4][4] = {};
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) ptx::mma_f16(acc[nt], ai, b[nt >> 1][2 * (nt & 1)], b[nt >> 1][2 * (nt & 1) + 1]);
    __syncwarp();  // (every lane's K⁺ reads precede the writes below)
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      const int n = 32 * warp + 8 * nt + 2 * c;
      *reinterpret_cast<uint32_t*>(kq + swz_offset(LayoutKQ{}, g, n, os)) = pack_bf16x2(-acc[nt][0], -acc[nt][1]);
      *reinterpret_cast<uint32_t*>(kq + swz_offset(LayoutKQ{}, g + 8, n, os)) = pack_bf16x2(-acc[nt][2], -acc[nt][3]);
    }
  }
  // V'ᵀ: A = Vᵀ (value rows, tokens) by ldmatrix.trans of the row-major [token][value] tile (row token, column
  // value block: lanes as above with the blocks swapped: 8-15 value block 1, 16-23 tokens 8-15)
  const int vrow = (lane & 7) + 8 * (lane >> 4), vblk = (lane >> 3) & 1;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int m0 = 32 * warp + 16 * mt;
    uint32_t a[4];
    ptx::ldsm_x4_t(vt + vrow * kD + m0 + 8 * vblk, a);
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // bf16 -> fp16, tokens 2c + 8 (r >> 1) (+1) past the end zeroed
      const int t = 2 * c + 8 * (r >> 1);
      a[r] = pack_f16x2(t < cl ? sat_f16(bf16_lo(a[r])) : 0.f, t + 1 < cl ? sat_f16(bf16_hi(a[r])) : 0.f);
    }
    float acc[2][4] = {};
    ptx::mma_f16(acc[0], a, ai[0], ai[2]);  // tokens 0-7: B = INVbᵀ, (k = j, n = i) = INVb[i][j]
    ptx::mma_f16(acc[1], a, ai[1], ai[3]);  // tokens 8-15
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
      const int t = 8 * nt + 2 * c;
      *reinterpret_cast<uint32_t*>(vp + vp_offset(m0 + g, t)) = pack_f16x2(sat_f16(acc[nt][0]), sat_f16(acc[nt][1]));
      *reinterpret_cast<uint32_t*>(vp + vp_offset(m0 + g + 8, t)) =
          pack_f16x2(sat_f16(acc[nt][2]), sat_f16(acc[nt][3]));
    }
  }
}

// ---- profile instantiation: per role (producer, prep, chain WG2, chain WG3) and per segment of the chunk loop,
// the clock cycles summed over the chunks of CTA 0, measured by the first thread of each role. Segments
// named in kProfNames (chunked_sm90_launch.cu prints them). Slot [role][kProfSegs] holds
// the chunk count.
constexpr int kProfRoles = 4, kProfSegs = 8;
// 32-bit clock and sums (half the registers of 64-bit ones, which matters in the 64-register prep warpgroups of
// variant 3): a difference of two clock() reads is exact modulo 2^32, and a segment's sum stays below 2^32
// cycles up to ~500k chunks of ~8k cycles.
struct ProfClock {
  unsigned acc[kProfSegs];
  unsigned t;
  __device__ __forceinline__ void start() {
#pragma unroll
    for (int i = 0; i < kProfSegs; ++i) acc[i] = 0;
    t = static_cast<unsigned>(clock());
  }
  __device__ __forceinline__ void mark(int seg) {  // the time since the last mark goes to `seg`
    const unsigned now = static_cast<unsigned>(clock());
    acc[seg] += now - t;
    t = now;
  }
};
// (this header is compiled into one translation unit, the launcher's, which reads it with cudaMemcpyFromSymbol)
__device__ unsigned long long kda_sm90_prof[kProfRoles][kProfSegs + 1];
template <bool kProfile>
struct Prof {
  ProfClock c;
  bool on;
  __device__ __forceinline__ void start(bool leader) {
    if constexpr (kProfile) {
      on = leader && blockIdx.x == 0;
      c.start();
    }
  }
  __device__ __forceinline__ void mark(int seg) {
    if constexpr (kProfile) c.mark(seg);
  }
  __device__ __forceinline__ void finish(int role, int64_t chunks) {
    if constexpr (kProfile) {
      if (on) {
#pragma unroll
        for (int i = 0; i < kProfSegs; ++i) kda_sm90_prof[role][i] = c.acc[i];
        kda_sm90_prof[role][kProfSegs] = static_cast<unsigned long long>(chunks);
      }
    }
  }
};

// kProfile: the profile instantiation (segment clocks of CTA 0 into kda_sm90_prof). kVariant: the design (Cfg
// above). In the chain, X and O_inter run as two wgmma batches (Y waits only for X), the γ scaling of the state
// while U runs. kStateOnly (the forward's state-only calls, no output: the sequence split's end-state passes): prep
// loads no q and makes neither Q⁺ nor Mqk, the chain skips the output product; the state's operations and their
// order are those of the call with an output (the same bits). The chain's stacked product still reads the Q⁺ half
// of its tile, whose contents it then ignores (its O_inter columns are never used).
// Design 5-8's copy of operand stage `os` into the peer CTA (one thread of the producing warpgroup, once the
// warpgroup's writes are complete and fenced): every tile of the stage, each a contiguous block of its ring. The
// forward: the stacked [K⁺; Q⁺] tile, Kr, INVb (design 6: the peer's 64 rows of V'ᵀ instead), Mqk, γ; the backward
// chain: Kr in kd, Q⁺ in qd (each a ring of its own), K⁺ in kr, INVb, Mqk, γ.
template <int kVariant, bool kBwd, class Pipe>
__device__ __forceinline__ void send_operand_stage(Pipe& pipe, typename Pipe::PipelineState st,
                                                   SharedStorage<kVariant>& ss, int os, int rank) {
  constexpr bool kFold = Cfg<kVariant>::kFold;
  const void* const mqk = ss.mqk + os * cosize_v<LayoutT16S<1>>;
  constexpr uint32_t b16 = cosize_v<LayoutT16S<1>> * 2, bkr = cosize_v<LayoutKrS<1>> * 2;
  if constexpr (kBwd) {
    const void* const src[6] = {ss.kd() + os * cosize_v<LayoutKdS<1>>,
                                ss.qd() + os * cosize_v<LayoutKrS<1>>,
                                ss.kr + os * cosize_v<LayoutKrS<1>>,
                                ss.invb + os * cosize_v<LayoutT16S<1>>,
                                mqk,
                                ss.gamma[os]};
    constexpr uint32_t bytes[6] = {cosize_v<LayoutKdS<1>> * 2, bkr, bkr, b16, b16, kD * 4};
    pipe.send(st, src, bytes);
  } else {
    const void* const fifth = kFold ? static_cast<const void*>(ss.vp + (os * kD + 64 * (rank ^ 1)) * kC)
                                    : static_cast<const void*>(ss.invb + os * cosize_v<LayoutT16S<1>>);
    const void* const src[5] = {ss.kq + os * cosize_v<LayoutKQS<1>>, ss.kr + os * cosize_v<LayoutKrS<1>>, fifth, mqk,
                                ss.gamma[os]};
    constexpr uint32_t bytes[5] = {cosize_v<LayoutKQS<1>> * 2, bkr, kFold ? 64 * kC * 2 : b16, b16, kD * 4};
    pipe.send(st, src, bytes);
  }
}

template <bool kProfile, int kVariant, bool kBwd = false, bool kStateOnly = false>
__global__ void __launch_bounds__(Cfg<kVariant>::kThreads, 1)
    kda_chunked_sm90_kernel(const __grid_constant__ KernelArgs args) {
#if defined(KDA_SM90_DEVICE)
  using Cf = Cfg<kVariant>;
  constexpr int kPrepWGs = Cf::kPrepWGs, kRawStages = Cf::kRawStages, kThreads = Cf::kThreads;
  constexpr bool kMultiPrep = kPrepWGs >= 2;  // variants 2, 3: prep warpgroups that load their own chunks
  using PipeR = PipeRaw<kVariant>;
  using PipeV = PipeVOf<kVariant>;
  using PipeOp = PipeOpOf<kVariant>;
  // this variant's ring depths (the namespace's layouts are those of the default depths)
  using LayoutVRing = LayoutVRingS<Cf::kVStages>;
  using LayoutKd = LayoutKdS<Cf::kOpStages>;
  using LayoutKQ = LayoutKQS<Cf::kOpStages>;
  using LayoutKr = LayoutKrS<Cf::kOpStages>;
  using LayoutT16 = LayoutT16S<Cf::kOpStages>;
  constexpr bool kFold = Cf::kFold;  // variant 4: the folded WY operands (prep consumes v)
  constexpr int kCS = Cf::kCluster;  // variant 5: CTAs per cluster, prep shared, value rows split
  constexpr bool kCluster = kCS > 1;
  static_assert(!(kFold && kBwd), "variant 4 serves the forward");
  static_assert(!(kCluster && (kStateOnly || kProfile)), "designs 5-8 have no state-only or profile instantiation");
  static_assert(!(kCluster && kFold) || kCS == 2, "variant 6: one peer (its V'ᵀ rows)");
  static_assert(!(kStateOnly && kBwd), "state-only is a forward mode");
  constexpr bool kQ = !kStateOnly;  // q and everything made from it (Q⁺, Mqk, the output)
  const RecurrentParams& p = args.p;
  extern __shared__ char smem_raw[];
  // The 1024-byte alignment of the swizzled tiles, as an offset from the __shared__ array, so the compiler keeps
  // the shared address space (LDS/STS with 32-bit addresses; an integer round trip of the pointer would make
  // every scratch access a generic 64-bit LD.E/ST.E).
  const uint32_t smem_a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
  char* smem_base = smem_raw + ((1024u - (smem_a & 1023u)) & 1023u);
  SharedStorage<kVariant>& ss = *reinterpret_cast<SharedStorage<kVariant>*>(smem_base);

  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
  // variant 5: the cluster (consecutive blocks) is the task, its CTA rank the half of the value rows
  const int rank = kCluster ? static_cast<int>(cute::block_rank_in_cluster()) : 0;
  const int64_t task = kCluster ? int64_t(blockIdx.x) / kCS : int64_t(blockIdx.x);
  const int hv = static_cast<int>(task % p.HV);
  int64_t n = task / p.HV;
  if (p.seq_order != nullptr) {  // scheduling hint: task -> sequence (longest first); CTA-uniform
    n = p.seq_order[n];
    if (n < 0 || n >= p.N) return;  // a broken permutation never reads out of bounds
  }
  const int h = hv / (p.HV / p.H);
  const SeqRange sr = seq_range(p, n);
  const StartState st = start_state(p, n);
  const int64_t n_chunks = (sr.len + kC - 1) / kC;
  auto chunk_len = [&](int64_t c) { return static_cast<int>(sr.len - c * kC < kC ? sr.len - c * kC : kC); };
  // the chunk the c-th step processes: c in the forward, last first in the backward chain (kBwd)
  auto phys = [&](int64_t c) { return kBwd ? n_chunks - 1 - c : c; };
  auto out_ptr = [&](int64_t t) {  // token t (index along T), value row 0 of head hv
    return static_cast<__nv_bfloat16*>(p.out) + sr.batch * p.out_batch_stride + t * p.out_token_stride +
           int64_t(hv) * p.out_head_stride;
  };

  if (st.kind < 0) {  // inactive slot: zero output (none in a state-only call), the pool untouched
    if (p.out != nullptr)
      for (int64_t e = tid + rank * kThreads; e < sr.len * kD; e += kThreads * kCS)
        out_ptr(sr.bos + e / kD)[e % kD] = __float2bfloat16_rn(0.f);
    return;
  }
  if (sr.len == 0 && p.final_state == nullptr) return;  // a zero-length sequence leaves its slot untouched

  // ---- roles: variant 1: WG0 producer, WG1 prep; variants 2, 3: WG w < kPrepWGs prep of the chunks c with
  // c mod kPrepWGs = w, their leader (below) issuing the TMA loads of those chunks. The last two WGs: chain.
  const bool is_prep = kMultiPrep ? wg < kPrepWGs : wg == 1;
  const int pw = kMultiPrep && is_prep ? wg : 0;  // which prep warpgroup (and raw ring); chain WGs: 0
  const bool is_chain = wg >= Cf::kChainWG0;
  // Who issues the raw q/k/g (and v) loads: variant 1 the producer's thread 0; variants 2, 3 lane 0 of each prep
  // warpgroup's leader warp (role 3), which is idle while roles 0 and 1 run L, Mqk and the inverse (the serial part
  // of prep). The role warps are warps 0-3, or, with kRotateRoles, shifted by the warpgroup index w (role r on warp
  // (r + w) mod 4), so the serial parts of the prep warpgroups issue from different SM sub-partitions.
  const int role_shift = kMultiPrep && (args.schedule & kRotateRoles) ? pw : 0;
  const bool diag_chain = kProfile && !kBwd && (args.schedule & kDiagChainOnly);
  const bool diag_prep = kProfile && !kBwd && (args.schedule & kDiagPrepOnly);
  // the chunks prep makes (diagnostic chain-only: those of the first operand stages)
  const int64_t prep_chunks = diag_chain && n_chunks > Cf::kOpStages ? Cf::kOpStages : n_chunks;
  const int leader_ptid = 32 * ((3 + role_shift) & 3);
  const bool raw_leader = kMultiPrep ? (is_prep && (tid & 127) == leader_ptid) : tid == 0;

  // ---- pipelines (barriers initialised by warp 0, visible to all after the __syncthreads below)
  typename PipeR::Params prp;
  prp.transaction_bytes = (kQ ? 3 : 2) * kC * kD * sizeof(bf16_t);
  if constexpr (kMultiPrep)
    prp.role = !is_prep ? PipeR::ThreadCategory::NonParticipant
                        : (raw_leader ? PipeR::ThreadCategory::ProducerConsumer : PipeR::ThreadCategory::Consumer);
  else
    prp.role = wg == 0 ? PipeR::ThreadCategory::Producer
                       : (wg == 1 ? PipeR::ThreadCategory::Consumer : PipeR::ThreadCategory::NonParticipant);
  prp.is_leader = raw_leader;
  prp.num_consumers = 128;
  // variants 2, 3: each prep warpgroup's ring, initialised by that warpgroup's first warp (4 w)
  prp.initializing_warp = 4 * pw;
  PipeR pipe_raw(ss.pipe_raw[pw], prp, Shape<_1, _1, _1>{});
  typename PipeV::Params pvp;
  pvp.transaction_bytes = kC * kD * sizeof(bf16_t);
  const bool v_leader = kCluster && !kFold && is_chain && (tid & 127) == 0;  // variant 5: the chain's thread 0 loads v
  if constexpr (kCluster && !kFold)
    pvp.role = v_leader ? PipeV::ThreadCategory::ProducerConsumer
                        : (is_chain ? PipeV::ThreadCategory::Consumer : PipeV::ThreadCategory::NonParticipant);
  else if constexpr (kFold)  // the v of a chunk is read by the prep warpgroup of that chunk
    pvp.role = raw_leader ? PipeV::ThreadCategory::ProducerConsumer
                          : (is_prep ? PipeV::ThreadCategory::Consumer : PipeV::ThreadCategory::NonParticipant);
  else
    pvp.role = raw_leader ? PipeV::ThreadCategory::Producer
                          : (is_chain ? PipeV::ThreadCategory::Consumer : PipeV::ThreadCategory::NonParticipant);
  pvp.is_leader = kCluster && !kFold ? v_leader : raw_leader;
  pvp.num_consumers = 128 * (kFold ? 1 : Cf::kChainWGs);
  PipeV pipe_v(ss.pipe_v, pvp, Shape<_1, _1, _1>{});
  typename PipeOp::Params pop;
  pop.role = is_prep ? PipeOp::ThreadCategory::Producer
                     : (is_chain ? PipeOp::ThreadCategory::Consumer : PipeOp::ThreadCategory::NonParticipant);
  pop.producer_arv_count = 128;                       // one prep warpgroup fills a stage
  pop.consumer_arv_count = kCluster ? 4 * kCS : 256;  // (variant 5: one arrival per chain warp of each CTA)
  PipeOp pipe_op(ss.pipe_op, pop);
  __syncthreads();
  // variant 5: every barrier of both CTAs initialised before any remote arrival or copy; each CTA stays until its
  // peer is done with it (cluster_sync at the end of every role)
  if constexpr (kCluster) cute::cluster_sync();

  // ---- TMA issue (variant 1: the producer's loop; variant 2: each prep warpgroup's leader, for its chunks)
  // This sequence's [16, 128] tiles of q, k (head h), g, v (head hv) and the ring slots of raw ring `w`.
  auto tiles = [&](const TmaToken& tma, int heads, int head) {
    Tensor m = tma.get_tma_tensor(make_shape(static_cast<int>(p.T), Int<kD>{}, heads, static_cast<int>(p.B)));
    Tensor ms = domain_offset(make_coord(static_cast<int>(sr.bos), _0{}), m(_, _, head, static_cast<int>(sr.batch)));
    return local_tile(ms, Shape<_16, _128>{}, make_coord(_, _0{}));  // (16, 128, chunk)
  };
  auto raw_part = [&](const TmaToken& tma, bf16_t* ring, int heads, int head) {
    Tensor s_ = make_tensor(make_smem_ptr(ring + pw * kRawStages * kC * kD), LayoutRawRing<kRawStages>{});
    return tma_partition(tma, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_),
                         group_modes<0, 2>(tiles(tma, heads, head)));
  };
  auto v_part = [&] {
    Tensor s_ = make_tensor(make_smem_ptr(ss.v), LayoutVRing{});
    return tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(s_),
                         group_modes<0, 2>(tiles(args.tma_v, p.HV, hv)));
  };
  auto prefetch_maps = [&] {
    cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_g.get_tma_descriptor());
    cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
  };
  if constexpr (kPrepWGs == 1) {
    if (wg == 0) {
      // ================================ producer (variant 1) ================================
      cutlass::arch::warpgroup_reg_dealloc<Cf::kProducerRegs>();
      if (tid == 0 && n_chunks > 0) {
        prefetch_maps();
        auto tq = raw_part(args.tma_q, ss.q, p.H, h);
        auto tk = raw_part(args.tma_k, ss.k, p.H, h);
        auto tg = raw_part(args.tma_g, ss.g, p.HV, hv);
        auto tv = v_part();
        auto st_raw = cutlass::make_producer_start_state<PipeR>();
        auto st_v = cutlass::make_producer_start_state<PipeV>();
        Prof<kProfile> prof;
        prof.start(true);
        for (int64_t c = 0; c < n_chunks; ++c) {
          pipe_raw.producer_acquire(st_raw);
          prof.mark(0);
          auto* bar = pipe_raw.producer_get_barrier(st_raw);
          const int s = st_raw.index();
          if constexpr (kQ) copy(args.tma_q.with(*bar), get<0>(tq)(_, phys(c)), get<1>(tq)(_, s));
          copy(args.tma_k.with(*bar), get<0>(tk)(_, phys(c)), get<1>(tk)(_, s));
          copy(args.tma_g.with(*bar), get<0>(tg)(_, phys(c)), get<1>(tg)(_, s));
          ++st_raw;
          prof.mark(1);
          pipe_v.producer_acquire(st_v);
          prof.mark(2);
          copy(args.tma_v.with(*pipe_v.producer_get_barrier(st_v)), get<0>(tv)(_, phys(c)),
               get<1>(tv)(_, st_v.index()));
          ++st_v;
          prof.mark(3);
        }
        prof.finish(0, n_chunks);
      }
      return;
    }
  }

  if (is_prep) {
    // ================================ prep ================================
    if constexpr (kMultiPrep) cutlass::arch::warpgroup_reg_dealloc<Cf::kPrepRegs>();
    auto& sc = ss.prep[pw];
    const int bar = kBarPrep + pw;
    const int ptid = tid & 127, d = ptid, pwarp = ptid >> 5;
    const int role = (pwarp - role_shift) & 3;  // 0: L and the inverse, 1: Mqk, 3: the TMA leader (lane 0)
    const bool in_gate = p.gate_mode != GateMode::kPrecomputed;
    const float A = in_gate ? __expf(p.A_log[hv]) : 0.f;
    const float dtb = (in_gate && p.dt_bias != nullptr) ? p.dt_bias[int64_t(hv) * kD + d] : 0.f;
    const float A2 = A * kLog2e, Adtb = A2 * dtb, lb2 = p.lower_bound * kLog2e;
    const auto* bsrc = static_cast<const __nv_bfloat16*>(p.beta.ptr) + sr.batch * p.beta.batch_stride +
                       int64_t(hv) * p.beta.head_stride;
    auto load_beta = [&](int64_t c) {  // (c: the step; its physical chunk's β)
      __nv_bfloat16 bv = __float2bfloat16_rn(0.f);
      if (ptid < kC && c < n_chunks) {
        const int64_t t = phys(c) * kC + ptid;
        if (t < sr.len) bv = bsrc[(sr.bos + t) * p.beta.token_stride];
      }
      return bv;
    };
    // Mqk[i][j] and INVb[i][j] into their 16x16 B tiles (offsets from the shared arrays, see swz_offset): the
    // forward's (n = i, k = j), fp16 saturated; the backward chain's transposes (n = j, k = i), bf16
    auto put16 = [&](f16_t* tile, int i, int j, int s, float x) {
      if constexpr (kBwd)
        reinterpret_cast<bf16_t*>(tile)[swz_offset(LayoutT16{}, j, i, s)] = bf16_t(x);
      else
        tile[swz_offset(LayoutT16{}, i, j, s)] = f16_t(sat_f16(x));
    };
    auto put_mqk = [&](int i, int j, int s, float x) { put16(ss.mqk, i, j, s, x); };
    auto put_inv = [&](int i, int j, int s, float x) { put16(ss.invb, i, j, s, x); };
    // variant 2: this warpgroup's leader loads its chunks c = pw, pw + 2, ... (raw ring kRawStages deep, v into
    // the shared ring at stage c mod kVStages); the partitions are rebuilt per issue (no registers held)
    // this warpgroup's chunks: c0, c0 + prep_step, ... (variant 5: chunk c on CTA c mod 2, warpgroup (c / 2) mod 2)
    const int c0 = kCluster ? kCS * pw + rank : pw, prep_step = kPrepWGs * kCS;
    auto st_raw_p = cutlass::make_producer_start_state<PipeR>();
    auto st_v_p = cutlass::make_producer_start_state<PipeV>();
    st_v_p.advance(pw);
    int64_t c_issue = c0;
    auto issue = [&] {
      pipe_raw.producer_acquire(st_raw_p);
      auto* rbar = pipe_raw.producer_get_barrier(st_raw_p);
      const int s = st_raw_p.index();
      if constexpr (kQ) {
        auto t = raw_part(args.tma_q, ss.q, p.H, h);
        copy(args.tma_q.with(*rbar), get<0>(t)(_, phys(c_issue)), get<1>(t)(_, s));
      }
      {
        auto t = raw_part(args.tma_k, ss.k, p.H, h);
        copy(args.tma_k.with(*rbar), get<0>(t)(_, phys(c_issue)), get<1>(t)(_, s));
      }
      {
        auto t = raw_part(args.tma_g, ss.g, p.HV, hv);
        copy(args.tma_g.with(*rbar), get<0>(t)(_, phys(c_issue)), get<1>(t)(_, s));
      }
      ++st_raw_p;
      if constexpr (!kCluster || kFold) {  // (variant 6: v rides with its chunk; stages by the CTA's own chunk count)
        pipe_v.producer_acquire(st_v_p);
        auto t = v_part();
        copy(args.tma_v.with(*pipe_v.producer_get_barrier(st_v_p)), get<0>(t)(_, phys(c_issue)),
             get<1>(t)(_, st_v_p.index()));
        st_v_p.advance(kPrepWGs);
      }
      c_issue += prep_step;
    };
    if constexpr (kMultiPrep) {
      if (raw_leader) {
        prefetch_maps();
        for (int i = 0; i < kRawStages && c_issue < prep_chunks; ++i) issue();
      }
    }
    typename PipeR::PipelineState st_raw;  // consumer: stage 0, phase 0
    typename PipeV::PipelineState st_vc;   // variant 4: v of this warpgroup's chunks (stage c mod kVStages)
    st_vc.advance(pw);
    auto st_op = cutlass::make_producer_start_state<PipeOp>();
    st_op.advance(c0);  // chunk c fills operand stage c mod kOpStages
    __nv_bfloat16 beta_next = load_beta(c0);
    Prof<kProfile> prof;
    prof.start(role == 0 && (ptid & 31) == 0);  // (the serial warp's lane 0)
    for (int64_t c = c0; c < prep_chunks; c += prep_step) {
      const int cl = chunk_len(phys(c));
      const __nv_bfloat16 beta_raw = beta_next;
      beta_next = load_beta(c + prep_step);
      prof.mark(7);
      pipe_op.producer_acquire(st_op);
      prof.mark(0);
      pipe_raw.consumer_wait(st_raw);
      prof.mark(1);
      named_sync(bar, 128);  // the previous chunk's scratch readers are done
      prof.mark(2);
      const int rs = pw * kRawStages + st_raw.index(), os = st_op.index();
      const bf16_t* rq_ = ss.q + rs * kC * kD;
      const bf16_t* rk_ = ss.k + rs * kC * kD;
      const bf16_t* rg_ = ss.g + rs * kC * kD;
      const auto* rqb = reinterpret_cast<const __nv_bfloat16*>(rq_);
      const auto* rkb = reinterpret_cast<const __nv_bfloat16*>(rk_);

      // ---- gate prefix of channel d, L2 norms, β
      float a0 = 0.f, gc = 0.f;
      gate_prefix_of(p.gate_mode, rg_, sc.gp, d, cl, A2, Adtb, dtb, lb2, a0, gc);
      sc.e0[d] = exp2f(a0);
      sc.ecp[d] = exp2f(gc);
      sc.a0[d] = a0;
      sc.gc[d] = gc;
      ss.gamma[os][d] = exp2f(a0 + gc);  // e^{Γ_C}, for the chain's S ⊙ γ_C
      const int wide = !(-gc <= kSpanLimit);
      {
        const int row = ptid >> 2, part4 = ptid & 3;  // 32 rows (q then k), 4 threads x 32 elements
        const __nv_bfloat16* src = row < kC ? rqb + row * kD : rkb + (row - kC) * kD;
        // (state-only: the q rows' threads, warps 0 and 1 whole, skip; the k rows' sums are those of the full call)
        const float sq = kQ || row >= kC ? row_sumsq_quad(src, part4, row & 1) : 0.f;
        if (part4 == 0 && (kQ || row >= kC)) {
          const float r = p.use_qk_l2norm ? rsqrtf(sq + kL2NormEps) : 1.f;
          if (row < kC)
            sc.rq[row] = r * p.scale;
          else
            sc.rk[row - kC] = r;
        }
      }
      if (ptid < kC) {
        const float x = bfv(beta_raw);
        sc.beta[ptid] = ptid < cl ? beta_value(x, p.beta_is_logit) : 0.f;
      }
      prof.mark(3);
      const bool pairwise = named_sync_or(bar, 128, wide);
      prof.mark(2);

      // ---- decayed operand tiles: 2 items of (row i, 8 channels) per thread
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int idx = ptid + 128 * u, i = idx >> 4, pc = idx & 15, d0 = pc * 8;
        float gi[8];
        load8f(sc.gp + i * kD + d0, gi);
        const uint4 kw = *reinterpret_cast<const uint4*>(rkb + i * kD + d0);
        const uint4 qw = kQ ? *reinterpret_cast<const uint4*>(rqb + i * kD + d0) : make_uint4(0, 0, 0, 0);
        const uint32_t kws[4] = {kw.x, kw.y, kw.z, kw.w}, qws[4] = {qw.x, qw.y, qw.z, qw.w};
        float kk[8], qq[8];
        const bool live = i < cl;  // rows past the end: zero operands (no effect on the state or outputs)
        const float rk = live ? sc.rk[i] : 0.f, rq = kQ && live ? sc.rq[i] : 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          kk[2 * e] = bf16_lo(kws[e]) * rk, kk[2 * e + 1] = bf16_hi(kws[e]) * rk;
          qq[2 * e] = kQ ? bf16_lo(qws[e]) * rq : 0.f, qq[2 * e + 1] = kQ ? bf16_hi(qws[e]) * rq : 0.f;
        }
        if (!live) {  // (0 * inf or NaN garbage of another sequence's row stays out)
#pragma unroll
          for (int e = 0; e < 8; ++e) kk[e] = 0.f, qq[e] = 0.f;
        }
        float kp[8], qp[8], kr[8];
        if (!pairwise) {
          float e0v[8], ecv[8], km[8], qm[8], kn[8];
          load8f(sc.e0 + d0, e0v);
          load8f(sc.ecp + d0, ecv);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float ex = exp2f(gi[e]), ei = __fdividef(1.f, ex);
            km[e] = kk[e] * ex, qm[e] = qq[e] * ex, kn[e] = kk[e] * ei;
            kp[e] = km[e] * e0v[e], qp[e] = qm[e] * e0v[e], kr[e] = kn[e] * ecv[e];
          }
          const int o = swz(i, pc);
          *reinterpret_cast<uint4*>(sc.km + o) = pack8_bf16(km);
          if constexpr (kQ) *reinterpret_cast<uint4*>(sc.qm + o) = pack8_bf16(qm);
          *reinterpret_cast<uint4*>(sc.kn + o) = pack8_bf16(kn);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float e1 = exp2f(sc.a0[d0 + e] + gi[e]);
            kp[e] = kk[e] * e1, qp[e] = qq[e] * e1;
            kr[e] = kk[e] * exp2f(sc.gc[d0 + e] - gi[e]);
          }
        }
        // 8 consecutive channels are 16 contiguous, 16-byte aligned bytes in both swizzled layouts (K-major SW128:
        // a row's 64-element atom row, permuted in 8-element pieces; MN-major SW128 likewise along the channels);
        // tests/layout/sm90_layout_check.cu checks this on the host.
        if constexpr (kBwd) {
          // the backward chain's B operands, all bf16: Kr as (token, channel) K-major for dRᵀ = dS Krᵀ (in the
          // kd tile), Q⁺ and K⁺ as (channel, token) MN-major for dS += dOᵀ Q⁺ + dXᵀ K⁺ (in the qd and kr tiles)
          *reinterpret_cast<uint4*>(ss.kd() + swz_offset(LayoutKd{}, i, d0, os)) = pack8_bf16(kr);
          *reinterpret_cast<uint4*>(ss.qd() + swz_offset(LayoutKr{}, d0, i, os)) = pack8_bf16(qp);
          *reinterpret_cast<uint4*>(ss.kr + swz_offset(LayoutKr{}, d0, i, os)) = pack8_bf16(kp);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) kr[e] = sat_f16(kr[e]);
          if constexpr (kFold) {  // fp16 K⁺, the fold product's operand (fold_wy overwrites it with −W')
#pragma unroll
            for (int e = 0; e < 8; ++e) kp[e] = sat_f16(kp[e]);
            *reinterpret_cast<uint4*>(ss.kq + swz_offset(LayoutKQ{}, i, d0, os)) = pack8_f16(kp);
          } else {
            *reinterpret_cast<uint4*>(ss.kq + swz_offset(LayoutKQ{}, i, d0, os)) = pack8_bf16(kp);
          }
          if constexpr (kQ) *reinterpret_cast<uint4*>(ss.kq + swz_offset(LayoutKQ{}, kC + i, d0, os)) = pack8_bf16(qp);
          *reinterpret_cast<uint4*>(ss.kr + swz_offset(LayoutKr{}, d0, i, os)) = pack8_f16(kr);
        }
      }
      if (pairwise) {
        // exact Σ_d k̂_i k̂_j e^{Γ_i - Γ_j} on CUDA cores; masked pairs never exponentiated
        for (int e = ptid; e < kC * kC; e += 128) {
          const int i = e / kC, jj = e % kC;
          float l = 0.f, mq = 0.f;
          if (jj <= i && i < cl) {
            for (int dd = 0; dd < kD; ++dd) {
              const float w = exp2f(sc.gp[i * kD + dd] - sc.gp[jj * kD + dd]) * bfv(rkb[jj * kD + dd]);
              l = fmaf(bfv(rkb[i * kD + dd]), w, l);
              if constexpr (kQ) mq = fmaf(bfv(rqb[i * kD + dd]), w, mq);
            }
            l *= sc.rk[i] * sc.rk[jj];
            if constexpr (kQ) mq *= sc.rq[i] * sc.rk[jj];
          }
          sc.ap[e] = jj < i ? sc.beta[i] * l : 0.f;
          if constexpr (kQ) put_mqk(i, jj, os, mq);
        }
      }
      pipe_raw.consumer_release(st_raw);  // done with the raw tiles
      ++st_raw;
      prof.mark(4);
      named_sync(bar, 128);  // Km/Qm/Kn (or A', Mqk) complete
      prof.mark(2);
      if constexpr (kMultiPrep) {
        // every thread of this warpgroup released the raw stage: its leader refills it with its next chunk
        if (raw_leader && c_issue < prep_chunks) issue();
        prof.mark(2);
      }

      if ((role == 0 || (kQ && role == 1)) && !pairwise) {
        // role 0: L = Km Knᵀ -> A' = diag(β) strict_tril(L); role 1 at the same time: Mqk = tril(Qm Knᵀ).
        // (mma.sync m16n8k16, even / odd k-steps into separate accumulators)
        const __nv_bfloat16* asrc = role == 0 ? sc.km : sc.qm;
        const int gq = lane >> 2, cq = lane & 3;
        const TileOffsets toff_a(((lane >> 3) & 1) * 8 + (lane & 7), (lane >> 4) & 1);
        const TileOffsets toff_b(((lane >> 4) & 1) * 8 + (lane & 7), (lane >> 3) & 1);
        float al[2][4] = {}, al2[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
          uint32_t fa[4], fn[4];
          ldsm_x4(asrc + toff_a.at(ks), fa);
          ldsm_x4(sc.kn + toff_b.at(ks), fn);
          float(&x)[2][4] = (ks & 1) ? al2 : al;
          ptx::mma_bf16(x[0], fa, fn[0], fn[1]);
          ptx::mma_bf16(x[1], fa, fn[2], fn[3]);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int i = gq + 8 * (e >> 1), jj = 8 * nt + 2 * cq + (e & 1);
            const float x = al[nt][e] + al2[nt][e];
            if (role == 0)
              sc.ap[i * kC + jj] = jj < i ? sc.beta[i] * x : 0.f;
            else
              put_mqk(i, jj, os, jj <= i ? x : 0.f);
          }
        __syncwarp();
      }
      prof.mark(5);
      if (role == 0) {
        // INVb = (I + A')^{-1} diag(β), blockwise in fp32 (chunk_math.cuh)
        auto put = [&](int r, int c, float x) {
          if constexpr (kFold)
            sc.inv[r * kC + c] = x;  // fp32, for fold_wy
          else
            put_inv(r, c, os, x);
        };
        if (args.schedule & kSplitInverseRows)
          unit_lower_inverse16<true, true>(sc.ap, sc.i2s, sc.beta, lane, put);
        else if (args.schedule & kVectorInverse)
          unit_lower_inverse16<true>(sc.ap, sc.i2s, sc.beta, lane, put);
        else
          unit_lower_inverse16<false>(sc.ap, sc.i2s, sc.beta, lane, put);
      }
      if constexpr (kFold) {
        // −W' and V'ᵀ on all four warps (fold_wy), once INVb is complete and the chunk's v has landed
        pipe_v.consumer_wait(st_vc);
        named_sync(bar, 128);
        fold_wy<LayoutKQ>(sc.inv, ss.kq, os, reinterpret_cast<const __nv_bfloat16*>(ss.v) + st_vc.index() * kC * kD, cl,
                          ss.vp + os * kD * kC, pwarp, lane);
        pipe_v.consumer_release(st_vc);
        st_vc.advance(kPrepWGs);
      }
      // generic-proxy writes of the operand tiles -> visible to wgmma (async proxy), then publish
      prof.mark(6);
      cutlass::arch::fence_view_async_shared();
      pipe_op.producer_commit(st_op);
      if constexpr (kCluster) {
        // the stage into the peer's: once every thread of the warpgroup wrote and fenced its part (the bulk copy
        // reads it through the async proxy); the peer's chain released it (this CTA's empty barrier, acquired above)
        named_sync(bar, 128);
        if (ptid == 0) send_operand_stage<kVariant, kBwd>(pipe_op, st_op, ss, os, rank);
      }
      st_op.advance(prep_step);
    }
    // (profile rows: variant 1 row 1; variants 2, 3 rows 0 and 1 for prep warpgroups 0 and 1)
    if (pw < 2) prof.finish(kMultiPrep ? pw : 1, (n_chunks - pw + kPrepWGs - 1) / kPrepWGs);
    if constexpr (kCluster) cute::cluster_sync();
    return;
  }

  // ================================ chain (WG2: value rows 0-63, WG3: 64-127) ================================
  cutlass::arch::warpgroup_reg_alloc<Cf::kChainRegs>();
  // which 64 value rows: the chain warpgroup's index, or (variant 5) the CTA's rank in its cluster
  const int cw = kCluster ? rank : wg - Cf::kChainWG0, ctid = tid - 128 * wg, v0 = 64 * cw;
  using MmaX = SM90::GMMA::MMA_64x16x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
  using MmaXO = SM90::GMMA::MMA_64x32x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
  using MmaU = SM90::GMMA::MMA_64x16x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>;
  using MmaS = SM90::GMMA::MMA_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>;
  auto mma_x = make_tiled_mma(MmaX{});
  auto mma_xo = make_tiled_mma(MmaXO{});
  auto mma_u = make_tiled_mma(MmaU{});
  auto mma_s = make_tiled_mma(MmaS{});
  auto thr_x = mma_x.get_slice(ctid);
  auto thr_xo = mma_xo.get_slice(ctid);
  auto thr_u = mma_u.get_slice(ctid);
  auto thr_s = mma_s.get_slice(ctid);

  Tensor sKd = make_tensor(make_smem_ptr(ss.kd()), LayoutKd{});  // the backward chain's Kr
  Tensor sKQ = make_tensor(make_smem_ptr(ss.kq), LayoutKQ{});    // the forward's [K⁺; Q⁺]
  Tensor sKr = make_tensor(make_smem_ptr(ss.kr), LayoutKr{});
  Tensor sInv = make_tensor(make_smem_ptr(ss.invb), LayoutT16{});
  Tensor sMqk = make_tensor(make_smem_ptr(ss.mqk), LayoutT16{});
  Tensor bKd = thr_x.partition_fragment_B(sKd);    // (MMA, 1, 8, stages) descriptors
  Tensor bKQ = thr_xo.partition_fragment_B(sKQ);   // (MMA, 1, 8, stages)
  Tensor bInv = thr_u.partition_fragment_B(sInv);  // (MMA, 1, 1, stages)
  Tensor bMqk = thr_u.partition_fragment_B(sMqk);
  Tensor bKr = thr_s.partition_fragment_B(sKr);  // (MMA, 1, 1, stages)

  Tensor accS = partition_fragment_C(mma_s, Shape<_64, _128>{});  // ((2, 2, 16), 1, 1) fp32: the state rows
  Tensor accX0 = partition_fragment_C(mma_x, Shape<_64, _16>{});  // ((2, 2, 2), 1, 1): the layout of one half
  // [Xᵀ | O_interᵀ] ((2, 2, 4), 1, 1): value i + 4 j holds column 8 j + ..., so elements 0-7 are Xᵀ and 8-15 are
  // O_interᵀ, each in accX's order (CuTe's 64xN accumulator layout: the N/8 column blocks are the last mode);
  // accX and accO are views of the two halves (the output product accumulates into accO in place)
  Tensor accXO = partition_fragment_C(mma_xo, Shape<_64, _32>{});
  Tensor accX = make_tensor(accXO.data(), accX0.layout());
  Tensor accO = make_tensor(accXO.data() + size(accX), accX0.layout());
  Tensor accU = partition_fragment_C(mma_u, Shape<_64, _16>{});
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<_64, _128>{}));        // (value row, channel) per element
  Tensor cX = thr_x.partition_C(make_identity_tensor(Shape<_64, _16>{}));         // (value row, token)
  Tensor aS = make_tensor<bf16_t>(partition_shape_A(mma_x, Shape<_64, _128>{}));  // ((2, 2, 2), 1, 8)
  Tensor aY = make_tensor<f16_t>(partition_shape_A(mma_u, Shape<_64, _16>{}));    // ((2, 2, 2), 1, 1)
  Tensor aU = make_tensor<f16_t>(partition_shape_A(mma_s, Shape<_64, _16>{}));    // ((2, 2, 2), 1, 1)
  // For 16-bit A operands the accumulator of columns [16 j, 16 j + 16) and the A fragment of k-block j share
  // the thread and value order, so the conversion is element i -> element i.
  static_assert(decltype(size(accS))::value == 64 && decltype(size(aS))::value == 64, "S fragment sizes");
  static_assert(decltype(size(accX))::value == 8 && decltype(size(aY))::value == 8 && decltype(size(aU))::value == 8,
                "16-token fragment sizes");
  static_assert(decltype(size(accXO))::value == 16, "the stacked product's fragment");
  static_assert(decltype(size<2>(aS))::value == 8 && decltype(size<0>(aS))::value == 8, "A = S k-blocks");

  // start state (pool slot or read-only source slot, bf16 or fp32; zeros without either or for a zero-length
  // row of the pool)
  const int64_t head_off = int64_t(hv) * kD * kD;
  const int64_t inner = int64_t(p.HV) * kD * kD;
  using LayoutRows = Layout<Shape<_64, Int<kD>>, Stride<Int<kD>, _1>>;  // this WG's 64 state rows
  {
    const void* base = nullptr;
    DType dt = DType::kFloat32;
    int64_t off = 0;
    if (st.kind == 1 && sr.len > 0) base = p.state, dt = p.state_dtype, off = st.slot * p.state_slot_stride;
    if (st.kind == 2) base = p.state_source, dt = p.state_source_dtype, off = st.slot * p.source_slot_stride;
    const int64_t o = off + head_off + int64_t(v0) * kD;
    if (base == nullptr) {
      clear(accS);
    } else if (dt == DType::kBFloat16) {
      Tensor t =
          thr_s.partition_C(make_tensor(make_gmem_ptr(static_cast<const __nv_bfloat16*>(base) + o), LayoutRows{}));
#pragma unroll
      for (int i = 0; i < size(accS); ++i) accS(i) = __bfloat162float(t(i));
    } else {
      Tensor t = thr_s.partition_C(make_tensor(make_gmem_ptr(static_cast<const float*>(base) + o), LayoutRows{}));
#pragma unroll
      for (int i = 0; i < size(accS); ++i) accS(i) = t(i);
    }
  }

  // The state rows of this WG to a [V, K] state at element offset `off` (+ this head), fp32 or bf16: CuTe's
  // accumulator partition of the row block, so every element is the thread's base address + a constant.
  auto store_state = [&](void* base, DType dt, int64_t off) {
    const int64_t o = off + head_off + int64_t(v0) * kD;
    // elements 2j, 2j + 1 of the accumulator are two adjacent channels of one row (an even channel): pairs
    static_assert(decltype(stride<0, 0>(
                      thr_s.partition_C(make_tensor(make_gmem_ptr((float*)nullptr), LayoutRows{}))))::value == 1,
                  "accumulator pairs are adjacent channels");
    if (dt == DType::kBFloat16) {
      Tensor t = thr_s.partition_C(make_tensor(make_gmem_ptr(static_cast<__nv_bfloat16*>(base) + o), LayoutRows{}));
#pragma unroll
      for (int i = 0; i < size(accS); i += 2)
        *reinterpret_cast<__nv_bfloat162*>(&t(i)) = __floats2bfloat162_rn(accS(i), accS(i + 1));
    } else {
      Tensor t = thr_s.partition_C(make_tensor(make_gmem_ptr(static_cast<float*>(base) + o), LayoutRows{}));
#pragma unroll
      for (int i = 0; i < size(accS); i += 2) *reinterpret_cast<float2*>(&t(i)) = make_float2(accS(i), accS(i + 1));
    }
  };
  const bool out_vec16 = out_rows_vec16(p);  // 16-byte output stores (recurrent_rules.h)
  // checkpoints: row checkpoint_cu_starts[n] + j - checkpoint_first holds the state before token j * every
  // (every a multiple of 16, chunked_supported; the training forward's tapes: every = 64, first = 1), i.e.
  // before chunk j * every / 16: the next such chunk and its row offset are counted (no division in the loop)
  const int ck_step = p.checkpoint_every_n_tokens / kC;
  int64_t ck_next = ck_step > 0 ? int64_t(p.checkpoint_first) * ck_step : n_chunks;
  int64_t ck_j = 0;

  typename PipeV::PipelineState st_v;
  typename PipeOp::PipelineState st_op;
  // variant 5: the chain's thread 0 loads the v tiles, kVStages chunks ahead (the refill of chunk c - 1's stage at the
  // top of chunk c, when the warpgroup has released it)
  auto st_vp = cutlass::make_producer_start_state<PipeV>();
  auto issue_v = [&](int64_t c) {
    pipe_v.producer_acquire(st_vp);
    auto t = v_part();
    copy(args.tma_v.with(*pipe_v.producer_get_barrier(st_vp)), get<0>(t)(_, phys(c)), get<1>(t)(_, st_vp.index()));
    ++st_vp;
  };
  if (kCluster && v_leader) {
    prefetch_maps();
    for (int64_t c = 0; c < n_chunks && c < Cf::kVStages; ++c) issue_v(c);
  }
  auto refill_v = [&](int64_t c) {  // at the top of chunk c: chunk c - 1's stage, released, for chunk c - 1 + kVStages
    if (kCluster && v_leader && c > 0 && c - 1 + Cf::kVStages < n_chunks) issue_v(c - 1 + Cf::kVStages);
  };
  Prof<kProfile> prof;
  prof.start(ctid == 0);
  if constexpr (kBwd) {
    // ---- the backward chain: dS carried from the last chunk to the first (p.v holds dO, the start state is
    // dfinal_state, final_state receives dinitial_state, the checkpoints dS at the end of every chunk), per chunk
    //   dRᵀ = dS Krᵀ + dOᵀ Mqk,  dXᵀ = -dRᵀ INVb,  dS = dS ⊙ γ_C + dOᵀ Q⁺ + dXᵀ K⁺
    // with bf16 operands and the fp32 dS as the accumulator (the mma.sync kernel's BWD mode, the same math).
    // Prep wrote Kr into the kd tile, Q⁺ and K⁺ (channel-major) into the qd and kr tiles, Mqk and INVb
    // transposed, all bf16.
    using MmaSb = SM90::GMMA::MMA_64x128x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::MN>;
    auto mma_sb = make_tiled_mma(MmaSb{});
    auto thr_sb = mma_sb.get_slice(ctid);
    Tensor bMqkT =
        thr_x.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<bf16_t*>(ss.mqk)), LayoutT16{}));
    Tensor bInvT =
        thr_x.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<bf16_t*>(ss.invb)), LayoutT16{}));
    Tensor bQp = thr_sb.partition_fragment_B(make_tensor(make_smem_ptr(ss.qd()), LayoutKr{}));
    Tensor bKp = thr_sb.partition_fragment_B(make_tensor(make_smem_ptr(reinterpret_cast<bf16_t*>(ss.kr)), LayoutKr{}));
    Tensor accR = partition_fragment_C(mma_x, Shape<_64, _16>{});
    Tensor accD = partition_fragment_C(mma_x, Shape<_64, _16>{});
    Tensor aO = make_tensor<bf16_t>(partition_shape_A(mma_x, Shape<_64, _16>{}));    // dOᵀ
    Tensor aR = make_tensor<bf16_t>(partition_shape_A(mma_x, Shape<_64, _16>{}));    // -dRᵀ
    Tensor aOs = make_tensor<bf16_t>(partition_shape_A(mma_sb, Shape<_64, _16>{}));  // dOᵀ, for the dS product
    Tensor aD = make_tensor<bf16_t>(partition_shape_A(mma_sb, Shape<_64, _16>{}));   // dXᵀ
    static_assert(decltype(size(aO))::value == 8 && decltype(size(aOs))::value == 8 && decltype(size(aD))::value == 8,
                  "16-token fragment sizes");
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int64_t pc = phys(c);
      const int cl = chunk_len(pc);
      refill_v(c);
      // dS at the end of every `every`-token chunk j (ck_step 16-token chunks; the sequence's last 16-token chunk
      // ends the last one): row checkpoint_cu_starts[n] + j, written on entering that chunk's last 16-token chunk
      if (ck_step > 0 && ((pc + 1) % ck_step == 0 || pc == n_chunks - 1)) {
        const int64_t row = p.checkpoint_cu_starts[n] + pc / ck_step;
        if (row >= 0 && row < p.n_checkpoint_rows) store_state(p.state_checkpoints, p.checkpoint_dtype, row * inner);
      }
      prof.mark(7);
      pipe_op.consumer_wait(st_op);
      prof.mark(0);
      const int os = st_op.index();
      const float* gam = ss.gamma[os];
      pipe_v.consumer_wait(st_v);
      prof.mark(1);
      {  // dOᵀ of this chunk (tokens past the end: 0), then the stage back to its producer
        const bf16_t* vt = reinterpret_cast<const bf16_t*>(ss.v) + st_v.index() * kC * kD;
#pragma unroll
        for (int i = 0; i < size(aO); ++i) {
          const int m = get<0>(cX(i)), t = get<1>(cX(i));
          aO(i) = t < cl ? vt[t * kD + v0 + m] : bf16_t(0.f);
        }
        pipe_v.consumer_release(st_v);
        ++st_v;
      }
      // ---- dRᵀ = dS Krᵀ + dOᵀ Mqk
#pragma unroll
      for (int i = 0; i < size(aS); ++i) aS(i) = bf16_t(accS(i));
      clear(accR);
      warpgroup_fence_operand(aS);
      warpgroup_fence_operand(aO);
      warpgroup_fence_operand(accR);
      warpgroup_arrive();
      gemm(mma_x, aS, bKd(_, _, _, os), accR);
      gemm(mma_x, aO, bMqkT(_, _, _, os), accR);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accR);
      prof.mark(2);
      // ---- dXᵀ = -dRᵀ INVb, with dS ⊙ γ_C while it runs
#pragma unroll
      for (int i = 0; i < size(aR); ++i) aR(i) = bf16_t(-accR(i));
      clear(accD);
      warpgroup_fence_operand(aR);
      warpgroup_fence_operand(accD);
      warpgroup_arrive();
      gemm(mma_x, aR, bInvT(_, _, _, os), accD);
      warpgroup_commit_batch();
      warpgroup_fence_operand(accS);
#pragma unroll
      for (int i = 0; i < size(accS); ++i) accS(i) *= gam[get<1>(cS(i))];
      warpgroup_fence_operand(accS);
      warpgroup_wait<0>();
      warpgroup_fence_operand(accD);
      prof.mark(4);
      // ---- dS += dOᵀ Q⁺ + dXᵀ K⁺
#pragma unroll
      for (int i = 0; i < size(aD); ++i) aD(i) = bf16_t(accD(i)), aOs(i) = aO(i);
      warpgroup_fence_operand(aD);
      warpgroup_fence_operand(aOs);
      warpgroup_fence_operand(accS);
      warpgroup_arrive();
      gemm(mma_sb, aOs, bQp(_, _, _, os), accS);
      gemm(mma_sb, aD, bKp(_, _, _, os), accS);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accS);
      pipe_op.consumer_release(st_op);
      ++st_op;
      prof.mark(5);
    }
  } else {
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int cl = chunk_len(c);
      refill_v(c);
      if (c == ck_next) {
        const int64_t row = p.checkpoint_cu_starts[n] + ck_j;
        if (row >= 0 && row < p.n_checkpoint_rows) store_state(p.state_checkpoints, p.checkpoint_dtype, row * inner);
        ck_next += ck_step;
        ++ck_j;
      }
      prof.mark(7);
      const bool fresh = !diag_chain || c < Cf::kOpStages;  // (diagnostic chain-only: stages reused, no waits)
      if (fresh) pipe_op.consumer_wait(st_op);
      prof.mark(0);
      const int os = fresh ? st_op.index() : static_cast<int>(c % Cf::kOpStages);
      if (diag_prep) {  // (diagnostic prep-only: the stage back at once)
        if constexpr (!kFold) {
          pipe_v.consumer_wait(st_v);
          pipe_v.consumer_release(st_v);
          ++st_v;
        }
        pipe_op.consumer_release(st_op);
        ++st_op;
        continue;
      }

      if constexpr (kFold) {
        // ---- [Uᵀ | O_interᵀ] = [V'ᵀ | 0] + bf16(S) [−W'; Q⁺]ᵀ: one N = 32 batch onto the seeded accumulator
        // (tokens past the end: V' and W' rows are 0, so U is 0 there), then S ⊙ γ_C (in the batch's shadow ptxas
        // injects a wait for it anyway, C7517)
#pragma unroll
        for (int i = 0; i < size(aS); ++i) aS(i) = bf16_t(accS(i));
        {
          const f16_t* vps = ss.vp + os * kD * kC;
#pragma unroll
          for (int i = 0; i < size(accX); i += 2) {  // (elements i, i + 1: adjacent tokens of one value row)
            const float2 f =
                __half22float2(*reinterpret_cast<const __half2*>(vps + vp_offset(v0 + get<0>(cX(i)), get<1>(cX(i)))));
            accX(i) = f.x, accX(i + 1) = f.y;
          }
#pragma unroll
          for (int i = 0; i < size(accO); ++i) accO(i) = 0.f;
        }
        const float* gam = ss.gamma[os];
        warpgroup_fence_operand(aS);
        warpgroup_fence_operand(accXO);
        warpgroup_arrive();
        gemm(mma_xo, aS, bKQ(_, _, _, os), accXO);
        warpgroup_commit_batch();
        prof.mark(2);
        warpgroup_wait<0>();
        warpgroup_fence_operand(accXO);
        warpgroup_fence_operand(accS);
#pragma unroll
        for (int i = 0; i < size(accS); ++i) accS(i) *= gam[get<1>(cS(i))];
        warpgroup_fence_operand(accS);
#pragma unroll
        for (int i = 0; i < size(accU); ++i) aU(i) = f16_t(sat_f16(accX(i)));
        prof.mark(4);
      } else {
        // ---- Xᵀ = S K⁺ᵀ, O_interᵀ = S Q⁺ᵀ
#pragma unroll
        for (int i = 0; i < size(aS); ++i) aS(i) = bf16_t(accS(i));
        clear(accXO);
        warpgroup_fence_operand(aS);
        warpgroup_fence_operand(accXO);
        const float* gam = ss.gamma[os];
        float vv[size(accX)];
        // this chunk's v values (tokens past the end: 0) into registers, then the stage back to the producer
        auto take_v = [&] {
          const int vs = fresh ? st_v.index() : static_cast<int>(c % Cf::kOpStages);
          const __nv_bfloat16* vt = reinterpret_cast<const __nv_bfloat16*>(ss.v) + vs * kC * kD;
#pragma unroll
          for (int i = 0; i < size(accX); ++i) {
            const int m = get<0>(cX(i)), t = get<1>(cX(i));
            vv[i] = t < cl ? bfv(vt[t * kD + v0 + m]) : 0.f;
          }
          if (fresh) {
            pipe_v.consumer_release(st_v);
            ++st_v;
          }
        };
        // one N = 32 product over the stacked tile: X and O_inter in one batch (two N = 16 batches measured slower)
        warpgroup_arrive();
        gemm(mma_xo, aS, bKQ(_, _, _, os), accXO);
        warpgroup_commit_batch();
        prof.mark(2);
        if (fresh) pipe_v.consumer_wait(st_v);  // (the v tile, long loaded by now)
        prof.mark(1);
        warpgroup_wait<0>();
        warpgroup_fence_operand(accXO);
        prof.mark(2);
        take_v();  // after X: its registers are not live while X and O_inter run (the peak of the chain)
        prof.mark(3);

        // ---- Yᵀ = Vᵀ - Xᵀ (tokens past the end: 0)
#pragma unroll
        for (int i = 0; i < size(accX); ++i) {
          const int t = get<1>(cX(i));
          aY(i) = f16_t(sat_f16(t < cl ? vv[i] - accX(i) : 0.f));
        }
        prof.mark(3);

        // ---- Uᵀ = Yᵀ INVbᵀ
        clear(accU);
        warpgroup_fence_operand(aY);
        warpgroup_fence_operand(accU);
        warpgroup_arrive();
        gemm(mma_u, aY, bInv(_, _, _, os), accU);
        warpgroup_commit_batch();
        // while U runs: S ⊙ γ_C (accS is no operand of the products in flight; scaling it while X and O_inter
        // ran made ptxas insert a wait for them, C7517)
        warpgroup_fence_operand(accS);
#pragma unroll
        for (int i = 0; i < size(accS); ++i) accS(i) *= gam[get<1>(cS(i))];
        warpgroup_fence_operand(accS);
        warpgroup_wait<0>();  // (also O_inter, long done by now)
        warpgroup_fence_operand(accU);
        warpgroup_fence_operand(accO);
#pragma unroll
        for (int i = 0; i < size(accU); ++i) aU(i) = f16_t(sat_f16(accU(i)));
        prof.mark(4);
      }

      // ---- S = S ⊙ γ_C + Uᵀ Kr;  Oᵀ = O_interᵀ + Uᵀ Mqkᵀ
      // (variants 4, 6, 8: Uᵀ Mqkᵀ into an accumulator of its own, added to O_interᵀ after the batch: accumulating
      // into accO, a view of the upper half of the N = 32 accumulator, is what makes ptxas serialise the function's
      // wgmmas, C7511; the other variants keep design 3's bits)
      constexpr bool kSepOi = Cf::kSepOi;
      Tensor accOi = partition_fragment_C(mma_u, Shape<_64, _16>{});
      auto& accOd = [&]() -> auto& {
        if constexpr (kSepOi)
          return accOi;
        else
          return accO;
      }();
      if constexpr (kSepOi) clear(accOi);
      warpgroup_fence_operand(aU);
      warpgroup_fence_operand(accS);
      warpgroup_fence_operand(accOd);
      warpgroup_arrive();
      gemm(mma_s, aU, bKr(_, _, _, os), accS);
      if constexpr (kQ) gemm(mma_u, aU, bMqk(_, _, _, os), accOd);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accS);
      warpgroup_fence_operand(accOd);
      if constexpr (kSepOi) {
#pragma unroll
        for (int i = 0; i < size(accO); ++i) accO(i) += accOi(i);
      }
      if (fresh) {
        pipe_op.consumer_release(st_op);
        ++st_op;
      }
      prof.mark(5);

      // ---- output rows of this chunk (none in a state-only call, p.out null). Oᵀ is transposed to O[t][v] through
      // shared memory; element stores when the output view is not 16-byte aligned.
      //   kWarpOutput: each warp stages the 16 value rows it holds (wgmma's accumulator: warp w of the warpgroup
      //   owns rows 16 w .. 16 w + 15) as [16 tokens][16 rows] in its own buffer and stores them with one 16-byte
      //   store per lane (token lane / 2, rows 8 (lane % 2) .. + 8): only __syncwarp, no barrier of the warpgroup.
      //   Otherwise: the warpgroup's 64 rows in its buffer of the chunk's parity, one named barrier, one 16-byte
      //   store per thread (token ctid / 8, rows 8 (ctid % 8) .. + 8); the buffer is rewritten two chunks later,
      //   after every thread passed the next chunk's barrier.
      if (kQ && p.out != nullptr) {
        const bool warp_out = args.schedule & kWarpOutput;
        int t, row0;
        const __nv_bfloat16* src;
        if (warp_out) {
          __nv_bfloat16* wst = &ss.ostage[0][0][0] + cw * 4 * kWStage;  // this warpgroup's four warp buffers
          // (value row m, token t) -> buffer m / 16, [t][m % 16]
          Tensor st_ = thr_x.partition_C(
              make_tensor(make_smem_ptr(wst),
                          Layout<Shape<Shape<_16, _4>, _16>, Stride<Stride<_1, Int<kWStage>>, Int<kWStride>>>{}));
#pragma unroll
          for (int i = 0; i < size(accO); ++i) st_(i) = __float2bfloat16_rn(accO(i));
          __syncwarp();
          const int warp = ctid >> 5;
          t = lane >> 1, row0 = 16 * warp + 8 * (lane & 1);
          src = wst + warp * kWStage + t * kWStride + 8 * (lane & 1);
        } else {
          __nv_bfloat16* ost = ss.ostage[cw][c & 1];
          // (value row, token) -> ost[token][value row], through the accumulator partition (constant offsets)
          Tensor st_ =
              thr_x.partition_C(make_tensor(make_smem_ptr(ost), Layout<Shape<_64, _16>, Stride<_1, Int<kOStride>>>{}));
#pragma unroll
          for (int i = 0; i < size(accO); ++i) st_(i) = __float2bfloat16_rn(accO(i));
          named_sync(kBarOut + cw, 128);
          t = ctid >> 3, row0 = 8 * (ctid & 7);
          src = ost + t * kOStride + row0;
        }
        const uint4 w = *reinterpret_cast<const uint4*>(src);
        if (warp_out) __syncwarp();  // every lane read its piece before the next chunk's writes
        if (t < cl) {
          __nv_bfloat16* dst = out_ptr(sr.bos + c * kC + t) + v0 + row0;
          if (out_vec16) {
            *reinterpret_cast<uint4*>(dst) = w;
          } else {
            const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(&w);
#pragma unroll
            for (int e = 0; e < 8; ++e) dst[e] = x[e];
          }
        }
      }
      prof.mark(6);
    }
  }  // (forward)
  prof.finish(2 + cw, n_chunks);

  if (p.state != nullptr && sr.len > 0) store_state(p.state, p.state_dtype, write_slot(p, n, 0) * p.state_slot_stride);
  if (p.final_state != nullptr) store_state(p.final_state, DType::kFloat32, n * inner);
  if constexpr (kCluster) cute::cluster_sync();
#endif  // KDA_SM90_DEVICE
}

}  // namespace kda::chunked_sm90
