// Chunked ("WY form") KDA prefill for Hopper (sm_90a) in CuTe/CUTLASS: the same per-chunk math as the
// mma.sync kernel (csrc/kda/chunked/chunked_kernel.cuh, docs/design.md "Chunked form"), C = 16 tokens per
// chunk, K = V = 128, with the Hopper machinery:
//   * WG0, warp 0, one thread: TMA loads (SM90_TMA_LOAD, tensor maps encoded on the host) of the raw q, k, g
//     tiles [16 tokens][128] into a ring guarded by cutlass::PipelineTmaAsync (consumer: the prep WG), and of
//     the v tiles into a second ring (consumers: the two chain WGs). Packed input uses per-sequence
//     coordinates into the packed tensor (domain_offset); rows past a sequence's end are real tokens of the
//     next sequence (or TMA's zero fill at the tensor's end) and are masked by the consumers.
//   * WG1, prep: gate + in-chunk prefix (fp32), L2 norms, β, the decayed operands written as swizzled wgmma B
//     tiles (K⁺, Q⁺ bf16 K-major, Kr fp16 MN-major), L and Mqk (one warp of mma.sync m16n8k16 with relative
//     exponents; exact pairwise exponentials on CUDA cores when an in-chunk decay span is too wide), the
//     16x16 unit-lower inverse in fp32 (8x8 blocks by forward substitution, then the off-diagonal block),
//     INVb = INV diag(β) and Mqk as fp16 B tiles. Hands the chunk's operands to the chain through a
//     cutlass::PipelineAsync ring kOpStages deep (prep runs up to kOpStages chunks ahead).
//   * WG2 / WG3, chain: value rows 0-63 / 64-127 of the state S[V, K] as an fp32 wgmma accumulator
//     (64 registers per thread) for the whole sequence. Per chunk (ᵀ: value rows first):
//       Xᵀ = S K⁺ᵀ, O_interᵀ = S Q⁺ᵀ   (RS wgmma m64n16k16 x 8, A = bf16(S) converted in registers)
//       Yᵀ = Vᵀ - Xᵀ (padding tokens 0),  Uᵀ = Yᵀ INVbᵀ   (RS m64n16k16, fp16)
//       S = S ⊙ γ_C + Uᵀ Kr              (RS m64n128k16, fp16, accumulating into the state registers)
//       Oᵀ = O_interᵀ + Uᵀ Mqkᵀ          (RS m64n16k16) -> bf16, registers to global
//     The two chain WGs share only read-only pipeline stages; each stage is released after both consumed it.
//   * setmaxnreg: the producer WG gives its registers to the chain WGs.
// Numerics: fp32 state and accumulators, bf16 operands for S and the unbounded factors, fp16 for the bounded
// R path (as the mma.sync kernel).
// Covered (csrc/instantiations/chunked_sm90_vb128.cu, chunked_sm90_supported): inference prefill, bf16 tokens,
// fixed or packed, GQA, the three gate modes, logit or plain β, L2 norm on/off, bf16/fp32 pool slots with
// inactive slots, zero or pool start state, final state to the pool or to final_state, seq_order. Everything else
// (checkpoints, tapes, the backward chain, initial_state_source) runs on the mma.sync kernel. seq_order (the
// longest-first task order the Python layer sets for packed calls) maps blockIdx to the sequence.
// Variants (template kVariant, chosen per call by KDA_SM90_VARIANT, default 1) and the profile instantiation
// (kProfile, KDA_SM90_PROFILE=1: clock64 cycles per role and segment of CTA 0 into kda_sm90_prof):
//   0: the first version;
//   1: shared-memory accesses in the shared address space (the first version's aligned base lost it, so every
//      scratch access was a generic 64-bit LD.E/ST.E with 260 B of spills in prep), 16-byte stores of the
//      swizzled operand tiles at offsets computed by swz_offset, and in the chain X and O_inter as two wgmma
//      batches with the γ scaling and the v loads between issue and wait.
// Known limits of the first version, in the order they are expected to matter for speed (the first run: one
// CTA's serial chain of ~10k cycles per 16-token chunk is the limit, independent of the head count):
//   * prep is one warpgroup doing G (gate, norms, operands) and then W (L, Mqk, inverse) for each chunk in
//     sequence; the mma.sync kernel overlaps them on separate warps (needs double-buffered prep scratch);
//   * operand tiles are written element by element through the swizzled CuTe tensors (variant 1: 16 bytes);
//   * prep runs on one warp per scheduler, so each of its ~3k instructions per chunk pays its latency;
//   * X and O_inter are two N=16 GEMMs (could be one N=32 over a stacked [K⁺; Q⁺] tile), and the output goes
//     registers -> global as 2-byte stores (TMA store from a staging tile planned);
//   * the two chain warpgroups are not ping-ponged (no ordered barrier): they only share read-only stages.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/pipeline.hpp>

#include "kda/chunked/chunk_math.cuh"
#include "kda/common/bf16_bits.cuh"
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

