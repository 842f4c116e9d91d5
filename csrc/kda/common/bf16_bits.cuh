// bf16 <-> fp32 at the bit level, shared by the CUDA kernels: unpacking a 32-bit word of two bf16 values
// (a shift or a mask, no conversion instruction) and packing two fp32 values with round-to-nearest-even.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

namespace kda {

__device__ __forceinline__ float bf16_lo(uint32_t w) {
  return __uint_as_float(w << 16);
}
__device__ __forceinline__ float bf16_hi(uint32_t w) {
  return __uint_as_float(w & 0xffff0000u);
}
__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(uint32_t(b) << 16);
}
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);  // round to nearest even; .x is the low half
  return *reinterpret_cast<uint32_t*>(&h);
}

}  // namespace kda
