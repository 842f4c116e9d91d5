// Host check of the shared-memory layout fact the planned 64-token wgmma backward sweep relies on
// (docs/design.md, "Where the sweep goes next"): one bf16 [v][k] buffer of a 128 x 128 state serves as both wgmma
// B operands, the K-major B of X = K⁺ S_0ᵀ and dR_S = Kr dS_Cᵀ (N = v, K = k) and the MN-major B of dQ⁺ = dO S_0
// and dKr = R dS_C (N = k, K = v), when the MN-major layout tiles its 128-byte swizzle atoms K-mode first. Prints
// the mismatches (0 expected) and the same count for the default (N-mode first) tiling, which does not match.
//   nvcc -std=c++17 --expt-relaxed-constexpr -I<cutlass include> scripts/sweep64_layout_check.cu -o /tmp/slc
//   /tmp/slc
#include <cstdio>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>

using namespace cute;
using bf16_t = cutlass::bfloat16_t;

int main() {
  // (N = v, K = k), K-major: 8 rows of v, 64 k-contiguous elements per 128-byte row, swizzled
  using LayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_128, _128>{}));
  // (N = k, K = v), MN-major, atoms tiled K-mode first (Step<_2, _1>) and by default (N-mode first)
  using LayoutMN = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16_t>{}, Shape<_128, _128>{}, Step<_2, _1>{}));
  using LayoutMNDefault = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16_t>{}, Shape<_128, _128>{}));
  int bad = 0, bad_default = 0;
  for (int v = 0; v < 128; ++v)
    for (int k = 0; k < 128; ++k) {
      const int a = LayoutK{}(v, k);
      if (a != LayoutMN{}(k, v)) ++bad;
      if (a != LayoutMNDefault{}(k, v)) ++bad_default;
    }
  std::printf("cosize %d / %d; K-major (v, k) vs MN-major (k, v), K-mode-first tiling: %d mismatches; default "
              "tiling: %d mismatches\n",
              int(cosize_v<LayoutK>), int(cosize_v<LayoutMN>), bad, bad_default);
  return bad != 0 || bad_default == 0;
}
