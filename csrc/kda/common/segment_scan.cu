// kda_segment_state_scan_kernel: the split's scan of segment start states (segment_scan.h). The rows of a
// state evolve independently (S[j][r] = S[j-1][r] P + Q[j][r]), so a block owns kRows rows of one batch
// entry for the whole scan: the rows stay in shared memory from step to step; thread (c, part) computes column
// c of them over the part-th quarter of the k range, reading those rows of P[j-1] (coalesced across the
// columns; the batch entry's other row blocks read the same P from L2), and part 0 adds the other parts'
// sums in part order (deterministic, no atomics). A step waits on its loads of P, which do not depend on the
// state: four parts keep four times the loads in flight that one thread per column did.
//
// The streamed path (K % 4 == 0, 16-byte aligned tensors). The path above waits each step on its own loads of P
// (64 KB at K = 128, issued only when the step starts). Here P runs through a ring of kStages shared-memory slots
// of kChunk = 16 k-rows (8 KB at K = 128), each filled by one bulk copy (cp.async.bulk, completing on the slot's
// mbarrier) issued by thread 0. The chunk stream is continuous over the steps (P does not depend on the state):
// chunk g + kStages - 1 is issued when chunk g is consumed, so the next step's P is in flight while this step
// computes. 128 threads: lane l of warp w owns columns c = 32 w + 4 (l % 8) .. c + 3 and rows l / 8 + 4 i,
// i < RT (4 RT rows per block). Per 4 k a thread loads RT float4 of the rows (4 distinct addresses in distinct
// banks: the rows' stride is padded to 132 floats) and 4 float4 of P (8 distinct, 128 B): one wavefront each,
// for 16 RT FMAs. Each output is one sequential fp32 sum over k, then + Q: deterministic.
// Model, K = 128, one block and step (4 warps, one per SMSP; H100 at 1.98 GHz):
//   RT = 2 (8 rows): per thread 1024 FFMA + 192 LDS.128; per chunk ~20 instructions of barrier, mbarrier wait
//     and loop (thread 0: ~30 more to issue the copy), ~50 for the step's end: ~1570 issue slots per SMSP
//     (SASS count) -> ~0.8 us a step at one instruction per clock (floor: the FFMAs, 1024 clk = 0.52 us).
//     Shared memory: 768 wavefronts per step for the block (< 1024 FFMA clocks of each SMSP). 9 barriers.
//   RT = 4 (16 rows): 2048 FFMA + 256 LDS + ~250 -> ~2550 clk ~ 1.3 us;  RT = 8: 4096 + 384 + 250 -> ~2.4 us.
//   Latency: a chunk is 16 x 8 FFMA per thread (~190 clk at RT = 2); kStages - 1 = 4 chunks ahead (~760 clk)
//     cover an L2 round trip (~600-800 clk); at RT = 4, 8 three and two chunks ahead (~1000 clk).
//   P: K^2 x 4 B = 64 KB per block and step from L2: ~80 GB/s per block at RT = 2 against ~6 TB/s of L2, so
//     about 75 such blocks at once saturate it; 16 and 32 rows per block (RT = 4, 8) read each P once for 2x,
//     4x the rows. With w blocks per SM the SMSPs' issue is shared: ~w x the above.
// The measured step times, and where they depart from this model (one block per SM runs ~4x slower than its
// issue count), are in docs/performance.md, "Exact sequence split"; the launchers' choice of RT follows them.
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "kda/common/cuda_check.h"
#include "kda/common/segment_scan.h"

