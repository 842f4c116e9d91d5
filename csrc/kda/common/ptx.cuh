// Device primitives of the tensor-core kernels, once: warp-level mma.sync / ldmatrix, cp.async and named
// barriers, through CuTe's SM80/SM75 atoms where CuTe has one (so they run on every built arch: sm_90a and
// the Blackwell targets) and inline PTX where it has none (bar.sync / bar.arrive / bar.red, prefetch).
// Namespace kda::ptx, so a kernel family's own helpers of the same name never collide.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cute/arch/copy_sm75.hpp>
#include <cute/arch/copy_sm80.hpp>
#include <cute/arch/mma_sm80.hpp>

namespace kda::ptx {

// ldmatrix .x4 of 16-bit elements (four 8x8 matrices), plain and transposed; `smem` is this lane's row address.
__device__ __forceinline__ void ldsm_x4(const void* smem, uint32_t (&r)[4]) {
  cute::SM75_U32x4_LDSM_N::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}
__device__ __forceinline__ void ldsm_x4_t(const void* smem, uint32_t (&r)[4]) {
  cute::SM75_U16x8_LDSM_T::copy(*reinterpret_cast<const cute::uint128_t*>(smem), r[0], r[1], r[2], r[3]);
}

// d += a b, mma.sync m16n8k16 with fp32 accumulators: bf16 or fp16 operands.
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32BF16BF16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2],
                                            d[3]);
}
__device__ __forceinline__ void mma_f16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x16_F32F16F16F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2],
                                          d[3]);
}

// cp.async of 16 bytes, global -> shared, L2 only; pred = false writes 16 zero bytes instead (zero-fill).
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool pred) {
  using Copy = cute::SM80_CP_ASYNC_CACHEGLOBAL_ZFILL<cute::uint128_t>;
  Copy::copy(*reinterpret_cast<const cute::uint128_t*>(gmem), *reinterpret_cast<cute::uint128_t*>(smem), pred);
}
// Closes this thread's current group of cp.async copies.
__device__ __forceinline__ void cp_async_commit() {
  cute::cp_async_fence();
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  cute::cp_async_wait<N>();
}

// Named barriers (id 1..15; 0 is __syncthreads) over `count` threads, a multiple of 32: sync waits for all,
// arrive signals without waiting (the producer side of a producer/consumer pair).
__device__ __forceinline__ void named_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// bar.red.or over `count` threads: true when any participant passed a non-zero flag.
__device__ __forceinline__ bool named_sync_or(int id, int count, int flag) {
  uint32_t r;
  asm volatile("{\n .reg .pred p;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred p, %2, %3, p;\n selp.u32 %0, 1, 0, p;\n}\n"
               : "=r"(r)
               : "r"(flag), "r"(id), "r"(count)
               : "memory");
  return r != 0;
}

// Hint: bring the 128-byte line at `ptr` into L2.
__device__ __forceinline__ void prefetch_l2(const void* ptr) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr));
}

}  // namespace kda::ptx
