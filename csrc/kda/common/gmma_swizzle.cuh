// Element offsets in CuTe's swizzled GMMA shared-memory layouts (16-bit elements), for threads that write or read
// wgmma operand tiles element by element. Shared by the Hopper chunked kernel (csrc/kda/chunked/sm90) and the
// Hopper backward sweep (csrc/kda/backward/sm90).
#pragma once
#include <cute/tensor.hpp>

namespace kda {

// Element offset of a coordinate in a swizzled layout, computed on offsets instead of through a swizzled smem
// pointer (CuTe applies the swizzle to the address bits after an integer cast, which turns the access into a
// generic 64-bit one); equal to the pointer form when the tile is 1024-byte aligned (tests/layout/sm90_layout_check.cu
// checks both facts on the host). The GMMA atoms' swizzle (Sw<3,4,3> for the 128-byte one) acts on byte offsets.
template <class L, class... Is>
CUTE_HOST_DEVICE int swz_offset(L, Is... is) {
  constexpr int kBytes = 2;  // every swizzled tile here holds 16-bit elements
  const int bytes = static_cast<int>(cute::get_nonswizzle_portion(L{})(is...)) * kBytes;
  return static_cast<int>(cute::get_swizzle_portion(L{})(bytes)) / kBytes;
}

}  // namespace kda