namespace kda {
namespace {

constexpr int kScanCols = 128;  // one thread per column and part, K <= 128
constexpr int kParts = 4;       // the k range split over four thread groups
constexpr int kRows = 8;        // state rows per block

// Rows r0 .. r0 + kRows of one batch entry's states, for j = first .. J-1: S[j] = S[j-1] P[j-1] + Q[j-1], with the
// state, offset and map of step j at entry `base + j * stride` of S, Q and P. zero_start: S[first - 1] is taken as
// zero (not read, and P[first - 1] not read either: S[first] = Q[first - 1]). last: where step J - 1 writes
// instead of S (null: S).
__device__ __forceinline__ void scan_rows(float* __restrict__ S, const float* __restrict__ Q,
                                          const float* __restrict__ P, int64_t base, int64_t stride, int64_t first,
                                          int64_t J, int V, int K, bool zero_start, float* __restrict__ last) {
  __shared__ float rows[kRows][kScanCols];
  __shared__ float partial[kParts - 1][kRows][kScanCols];
  const int c = threadIdx.x % kScanCols, part = threadIdx.x / kScanCols;
  const int r0 = blockIdx.y * kRows;
  const int nr = V - r0 < kRows ? V - r0 : kRows;
  const int64_t state = int64_t(V) * K, map = int64_t(K) * K;
  const int per = (K + kParts - 1) / kParts, k0 = part * per, k1 = k0 + per < K ? k0 + per : K;
  // rows r0 .. r0 + nr of S[first - 1]
  const float* s_prev = S + (base + (first - 1) * stride) * state + int64_t(r0) * K;
  if (part == 0)
    for (int r = 0; r < kRows; ++r) rows[r][c] = !zero_start && c < K && r < nr ? s_prev[int64_t(r) * K + c] : 0.f;
  __syncthreads();
  for (int64_t j = first; j < J; ++j) {
    const float* pj = P + (base + (j - 1) * stride) * map;
    const float* qj = Q + (base + (j - 1) * stride) * state + int64_t(r0) * K;
    float acc[kRows];
#pragma unroll
    for (int r = 0; r < kRows; ++r) acc[r] = (part == 0 && c < K && r < nr) ? qj[int64_t(r) * K + c] : 0.f;
    if (c < K && !(zero_start && j == first)) {
#pragma unroll 8
      for (int k = k0; k < k1; ++k) {
        const float p = __ldg(pj + int64_t(k) * K + c);
#pragma unroll
        for (int r = 0; r < kRows; ++r) acc[r] = fmaf(rows[r][k], p, acc[r]);
      }
    }
    if (part > 0) {
#pragma unroll
      for (int r = 0; r < kRows; ++r) partial[part - 1][r][c] = acc[r];
    }
    __syncthreads();  // every thread has read the previous rows; the parts' sums are in `partial`
    if (part == 0) {
      float* sj = (last != nullptr && j == J - 1 ? last : S + (base + j * stride) * state) + int64_t(r0) * K;
#pragma unroll
      for (int r = 0; r < kRows; ++r) {
        float x = acc[r];
#pragma unroll
        for (int q = 0; q < kParts - 1; ++q) x += partial[q][r][c];
        if (r < nr && c < K) rows[r][c] = x, sj[int64_t(r) * K + c] = x;
      }
    }
    __syncthreads();
  }
}

// The grid layout: batch entry b = blockIdx.x at step j is entry j * batch + b.
__global__ void __launch_bounds__(kScanCols* kParts)
    kda_segment_state_scan_kernel(float* __restrict__ S, const float* __restrict__ Q, const float* __restrict__ P,
                                  int64_t J, int64_t batch, int V, int K, int64_t first) {
  scan_rows(S, Q, P, int64_t(blockIdx.x), batch, first, J, V, K, false, nullptr);
}

// The packed layout: entry s * HV + h is head h of segment s; sequence n owns segments seg_first[n] ..
// seg_first[n] + seg_count[n] - 1 (blockIdx.x = n * HV + h). Its segment 1 starts at its segment 0's offset
// (segment 0 ran from the sequence's start state), later ones from the scan; with `fin`, one step more writes the
// sequence's end state to fin[n] (Q of its only segment when it has one).
__global__ void __launch_bounds__(kScanCols* kParts)
    kda_segment_state_scan_packed_kernel(float* __restrict__ S, const float* __restrict__ Q,
                                         const float* __restrict__ P, const int64_t* __restrict__ seg_first,
                                         const int64_t* __restrict__ seg_count, float* __restrict__ fin, int HV, int V,
                                         int K) {
  const int64_t n = blockIdx.x / HV, h = blockIdx.x % HV;
  const int64_t count = seg_count[n];
  if (count < (fin != nullptr ? 1 : 2)) return;
  float* last = fin != nullptr ? fin + (n * HV + h) * int64_t(V) * K : nullptr;
  scan_rows(S, Q, P, seg_first[n] * HV + h, HV, 1, count + (fin != nullptr ? 1 : 0), V, K, true, last);
}

// The streamed path (the model at the top of the file).
constexpr int kStreamThreads = 128;
constexpr int kChunk = 16;                 // k-rows of P per ring slot: up to kChunk x 128 fp32 = 8 KB
constexpr int kRowStride = kScanCols + 4;  // the rows' stride in shared memory: the lanes' four rows in distinct banks
template <int RT>
constexpr int kStreamStages = RT >= 8   ? 3
                              : RT >= 4 ? 4
                                        : 5;  // ring slots: <= 48 KB static with the rows

// The ring's copies: 1-D bulk copies (the copy engine: one instruction per chunk) completing on an mbarrier
// per slot (sm_90 and later: the built archs).
__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\nfence.mbarrier_init.release.cluster;\n" ::"r"(smem_addr(bar))
               : "memory");
#endif
}
// Arrives on `bar` expecting `bytes`, then copies them from global `src` to shared `dst` (16-byte aligned, a
// multiple of 16 bytes), completing on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile(
      "mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n"
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%2], [%3], %1, [%0];\n" ::"r"(smem_addr(bar)),
      "r"(bytes), "r"(smem_addr(dst)), "l"(src)
      : "memory");
