// tf32 tensor-core helpers of the CUDA training backward sweeps (sweep.cu and the Hopper 64-token sweep,
// sm90/sweep64_sm90.cu): operand rounding, the m16n8k8 product and a 16x8 output fragment over accessor operands.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <cute/arch/mma_sm80.hpp>

namespace kda {
namespace bwd {

// Tensor-core products: mma.sync m16n8k8 with tf32 operands (rounded to nearest) and fp32 accumulation,
// through CuTe's SM80 atom. Fragment layout (PTX ISA, m16n8k8 .tf32), g = lane / 4, q = lane % 4:
//   A (16x8, row): a0 (g, q), a1 (g+8, q), a2 (g, q+4), a3 (g+8, q+4); B (8x8, col): b0 (q, g), b1 (q+4, g);
//   C (16x8): c0 (g, 2q), c1 (g, 2q+1), c2 (g+8, 2q), c3 (g+8, 2q+1).
// tf32 operand bits: x rounded at the 13th bit by one integer add (the tensor core ignores the low 13 bits),
// as CUTLASS's round_half_ulp_truncate; cheaper than cvt.rna.tf32.f32 (inf inputs become NaN).
__device__ __forceinline__ uint32_t tf32(float x) {
  return __float_as_uint(x) + 0x1000u;
}
// The same value with the low bits cleared: an exact fp32 number, so x - tf32_hi(x) is the exact remainder.
__device__ __forceinline__ uint32_t tf32_hi(float x) {
  return (__float_as_uint(x) + 0x1000u) & 0xffffe000u;
}
__device__ __forceinline__ void mma_tf32(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  cute::SM80_16x8x8_F32TF32TF32F32_TN::fma(d[0], d[1], d[2], d[3], a[0], a[1], a[2], a[3], b0, b1, d[0], d[1], d[2],
                                           d[3]);
}

// d += Σ_k A(m, k) B(k, n0 + n) over k < KD, m < 16, n < 8: one 16x8 output fragment, operands from accessors.
// Plain tf32 (2^-11 relative per operand) for the products with the state; PRECISE = 3xTF32 (each operand
// split into tf32 high and low parts, a_hi b_hi + a_hi b_lo + a_lo b_hi: ~fp32) for the pair matrices and
// pair terms, whose sums feed dΓ = a difference of larger terms (the gate gradients need the digits).
// Two accumulators (even and odd k-steps) halve the dependent mma chain.
template <int KD, bool PRECISE = false, typename FA, typename FB>
__device__ __forceinline__ void mma_frag(float (&d)[4], int n0, FA fa, FB fb) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  float e[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int k0 = 0; k0 < KD; k0 += 8) {
    float(&acc)[4] = (k0 & 8) ? e : d;
    const float af[4] = {fa(g, k0 + q), fa(g + 8, k0 + q), fa(g, k0 + q + 4), fa(g + 8, k0 + q + 4)};
    const float bf[2] = {fb(k0 + q, n0 + g), fb(k0 + q + 4, n0 + g)};
    const uint32_t a[4] = {PRECISE ? tf32_hi(af[0]) : tf32(af[0]), PRECISE ? tf32_hi(af[1]) : tf32(af[1]),
                           PRECISE ? tf32_hi(af[2]) : tf32(af[2]), PRECISE ? tf32_hi(af[3]) : tf32(af[3])};
    const uint32_t b0 = PRECISE ? tf32_hi(bf[0]) : tf32(bf[0]), b1 = PRECISE ? tf32_hi(bf[1]) : tf32(bf[1]);
    if constexpr (PRECISE) {
      const uint32_t al[4] = {tf32(af[0] - __uint_as_float(a[0])), tf32(af[1] - __uint_as_float(a[1])),
                              tf32(af[2] - __uint_as_float(a[2])), tf32(af[3] - __uint_as_float(a[3]))};
      mma_tf32(acc, al, b0, b1);
      mma_tf32(acc, a, tf32(bf[0] - __uint_as_float(b0)), tf32(bf[1] - __uint_as_float(b1)));
    }
    mma_tf32(acc, a, b0, b1);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) d[i] += e[i];
}

// Visits the four elements of a 16x8 fragment: f(row, col, value).
template <typename F>
__device__ __forceinline__ void frag_each(const float (&d)[4], int n0, F f) {
  const int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
  f(g, n0 + 2 * q, d[0]);
  f(g, n0 + 2 * q + 1, d[1]);
  f(g + 8, n0 + 2 * q, d[2]);
  f(g + 8, n0 + 2 * q + 1, d[3]);
}

}  // namespace bwd
}  // namespace kda