constexpr int kC = 16;    // tokens per chunk
constexpr int kD = 128;   // K = V
constexpr int kRawStages = 4;  // raw q/k/g ring (TMA -> prep)
constexpr int kVStages = 4;    // raw v ring (TMA -> chain)
constexpr int kOpStages = 3;   // operand ring (prep -> chain)
constexpr int kThreads = 512;  // 4 warpgroups
constexpr int kBarPrep = 1;  // named barrier of the prep WG (0 is __syncthreads)

// ---- shared-memory layouts
// raw token tiles as TMA writes them: [16 tokens][128] row-major, no swizzle (read by CUDA cores)
using LayoutRaw = Layout<Shape<_16, _128>, Stride<_128, _1>>;
using LayoutRawRing = Layout<Shape<_16, _128, Int<kRawStages>>, Stride<_128, _1, _2048>>;
using LayoutVRing = Layout<Shape<_16, _128, Int<kVStages>>, Stride<_128, _1, _2048>>;
// wgmma B tiles. K⁺, Q⁺: (N = 16 tokens, K = 128 channels), K-major, 128-byte swizzle.
using LayoutKd = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_16, _128, Int<kOpStages>>{}));
// Kr: (N = 128 channels, K = 16 tokens), MN-major (channels contiguous), 128-byte swizzle.
using LayoutKr = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<f16_t>{}, Shape<_128, _16, Int<kOpStages>>{}));
// INVb, Mqk: (N = 16 output tokens, K = 16 tokens), K-major, 32-byte swizzle.
using LayoutT16 = decltype(tile_to_shape(GMMA::Layout_K_SW32_Atom<f16_t>{}, Shape<_16, _16, Int<kOpStages>>{}));

// Element offset of a coordinate in one of the swizzled layouts above, computed on offsets instead of through
// a swizzled smem pointer (CuTe applies the swizzle to the address bits after an integer cast, which turns
// the access into a generic 64-bit one); equal to the pointer form because every tile is 1024-byte aligned
// (scripts/sm90_layout_check.cu checks both facts on the host).
// The GMMA atoms' swizzle (Sw<3,4,3> for the 128-byte one) acts on byte offsets.
template <class L, class... Is>
CUTE_HOST_DEVICE int swz_offset(L, Is... is) {
  constexpr int kBytes = 2;  // every swizzled tile here holds 16-bit elements
  const int bytes = static_cast<int>(get_nonswizzle_portion(L{})(is...)) * kBytes;
  return static_cast<int>(get_swizzle_portion(L{})(bytes)) / kBytes;
}

using PipeRaw = cutlass::PipelineTmaAsync<kRawStages>;
using PipeV = cutlass::PipelineTmaAsync<kVStages>;
using PipeOp = cutlass::PipelineAsync<kOpStages>;

struct SharedStorage {
  // prep -> chain operands (ring of kOpStages)
  alignas(1024) bf16_t kd[cosize_v<LayoutKd>];
  alignas(1024) bf16_t qd[cosize_v<LayoutKd>];
  alignas(1024) f16_t kr[cosize_v<LayoutKr>];
  alignas(1024) f16_t invb[cosize_v<LayoutT16>];
  alignas(1024) f16_t mqk[cosize_v<LayoutT16>];
  alignas(16) float gamma[kOpStages][kD];  // e^{Γ_C} per channel
  // TMA destinations
  alignas(128) bf16_t q[cosize_v<LayoutRawRing>];
  alignas(128) bf16_t k[cosize_v<LayoutRawRing>];
  alignas(128) bf16_t g[cosize_v<LayoutRawRing>];
  alignas(128) bf16_t v[cosize_v<LayoutVRing>];
  // prep-only scratch (one chunk at a time; the prep WG's barriers order it)
  alignas(16) __nv_bfloat16 km[kC * kD], qm[kC * kD], kn[kC * kD];  // XOR-swizzled for ldmatrix
  alignas(16) float gp[kC * kD];  // Γ' = Γ - Γ_0 (log2 units)
  alignas(16) float e0[kD], ecp[kD], a0[kD], gc[kD];
  alignas(16) float rq[kC], rk[kC], beta[kC];
  alignas(16) float ap[kC * kC];  // A' = diag(β) strict_tril(L)
  alignas(16) float i2s[8 * 8];
  alignas(16) typename PipeRaw::SharedStorage pipe_raw;
  alignas(16) typename PipeV::SharedStorage pipe_v;
  alignas(16) typename PipeOp::SharedStorage pipe_op;
};

// ---- TMA of one token tensor [B, T, heads, 128] (bf16): gmem modes (T, 128, heads, B), box (16, 128).
inline auto make_token_tma(const void* ptr, int T, int heads, int B, int64_t ts, int64_t hs, int64_t bs) {
  Tensor g = make_tensor(make_gmem_ptr(static_cast<const bf16_t*>(ptr)),
                         make_layout(make_shape(T, Int<kD>{}, heads, B), make_stride(ts, Int<1>{}, hs, bs)));
  return make_tma_copy(SM90_TMA_LOAD{}, g, LayoutRaw{}, Shape<_16, _128>{}, Int<1>{});
}
using TmaToken = decltype(make_token_tma(nullptr, 1, 1, 1, int64_t(8), int64_t(8), int64_t(8)));