#else
  __trap();
#endif
}
// Waits for the completion of the phase of `bar` with this parity (the memory clobber keeps the reads of the
// slot after it).
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  do {
    asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                 : "=r"(done)
                 : "r"(smem_addr(bar)), "r"(parity)
                 : "memory");
  } while (!done);
#endif
}

// scan_rows (same arguments and semantics) for K % 4 == 0, K <= 128, 16-byte aligned tensors: 4 RT rows per block
// (r0 = blockIdx.y * 4 RT).
template <int RT>
__device__ __forceinline__ void scan_rows_streamed(float* __restrict__ S, const float* __restrict__ Q,
                                                   const float* __restrict__ P, int64_t base, int64_t stride,
                                                   int64_t first, int64_t J, int V, int K, bool zero_start,
                                                   float* __restrict__ last) {
  constexpr int kBlockRows = 4 * RT, kStages = kStreamStages<RT>;
  __shared__ __align__(128) float ring[kStages][kChunk * kScanCols];  // chunk rows k0 + kl at kl * K
  __shared__ __align__(16) float rows[kBlockRows][kRowStride];
  __shared__ uint64_t full[kStages];  // slot s holds its chunk: phase n completes its n-th fill
  if (J <= first) return;
  const int t = threadIdx.x, lane = t % 32;
  const int rl = lane / 8, c = (t / 32) * 32 + (lane % 8) * 4;  // rows rl + 4 i, columns c .. c + 3
  const bool col_ok = c < K;                                    // K % 4 == 0: all four columns or none
  const bool warp_on = (t / 32) * 32 < K;                       // a warp with no column < K only syncs
  const int r0 = blockIdx.y * kBlockRows;
  const int nr = V - r0 < kBlockRows ? V - r0 : kBlockRows;
  const int64_t state = int64_t(V) * K, map = int64_t(K) * K;
  const int nc = (K + kChunk - 1) / kChunk;         // chunks per step (the last one min(kChunk, K - k0) rows)
  const int64_t j0 = first + (zero_start ? 1 : 0);  // the first step that reads P (P[j0 - 1])

  // The chunk stream (thread 0 issues): chunk kc of the s-th matrix, P[j0 - 1 + s], goes to slot
  // (s * nc + kc) % kStages. Chunk g + kStages - 1 is issued when chunk g is about to be consumed (after the
  // barrier that frees slot (g - 1) % kStages), so kStages - 1 chunks are in flight ahead of the one in use.
  int64_t fill_left = J > j0 ? (J - j0) * nc : 0;
  const float* fill_mat = fill_left > 0 ? P + (base + (j0 - 1) * stride) * map : nullptr;
  int fill_kc = 0, fill_slot = 0;
  auto issue = [&]() {
    if (fill_left > 0) {
      const int k0 = fill_kc * kChunk, kr = K - k0 < kChunk ? K - k0 : kChunk;
      bulk_load(ring[fill_slot], fill_mat + int64_t(k0) * K, uint32_t(kr * K * 4), &full[fill_slot]);
      fill_slot = fill_slot + 1 == kStages ? 0 : fill_slot + 1;
      if (--fill_left > 0 && ++fill_kc == nc) fill_kc = 0, fill_mat += stride * map;
    }
  };
  if (t == 0) {
#pragma unroll
    for (int s = 0; s < kStages; ++s) mbar_init(&full[s]);
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) issue();
  }

  // Q of the step, prefetched one step ahead into registers
  float4 q[RT];
  auto load_q = [&](int64_t j) {
    const float* qj = Q + (base + (j - 1) * stride) * state + int64_t(r0) * K + c;
#pragma unroll
    for (int i = 0; i < RT; ++i)
      q[i] = col_ok && rl + 4 * i < nr ? __ldg(reinterpret_cast<const float4*>(qj + int64_t(rl + 4 * i) * K))
                                       : make_float4(0.f, 0.f, 0.f, 0.f);
  };
  load_q(first);

  // rows r0 .. r0 + nr of S[first - 1], zero elsewhere
  {
    const float* s_prev = zero_start ? nullptr : S + (base + (first - 1) * stride) * state + int64_t(r0) * K;
    for (int e = t; e < kBlockRows * kRowStride; e += kStreamThreads) {
      const int r = e / kRowStride, k = e % kRowStride;
      rows[r][k] = !zero_start && r < nr && k < K ? s_prev[int64_t(r) * K + k] : 0.f;
    }
  }

  int slot = 0;
  uint32_t parity = 0;
  for (int64_t j = first; j < J; ++j) {
    float acc[RT][4];
#pragma unroll
    for (int i = 0; i < RT; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.f;
    if (j >= j0) {
      for (int kc = 0; kc < nc; ++kc) {
        __syncthreads();  // the slot consumed last is free; the step's rows (and the barriers' init) visible
        if (t == 0) issue();
        if (warp_on) {
          mbar_wait(&full[slot], parity);
          const float* pc = ring[slot] + c;
          const float* rk = &rows[rl][kc * kChunk];
          // acc += rows[., k0 + kl] P[k0 + kl, c ..] for kl < kr, in k order (the last chunk: kr = K - k0 < kChunk)
          auto fma_rows = [&](auto full_chunk, int kr) {
#pragma unroll
            for (int k4 = 0; k4 < kChunk; k4 += 4) {
              if (decltype(full_chunk)::value || k4 < kr) {
                float4 a[RT];
#pragma unroll
                for (int i = 0; i < RT; ++i) a[i] = *reinterpret_cast<const float4*>(rk + 4 * i * kRowStride + k4);
#pragma unroll
                for (int kk = 0; kk < 4; ++kk) {
                  const float4 p = *reinterpret_cast<const float4*>(pc + (k4 + kk) * K);
#pragma unroll
                  for (int i = 0; i < RT; ++i) {
                    const float x = kk == 0 ? a[i].x : kk == 1 ? a[i].y : kk == 2 ? a[i].z : a[i].w;
                    acc[i][0] = fmaf(x, p.x, acc[i][0]);
                    acc[i][1] = fmaf(x, p.y, acc[i][1]);
                    acc[i][2] = fmaf(x, p.z, acc[i][2]);
                    acc[i][3] = fmaf(x, p.w, acc[i][3]);
                  }
                }
              }
            }
          };
          const int kr = K - kc * kChunk;
          if (kr >= kChunk)
            fma_rows(std::true_type(), kChunk);
          else
            fma_rows(std::false_type(), kr);
        }
        if (++slot == kStages) slot = 0, parity ^= 1;
      }
    }
    __syncthreads();  // every thread has read the previous rows
    float* sj = (last != nullptr && j == J - 1 ? last : S + (base + j * stride) * state) + int64_t(r0) * K + c;
#pragma unroll
    for (int i = 0; i < RT; ++i) {
      const int r = rl + 4 * i;
      if (col_ok && r < nr) {
        const float4 x = make_float4(acc[i][0] + q[i].x, acc[i][1] + q[i].y, acc[i][2] + q[i].z, acc[i][3] + q[i].w);
        *reinterpret_cast<float4*>(&rows[r][c]) = x;
        *reinterpret_cast<float4*>(sj + int64_t(r) * K) = x;
      }
    }
    if (j + 1 < J) load_q(j + 1);
  }
}

template <int RT>
__global__ void __launch_bounds__(kStreamThreads, 1)
    kda_segment_state_scan_streamed_kernel(float* __restrict__ S, const float* __restrict__ Q,
                                           const float* __restrict__ P, int64_t J, int64_t batch, int V, int K,
                                           int64_t first) {
  scan_rows_streamed<RT>(S, Q, P, int64_t(blockIdx.x), batch, first, J, V, K, false, nullptr);
}

template <int RT>
__global__ void __launch_bounds__(kStreamThreads, 1)
    kda_segment_state_scan_packed_streamed_kernel(float* __restrict__ S, const float* __restrict__ Q,
                                                  const float* __restrict__ P, const int64_t* __restrict__ seg_first,
                                                  const int64_t* __restrict__ seg_count, float* __restrict__ fin,
                                                  int HV, int V, int K) {
  const int64_t n = blockIdx.x / HV, h = blockIdx.x % HV;
  const int64_t count = seg_count[n];
  if (count < (fin != nullptr ? 1 : 2)) return;
  float* last = fin != nullptr ? fin + (n * HV + h) * int64_t(V) * K : nullptr;
  scan_rows_streamed<RT>(S, Q, P, seg_first[n] * HV + h, HV, 1, count + (fin != nullptr ? 1 : 0), V, K, true, last);
}