struct KernelArgs {
  RecurrentParams p;
  TmaToken tma_q, tma_k, tma_g, tma_v;
};

// ---- small device helpers
__device__ __forceinline__ int swz(int row, int piece) { return row * kD + ((piece ^ (row & 7)) << 3); }
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
__device__ __forceinline__ float sat_f16(float x) { return fminf(fmaxf(x, -65504.f), 65504.f); }
__device__ __forceinline__ float bfv(const __nv_bfloat16 x) { return __bfloat162float(x); }
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

// ---- profile instantiation: per role (producer, prep, chain WG2, chain WG3) and per segment of the chunk loop,
// the clock64() cycles summed over the chunks of CTA 0, measured by the first thread of each role. Segments
// named in kProfNames (csrc/instantiations/chunked_sm90_vb128.cu prints them). Slot [role][kProfSegs] holds
// the chunk count.
constexpr int kProfRoles = 4, kProfSegs = 8;
struct ProfClock {
  unsigned long long acc[kProfSegs];
  long long t;
  __device__ __forceinline__ void start() {
#pragma unroll
    for (int i = 0; i < kProfSegs; ++i) acc[i] = 0;
    t = clock64();
  }
  __device__ __forceinline__ void mark(int seg) {  // the time since the last mark goes to `seg`
    const long long now = clock64();
    acc[seg] += static_cast<unsigned long long>(now - t);
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

// kProfile: the profile instantiation (segment clocks of CTA 0 into kda_sm90_prof). kVariant 0: the first
// version; 1: 16-byte stores of the swizzled operand tiles in prep; in the chain, X and O_inter as two
// batches (Y waits only for X), the γ scaling of the state and the v loads while the X product runs.
template <bool kProfile, int kVariant>
__global__ void __launch_bounds__(kThreads, 1) kda_chunked_sm90_kernel(const __grid_constant__ KernelArgs args) {
#if defined(KDA_SM90_DEVICE)
  const RecurrentParams& p = args.p;
  extern __shared__ char smem_raw[];
  // The 1024-byte alignment of the swizzled tiles. Variant 1 aligns by an offset from the __shared__ array, so
  // the compiler keeps the shared address space (LDS/STS with 32-bit addresses); the first version's integer
  // round trip made every scratch access a generic 64-bit LD.E/ST.E.
  char* smem_base;
  if constexpr (kVariant >= 1) {
    const uint32_t a = static_cast<uint32_t>(__cvta_generic_to_shared(smem_raw));
    smem_base = smem_raw + ((1024u - (a & 1023u)) & 1023u);
  } else {
    smem_base = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  }
  SharedStorage& ss = *reinterpret_cast<SharedStorage*>(smem_base);

  const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31;
  const int hv = static_cast<int>(blockIdx.x % p.HV);
  int64_t n = blockIdx.x / p.HV;
  if (p.seq_order != nullptr) {  // scheduling hint: task -> sequence (longest first); CTA-uniform
    n = p.seq_order[n];
    if (n < 0 || n >= p.N) return;  // a broken permutation never reads out of bounds
  }
  const int h = hv / (p.HV / p.H);
  const SeqRange sr = seq_range(p, n);
  const StartState st = start_state(p, n);
  const int64_t n_chunks = (sr.len + kC - 1) / kC;
  auto chunk_len = [&](int64_t c) { return static_cast<int>(sr.len - c * kC < kC ? sr.len - c * kC : kC); };
  auto out_ptr = [&](int64_t t) {  // token t (index along T), value row 0 of head hv
    return static_cast<__nv_bfloat16*>(p.out) + sr.batch * p.out_batch_stride + t * p.out_token_stride +
           int64_t(hv) * p.out_head_stride;
  };

  if (st.kind < 0) {  // inactive slot: zero output, the pool untouched
    for (int64_t e = tid; e < sr.len * kD; e += kThreads) out_ptr(sr.bos + e / kD)[e % kD] = __float2bfloat16_rn(0.f);
    return;
  }
  if (sr.len == 0 && p.final_state == nullptr) return;  // a zero-length sequence leaves its slot untouched

  // ---- pipelines (barriers initialised by warp 0, visible to all after the __syncthreads below)
  typename PipeRaw::Params prp;
  prp.transaction_bytes = 3 * kC * kD * sizeof(bf16_t);
  prp.role = wg == 0 ? PipeRaw::ThreadCategory::Producer
                     : (wg == 1 ? PipeRaw::ThreadCategory::Consumer : PipeRaw::ThreadCategory::NonParticipant);
  prp.is_leader = tid == 0;
  prp.num_consumers = 128;
  PipeRaw pipe_raw(ss.pipe_raw, prp, Shape<_1, _1, _1>{});
  typename PipeV::Params pvp;
  pvp.transaction_bytes = kC * kD * sizeof(bf16_t);
  pvp.role = wg == 0 ? PipeV::ThreadCategory::Producer
                     : (wg >= 2 ? PipeV::ThreadCategory::Consumer : PipeV::ThreadCategory::NonParticipant);
  pvp.is_leader = tid == 0;
  pvp.num_consumers = 256;
  PipeV pipe_v(ss.pipe_v, pvp, Shape<_1, _1, _1>{});
  typename PipeOp::Params pop;
  pop.role = wg == 1 ? PipeOp::ThreadCategory::Producer
                     : (wg >= 2 ? PipeOp::ThreadCategory::Consumer : PipeOp::ThreadCategory::NonParticipant);
  pop.producer_arv_count = 128;
  pop.consumer_arv_count = 256;
  PipeOp pipe_op(ss.pipe_op, pop);
  __syncthreads();

  if (wg == 0) {
    // ================================ producer ================================
    cutlass::arch::warpgroup_reg_dealloc<40>();
    if (tid == 0 && n_chunks > 0) {
      cute::prefetch_tma_descriptor(args.tma_q.get_tma_descriptor());
      cute::prefetch_tma_descriptor(args.tma_k.get_tma_descriptor());
      cute::prefetch_tma_descriptor(args.tma_g.get_tma_descriptor());
      cute::prefetch_tma_descriptor(args.tma_v.get_tma_descriptor());
      const int T = static_cast<int>(p.T), B = static_cast<int>(p.B), bos = static_cast<int>(sr.bos);
      const int b = static_cast<int>(sr.batch);
      auto tiles = [&](const TmaToken& tma, int heads, int head) {
        Tensor m = tma.get_tma_tensor(make_shape(T, Int<kD>{}, heads, B));
        Tensor ms = domain_offset(make_coord(bos, _0{}), m(_, _, head, b));  // this sequence's tokens
        return local_tile(ms, Shape<_16, _128>{}, make_coord(_, _0{}));     // (16, 128, chunk)
      };
      Tensor gQ = tiles(args.tma_q, p.H, h), gK = tiles(args.tma_k, p.H, h);
      Tensor gG = tiles(args.tma_g, p.HV, hv), gV = tiles(args.tma_v, p.HV, hv);
      Tensor sQ = make_tensor(make_smem_ptr(ss.q), LayoutRawRing{});
      Tensor sK = make_tensor(make_smem_ptr(ss.k), LayoutRawRing{});
      Tensor sG = make_tensor(make_smem_ptr(ss.g), LayoutRawRing{});
      Tensor sV = make_tensor(make_smem_ptr(ss.v), LayoutVRing{});
      auto [tQg, tQs] = tma_partition(args.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
      auto [tKg, tKs] = tma_partition(args.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
      auto [tGg, tGs] = tma_partition(args.tma_g, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sG), group_modes<0, 2>(gG));
      auto [tVg, tVs] = tma_partition(args.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
      auto st_raw = cutlass::make_producer_start_state<PipeRaw>();
      auto st_v = cutlass::make_producer_start_state<PipeV>();
      Prof<kProfile> prof;
      prof.start(true);
      for (int64_t c = 0; c < n_chunks; ++c) {
        pipe_raw.producer_acquire(st_raw);
        prof.mark(0);
        auto* bar = pipe_raw.producer_get_barrier(st_raw);
        const int s = st_raw.index();
        copy(args.tma_q.with(*bar), tQg(_, c), tQs(_, s));
        copy(args.tma_k.with(*bar), tKg(_, c), tKs(_, s));
        copy(args.tma_g.with(*bar), tGg(_, c), tGs(_, s));
        ++st_raw;
        prof.mark(1);
        pipe_v.producer_acquire(st_v);
        prof.mark(2);
        copy(args.tma_v.with(*pipe_v.producer_get_barrier(st_v)), tVg(_, c), tVs(_, st_v.index()));
        ++st_v;
        prof.mark(3);
      }
      prof.finish(0, n_chunks);
    }
    return;
  }

  if (wg == 1) {
    // ================================ prep ================================
    const int ptid = tid - 128, d = ptid, pwarp = ptid >> 5;
    const bool in_gate = p.gate_mode != GateMode::kPrecomputed;
    const float A = in_gate ? __expf(p.A_log[hv]) : 0.f;
    const float dtb = (in_gate && p.dt_bias != nullptr) ? p.dt_bias[int64_t(hv) * kD + d] : 0.f;
    const float A2 = A * kLog2e, Adtb = A2 * dtb, lb2 = p.lower_bound * kLog2e;
    const auto* bsrc = static_cast<const __nv_bfloat16*>(p.beta.ptr) + sr.batch * p.beta.batch_stride +
                       int64_t(hv) * p.beta.head_stride;
    auto load_beta = [&](int64_t c) {
      __nv_bfloat16 bv = __float2bfloat16_rn(0.f);
      if (ptid < kC && c < n_chunks && c * kC + ptid < sr.len) bv = bsrc[(sr.bos + c * kC + ptid) * p.beta.token_stride];
      return bv;
    };
    Tensor sKd = make_tensor(make_smem_ptr(ss.kd), LayoutKd{});
    Tensor sQd = make_tensor(make_smem_ptr(ss.qd), LayoutKd{});
    Tensor sKr = make_tensor(make_smem_ptr(ss.kr), LayoutKr{});
    Tensor sInv = make_tensor(make_smem_ptr(ss.invb), LayoutT16{});
    Tensor sMqk = make_tensor(make_smem_ptr(ss.mqk), LayoutT16{});
    // element references into the 16x16 tiles (variant 1: offsets from the shared arrays, see swz_offset)
    auto mqk_ref = [&](int i, int j, int s) -> f16_t& {
      if constexpr (kVariant >= 1) return ss.mqk[swz_offset(LayoutT16{}, i, j, s)];
      else return sMqk(i, j, s);
    };
    auto inv_ref = [&](int i, int j, int s) -> f16_t& {
      if constexpr (kVariant >= 1) return ss.invb[swz_offset(LayoutT16{}, i, j, s)];
      else return sInv(i, j, s);
    };
    typename PipeRaw::PipelineState st_raw;  // consumer: stage 0, phase 0
    auto st_op = cutlass::make_producer_start_state<PipeOp>();
    __nv_bfloat16 beta_next = load_beta(0);
    Prof<kProfile> prof;
    prof.start(ptid == 0);
    for (int64_t c = 0; c < n_chunks; ++c) {
      const int cl = chunk_len(c);
      const __nv_bfloat16 beta_raw = beta_next;
      beta_next = load_beta(c + 1);
      prof.mark(7);
      pipe_op.producer_acquire(st_op);
      prof.mark(0);
      pipe_raw.consumer_wait(st_raw);
      prof.mark(1);
      named_sync(kBarPrep, 128);  // the previous chunk's scratch readers are done
      prof.mark(2);
      const int rs = st_raw.index(), os = st_op.index();
      const bf16_t* rq_ = ss.q + rs * kC * kD;
      const bf16_t* rk_ = ss.k + rs * kC * kD;
      const bf16_t* rg_ = ss.g + rs * kC * kD;
      const auto* rqb = reinterpret_cast<const __nv_bfloat16*>(rq_);
      const auto* rkb = reinterpret_cast<const __nv_bfloat16*>(rk_);

      // ---- gate prefix of channel d, L2 norms, β
      float a0 = 0.f, gc = 0.f;
      gate_prefix_of(p.gate_mode, rg_, ss.gp, d, cl, A2, Adtb, dtb, lb2, a0, gc);
      ss.e0[d] = exp2f(a0);
      ss.ecp[d] = exp2f(gc);
      ss.a0[d] = a0;
      ss.gc[d] = gc;
      ss.gamma[os][d] = exp2f(a0 + gc);
      const int wide = !(-gc <= kSpanLimit);
      {
        const int row = ptid >> 2, part4 = ptid & 3;  // 32 rows (q then k), 4 threads x 32 elements
        const __nv_bfloat16* src = (row < kC ? rqb + row * kD : rkb + (row - kC) * kD) + part4 * 32;
        const float sq = row_sumsq_quad(src);
        if (part4 == 0) {
          const float r = p.use_qk_l2norm ? rsqrtf(sq + kL2NormEps) : 1.f;
          if (row < kC)
            ss.rq[row] = r * p.scale;
          else
            ss.rk[row - kC] = r;
        }
      }
      if (ptid < kC) {
        const float x = bfv(beta_raw);
        ss.beta[ptid] = ptid < cl ? beta_value(x, p.beta_is_logit) : 0.f;
      }
      prof.mark(3);
      const bool pairwise = named_sync_or(kBarPrep, 128, wide);
      prof.mark(2);

      // ---- decayed operand tiles: 2 items of (row i, 8 channels) per thread
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int idx = ptid + 128 * u, i = idx >> 4, pc = idx & 15, d0 = pc * 8;
        float gi[8];
        load8f(ss.gp + i * kD + d0, gi);
        const uint4 kw = *reinterpret_cast<const uint4*>(rkb + i * kD + d0);
        const uint4 qw = *reinterpret_cast<const uint4*>(rqb + i * kD + d0);
        const uint32_t kws[4] = {kw.x, kw.y, kw.z, kw.w}, qws[4] = {qw.x, qw.y, qw.z, qw.w};
        float kk[8], qq[8];
        const bool live = i < cl;  // rows past the end: zero operands (no effect on the state or outputs)
        const float rk = live ? ss.rk[i] : 0.f, rq = live ? ss.rq[i] : 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          kk[2 * e] = bf16_lo(kws[e]) * rk, kk[2 * e + 1] = bf16_hi(kws[e]) * rk;
          qq[2 * e] = bf16_lo(qws[e]) * rq, qq[2 * e + 1] = bf16_hi(qws[e]) * rq;
        }
        if (!live) {  // (0 * inf or NaN garbage of another sequence's row stays out)
#pragma unroll
          for (int e = 0; e < 8; ++e) kk[e] = 0.f, qq[e] = 0.f;
        }
        float kp[8], qp[8], kr[8];
        if (!pairwise) {
          float e0v[8], ecv[8], km[8], qm[8], kn[8];
          load8f(ss.e0 + d0, e0v);
          load8f(ss.ecp + d0, ecv);
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float ex = exp2f(gi[e]), ei = __fdividef(1.f, ex);
            km[e] = kk[e] * ex, qm[e] = qq[e] * ex, kn[e] = kk[e] * ei;
            kp[e] = km[e] * e0v[e], qp[e] = qm[e] * e0v[e], kr[e] = kn[e] * ecv[e];
          }
          const int o = swz(i, pc);
          *reinterpret_cast<uint4*>(ss.km + o) = pack8_bf16(km);
          *reinterpret_cast<uint4*>(ss.qm + o) = pack8_bf16(qm);
          *reinterpret_cast<uint4*>(ss.kn + o) = pack8_bf16(kn);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            const float e1 = exp2f(ss.a0[d0 + e] + gi[e]);
            kp[e] = kk[e] * e1, qp[e] = qq[e] * e1;
            kr[e] = kk[e] * exp2f(ss.gc[d0 + e] - gi[e]);
          }
        }
        if constexpr (kVariant >= 1) {
          // 8 consecutive channels are 16 contiguous, 16-byte aligned bytes in both swizzled layouts
          // (K-major SW128: a row's 64-element atom row, permuted in 8-element pieces; MN-major SW128 likewise
          // along the channels); scripts/sm90_layout_check.cu checks this on the host.
#pragma unroll
          for (int e = 0; e < 8; ++e) kr[e] = sat_f16(kr[e]);
          *reinterpret_cast<uint4*>(ss.kd + swz_offset(LayoutKd{}, i, d0, os)) = pack8_bf16(kp);
          *reinterpret_cast<uint4*>(ss.qd + swz_offset(LayoutKd{}, i, d0, os)) = pack8_bf16(qp);
          *reinterpret_cast<uint4*>(ss.kr + swz_offset(LayoutKr{}, d0, i, os)) = pack8_f16(kr);
        } else {
#pragma unroll
          for (int e = 0; e < 8; ++e) {
            sKd(i, d0 + e, os) = bf16_t(kp[e]);
            sQd(i, d0 + e, os) = bf16_t(qp[e]);
            sKr(d0 + e, i, os) = f16_t(sat_f16(kr[e]));
          }
        }
      }
      if (pairwise) {
        // exact Σ_d k̂_i k̂_j e^{Γ_i - Γ_j} on CUDA cores; masked pairs never exponentiated
        for (int e = ptid; e < kC * kC; e += 128) {
          const int i = e / kC, jj = e % kC;
          float l = 0.f, mq = 0.f;
          if (jj <= i && i < cl) {
            for (int dd = 0; dd < kD; ++dd) {
              const float w = exp2f(ss.gp[i * kD + dd] - ss.gp[jj * kD + dd]) * bfv(rkb[jj * kD + dd]);
              l = fmaf(bfv(rkb[i * kD + dd]), w, l);
              mq = fmaf(bfv(rqb[i * kD + dd]), w, mq);
            }
            l *= ss.rk[i] * ss.rk[jj];
            mq *= ss.rq[i] * ss.rk[jj];
          }
          ss.ap[e] = jj < i ? ss.beta[i] * l : 0.f;
          mqk_ref(i, jj, os) = f16_t(sat_f16(mq));
        }
      }
      pipe_raw.consumer_release(st_raw);  // done with the raw tiles
      ++st_raw;
      prof.mark(4);
      named_sync(kBarPrep, 128);  // Km/Qm/Kn (or A', Mqk) complete
      prof.mark(2);

      if (pwarp <= 1 && !pairwise) {
        // warp 0: L = Km Knᵀ -> A' = diag(β) strict_tril(L); warp 1 at the same time: Mqk = tril(Qm Knᵀ).
        // (mma.sync m16n8k16, even / odd k-steps into separate accumulators)
        const __nv_bfloat16* asrc = pwarp == 0 ? ss.km : ss.qm;
        const int gq = lane >> 2, cq = lane & 3;
        const TileOffsets toff_a(((lane >> 3) & 1) * 8 + (lane & 7), (lane >> 4) & 1);
        const TileOffsets toff_b(((lane >> 4) & 1) * 8 + (lane & 7), (lane >> 3) & 1);
        float al[2][4] = {}, al2[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < kD / 16; ++ks) {
          uint32_t fa[4], fn[4];
          ldsm_x4(asrc + toff_a.at(ks), fa);
          ldsm_x4(ss.kn + toff_b.at(ks), fn);
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
            if (pwarp == 0)
              ss.ap[i * kC + jj] = jj < i ? ss.beta[i] * x : 0.f;
            else
              mqk_ref(i, jj, os) = f16_t(jj <= i ? sat_f16(x) : 0.f);
          }
        __syncwarp();
      }
      prof.mark(5);
      if (pwarp == 0) {
        // INVb = (I + A')^{-1} diag(β), blockwise in fp32 (chunk_math.cuh)
        unit_lower_inverse16(ss.ap, ss.i2s, ss.beta, lane,
                             [&](int r, int c, float x) { inv_ref(r, c, os) = f16_t(sat_f16(x)); });
      }
      // generic-proxy writes of the operand tiles -> visible to wgmma (async proxy), then publish
      prof.mark(6);
      cutlass::arch::fence_view_async_shared();
      pipe_op.producer_commit(st_op);
      ++st_op;
    }
    prof.finish(1, n_chunks);
    return;
  }

  // ================================ chain (WG2: value rows 0-63, WG3: 64-127) ================================
  cutlass::arch::warpgroup_reg_alloc<168>();
  const int cw = wg - 2, ctid = tid - 256 - 128 * cw, v0 = 64 * cw;
  using MmaX = SM90::GMMA::MMA_64x16x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
  using MmaU = SM90::GMMA::MMA_64x16x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::K>;
  using MmaS = SM90::GMMA::MMA_64x128x16_F32F16F16_RS<GMMA::Major::K, GMMA::Major::MN>;
  auto mma_x = make_tiled_mma(MmaX{});
  auto mma_u = make_tiled_mma(MmaU{});
  auto mma_s = make_tiled_mma(MmaS{});
  auto thr_x = mma_x.get_slice(ctid);
  auto thr_u = mma_u.get_slice(ctid);
  auto thr_s = mma_s.get_slice(ctid);

  Tensor sKd = make_tensor(make_smem_ptr(ss.kd), LayoutKd{});
  Tensor sQd = make_tensor(make_smem_ptr(ss.qd), LayoutKd{});
  Tensor sKr = make_tensor(make_smem_ptr(ss.kr), LayoutKr{});
  Tensor sInv = make_tensor(make_smem_ptr(ss.invb), LayoutT16{});
  Tensor sMqk = make_tensor(make_smem_ptr(ss.mqk), LayoutT16{});
  Tensor bKd = thr_x.partition_fragment_B(sKd);    // (MMA, 1, 8, stages) descriptors
  Tensor bQd = thr_x.partition_fragment_B(sQd);
  Tensor bInv = thr_u.partition_fragment_B(sInv);  // (MMA, 1, 1, stages)
  Tensor bMqk = thr_u.partition_fragment_B(sMqk);
  Tensor bKr = thr_s.partition_fragment_B(sKr);    // (MMA, 1, 1, stages)