// The streamed path applies: K % 4 == 0 and every tensor 16-byte aligned (bulk copies, float4).
bool streamed_ok(int K, const void* a, const void* b, const void* c, const void* d) {
  const uintptr_t bits = reinterpret_cast<uintptr_t>(a) | reinterpret_cast<uintptr_t>(b) |
                         reinterpret_cast<uintptr_t>(c) | reinterpret_cast<uintptr_t>(d);
  return K % 4 == 0 && K <= kScanCols && bits % 16 == 0;
}

// Rows per thread (4 RT rows per block): the fewest that keep the grid within one block per SM (the shortest step
// then; docs/performance.md), else RT = 8: a quarter of RT = 2's blocks, each reading P once for 32 rows, and the
// most FFMA per shared load.
int streamed_rt(int64_t entries, int V) {
  int dev = 0, sms = 132;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess || sms <= 0)
    sms = 132;
  for (int rt = 2; rt < 8; rt *= 2)
    if (entries * ((V + 4 * rt - 1) / (4 * rt)) <= sms) return rt;
  return 8;
}

}  // namespace

cudaError_t launch_segment_state_scan(float* S, const float* Q, const float* P, int64_t J, int64_t batch, int V, int K,
                                      int64_t first, cudaStream_t stream) {
  if (first < 1) first = 1;
  if (J <= first || batch <= 0 || V <= 0 || K <= 0) return cudaSuccess;
  if (K > kScanCols || batch > 0x7fffffff) return cudaErrorInvalidValue;
  if (streamed_ok(K, S, Q, P, nullptr)) {
    const int rt = streamed_rt(batch, V);
    const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>((V + 4 * rt - 1) / (4 * rt)));
    if (rt == 8)
      kda_segment_state_scan_streamed_kernel<8><<<grid, kStreamThreads, 0, stream>>>(S, Q, P, J, batch, V, K, first);
    else if (rt == 4)
      kda_segment_state_scan_streamed_kernel<4><<<grid, kStreamThreads, 0, stream>>>(S, Q, P, J, batch, V, K, first);
    else
      kda_segment_state_scan_streamed_kernel<2><<<grid, kStreamThreads, 0, stream>>>(S, Q, P, J, batch, V, K, first);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>(batch), static_cast<unsigned>((V + kRows - 1) / kRows));
  kda_segment_state_scan_kernel<<<grid, kScanCols * kParts, 0, stream>>>(S, Q, P, J, batch, V, K, first);
  return cudaGetLastError();
}

cudaError_t launch_segment_state_scan_packed(float* S, const float* Q, const float* P, const int64_t* seg_first,
                                             const int64_t* seg_count, float* fin, int64_t N, int HV, int V, int K,
                                             cudaStream_t stream) {
  if (N <= 0 || HV <= 0 || V <= 0 || K <= 0) return cudaSuccess;
  if (K > kScanCols || N * HV > 0x7fffffff) return cudaErrorInvalidValue;
  if (streamed_ok(K, S, Q, P, fin)) {
    const int rt = streamed_rt(N * HV, V);
    const dim3 grid(static_cast<unsigned>(N * HV), static_cast<unsigned>((V + 4 * rt - 1) / (4 * rt)));
    if (rt == 8)
      kda_segment_state_scan_packed_streamed_kernel<8>
          <<<grid, kStreamThreads, 0, stream>>>(S, Q, P, seg_first, seg_count, fin, HV, V, K);
    else if (rt == 4)
      kda_segment_state_scan_packed_streamed_kernel<4>
          <<<grid, kStreamThreads, 0, stream>>>(S, Q, P, seg_first, seg_count, fin, HV, V, K);
    else
      kda_segment_state_scan_packed_streamed_kernel<2>
          <<<grid, kStreamThreads, 0, stream>>>(S, Q, P, seg_first, seg_count, fin, HV, V, K);
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>(N * HV), static_cast<unsigned>((V + kRows - 1) / kRows));
  kda_segment_state_scan_packed_kernel<<<grid, kScanCols * kParts, 0, stream>>>(S, Q, P, seg_first, seg_count, fin, HV,
                                                                                V, K);
  return cudaGetLastError();
}

}  // namespace kda