  Tensor accS = partition_fragment_C(mma_s, Shape<_64, _128>{});  // ((2, 2, 16), 1, 1) fp32: the state rows
  Tensor accX = partition_fragment_C(mma_x, Shape<_64, _16>{});   // ((2, 2, 2), 1, 1)
  Tensor accO = partition_fragment_C(mma_x, Shape<_64, _16>{});
  Tensor accU = partition_fragment_C(mma_u, Shape<_64, _16>{});
  Tensor cS = thr_s.partition_C(make_identity_tensor(Shape<_64, _128>{}));  // (value row, channel) per element
  Tensor cX = thr_x.partition_C(make_identity_tensor(Shape<_64, _16>{}));   // (value row, token)
  Tensor aS = make_tensor<bf16_t>(partition_shape_A(mma_x, Shape<_64, _128>{}));  // ((2, 2, 2), 1, 8)
  Tensor aY = make_tensor<f16_t>(partition_shape_A(mma_u, Shape<_64, _16>{}));    // ((2, 2, 2), 1, 1)
  Tensor aU = make_tensor<f16_t>(partition_shape_A(mma_s, Shape<_64, _16>{}));    // ((2, 2, 2), 1, 1)
  // For 16-bit A operands the accumulator of columns [16 j, 16 j + 16) and the A fragment of k-block j share
  // the thread and value order, so the conversion is element i -> element i.
  static_assert(decltype(size(accS))::value == 64 && decltype(size(aS))::value == 64, "S fragment sizes");
  static_assert(decltype(size(accX))::value == 8 && decltype(size(aY))::value == 8 && decltype(size(aU))::value == 8,
                "16-token fragment sizes");
  static_assert(decltype(size<2>(aS))::value == 8 && decltype(size<0>(aS))::value == 8, "A = S k-blocks");

  // start state (pool slot, bf16 or fp32; zeros without a pool or for a zero-length row)
  const int64_t head_off = int64_t(hv) * kD * kD;
  const int64_t inner = int64_t(p.HV) * kD * kD;
  {
    const void* base = nullptr;
    DType dt = DType::kFloat32;
    int64_t off = 0;
    if (st.kind == 1 && sr.len > 0) base = p.state, dt = p.state_dtype, off = st.slot * p.state_slot_stride;
#pragma unroll
    for (int i = 0; i < size(accS); ++i) {
      const int m = get<0>(cS(i)), c = get<1>(cS(i));
      float x = 0.f;
      if (base != nullptr) {
        const int64_t e = off + head_off + int64_t(v0 + m) * kD + c;
        x = dt == DType::kBFloat16 ? __bfloat162float(static_cast<const __nv_bfloat16*>(base)[e])
                                   : static_cast<const float*>(base)[e];
      }
      accS(i) = x;
    }
  }

  typename PipeV::PipelineState st_v;
  typename PipeOp::PipelineState st_op;
  Prof<kProfile> prof;
  prof.start(ctid == 0);
  for (int64_t c = 0; c < n_chunks; ++c) {
    const int cl = chunk_len(c);
    prof.mark(7);
    pipe_op.consumer_wait(st_op);
    prof.mark(0);
    if constexpr (kVariant == 0) {
      pipe_v.consumer_wait(st_v);
      prof.mark(1);
    }
    const int os = st_op.index();

    // ---- Xᵀ = S K⁺ᵀ, O_interᵀ = S Q⁺ᵀ
#pragma unroll
    for (int i = 0; i < size(aS); ++i) aS(i) = bf16_t(accS(i));
    clear(accX);
    clear(accO);
    warpgroup_fence_operand(aS);
    warpgroup_fence_operand(accX);
    warpgroup_fence_operand(accO);
    const float* gam = ss.gamma[os];
    float vv[size(accX)];
    // this chunk's v values (tokens past the end: 0) into registers, then the stage back to the producer
    auto take_v = [&] {
      const __nv_bfloat16* vt = reinterpret_cast<const __nv_bfloat16*>(ss.v) + st_v.index() * kC * kD;
#pragma unroll
      for (int i = 0; i < size(accX); ++i) {
        const int m = get<0>(cX(i)), t = get<1>(cX(i));
        vv[i] = t < cl ? bfv(vt[t * kD + v0 + m]) : 0.f;
      }
      pipe_v.consumer_release(st_v);
      ++st_v;
    };
    if constexpr (kVariant >= 1) {
      // two batches: Y needs X only; O_inter completes while Y and U are computed
      warpgroup_arrive();
      gemm(mma_x, aS, bKd(_, _, _, os), accX);
      warpgroup_commit_batch();
      gemm(mma_x, aS, bQd(_, _, _, os), accO);
      warpgroup_commit_batch();
      prof.mark(2);
      // while the products run: S ⊙ γ_C (accS is not an operand of them: A is its bf16 copy aS) and v
      warpgroup_fence_operand(accS);
#pragma unroll
      for (int i = 0; i < size(accS); ++i) accS(i) *= gam[get<1>(cS(i))];
      warpgroup_fence_operand(accS);
      prof.mark(3);
      pipe_v.consumer_wait(st_v);
      prof.mark(1);
      take_v();
      prof.mark(3);
      warpgroup_wait<1>();
      warpgroup_fence_operand(accX);
      prof.mark(2);
    } else {
      warpgroup_arrive();
      gemm(mma_x, aS, bKd(_, _, _, os), accX);
      gemm(mma_x, aS, bQd(_, _, _, os), accO);
      warpgroup_commit_batch();
      warpgroup_wait<0>();
      warpgroup_fence_operand(accX);
      warpgroup_fence_operand(accO);
      prof.mark(2);
      take_v();
    }

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
    warpgroup_wait<0>();  // (variant 1: also O_inter, long done by now)
    warpgroup_fence_operand(accU);
    warpgroup_fence_operand(accO);
#pragma unroll
    for (int i = 0; i < size(accU); ++i) aU(i) = f16_t(sat_f16(accU(i)));
    prof.mark(4);

    // ---- S = S ⊙ γ_C + Uᵀ Kr;  Oᵀ = O_interᵀ + Uᵀ Mqkᵀ
    if constexpr (kVariant == 0) {
#pragma unroll
      for (int i = 0; i < size(accS); ++i) accS(i) *= gam[get<1>(cS(i))];
    }
    warpgroup_fence_operand(aU);
    warpgroup_fence_operand(accS);
    warpgroup_fence_operand(accO);
    warpgroup_arrive();
    gemm(mma_s, aU, bKr(_, _, _, os), accS);
    gemm(mma_u, aU, bMqk(_, _, _, os), accO);
    warpgroup_commit_batch();
    warpgroup_wait<0>();
    warpgroup_fence_operand(accS);
    warpgroup_fence_operand(accO);
    pipe_op.consumer_release(st_op);
    ++st_op;
    prof.mark(5);

    // ---- output rows of this chunk (registers -> global)
    const int64_t t0 = sr.bos + c * kC;
#pragma unroll
    for (int i = 0; i < size(accO); ++i) {
      const int m = get<0>(cX(i)), t = get<1>(cX(i));
      if (t < cl) out_ptr(t0 + t)[v0 + m] = __float2bfloat16_rn(accO(i));
    }
    prof.mark(6);
  }
  prof.finish(2 + cw, n_chunks);

  auto store_state = [&](void* base, DType dt, int64_t off) {
#pragma unroll
    for (int i = 0; i < size(accS); ++i) {
      const int m = get<0>(cS(i)), c = get<1>(cS(i));
      const int64_t e = off + head_off + int64_t(v0 + m) * kD + c;
      if (dt == DType::kBFloat16)
        static_cast<__nv_bfloat16*>(base)[e] = __float2bfloat16_rn(accS(i));
      else
        static_cast<float*>(base)[e] = accS(i);
    }
  };
  if (p.state != nullptr && sr.len > 0) store_state(p.state, p.state_dtype, write_slot(p, n, 0) * p.state_slot_stride);
  if (p.final_state != nullptr) store_state(p.final_state, DType::kFloat32, n * inner);
#endif  // KDA_SM90_DEVICE
}

}  // namespace kda::chunked_sm90
