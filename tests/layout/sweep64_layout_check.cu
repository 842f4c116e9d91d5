// Host check of the layout facts of the Hopper 64-token backward sweep (csrc/kda/backward/sm90/sweep64_sm90.cu):
// the fragment layouts it indexes by hand (the m64n64 accumulator, the register A operand of K = 128 and K = 64, which
// index their elements alike, so an accumulator is the next product's A operand; the A operand's element pairs are
// consecutive k of one row), a 64 x 64 bf16 tile read K-major
// or MN-major (its transpose) and a [64][128] tile's 64-column half read MN-major; and one bf16 [v][k] buffer of a
// 128 x 128 state serving as both wgmma B operands, the K-major B of X = K⁺ S_0ᵀ (N = v, K = k) and the MN-major B of
// dQ⁺ = dO S_0 (N = k, K = v), when the MN-major layout tiles its 128-byte swizzle atoms K-mode first. Prints the
// mismatches (0 expected) and the same count for the default (N-mode first) tiling, which does not match; and that
// the [64][128] token tile's offsets 8 rows apart differ by 512 elements and its 8-column pieces are 16 contiguous bytes;
// and recast<uint32_t> of a bf16 A fragment pairs its elements (2 w, 2 w + 1) in word w (counted with the fragments);
// and the dA / dMqk scatter's offsets (counted with the fragment layouts).
//   nvcc -std=c++17 --expt-relaxed-constexpr -I<cutlass include> tests/layout/sweep64_layout_check.cu -o /tmp/slc
//   /tmp/slc
#include <cstdio>

#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>
#include <cute/atom/mma_atom.hpp>
#include <cute/tensor.hpp>
#include <cutlass/bfloat16.h>

using namespace cute;
using bf16_t = cutlass::bfloat16_t;

// The fragment layout claims of the file comment; returns the mismatches.
int fragment_mismatches() {
  int bad = 0;
  using MmaRS = SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
  using MmaSS = SM90::GMMA::MMA_64x64x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
  auto rs = make_tiled_mma(MmaRS{});
  auto ss = make_tiled_mma(MmaSS{});
  for (int t = 0; t < 128; ++t) {
    const int w = t / 32, g = (t % 32) / 4, q = t % 4;
    Tensor c = rs.get_slice(t).partition_C(make_identity_tensor(Shape<_64, _64>{}));
    Tensor c2 = ss.get_slice(t).partition_C(make_identity_tensor(Shape<_64, _64>{}));
    if (int(size(c)) != 32) ++bad;
    for (int i = 0; i < 32; ++i) {
      const int e = i & 1, h = (i >> 1) & 1, j = i >> 2;
      if (int(get<0>(c(i))) != 16 * w + g + 8 * h || int(get<1>(c(i))) != 8 * j + 2 * q + e) ++bad;
      if (get<0>(c(i)) != get<0>(c2(i)) || get<1>(c(i)) != get<1>(c2(i))) ++bad;
    }
    Tensor a = rs.get_slice(t).partition_A(make_identity_tensor(Shape<_64, _128>{}));
    if (int(size(a)) != 64) ++bad;
    for (int i = 0; i < int(size(a)); ++i) {
      const int m = get<0>(a(i)), k = get<1>(a(i)) % 16;
      if (m != 16 * w + g + 8 * ((m >> 3) & 1)) ++bad;
      if ((k & 7) / 2 != q) ++bad;
      // elements 2j and 2j + 1 are one row's consecutive (even, odd) k: the sweep loads them as one float2
      if (i % 2 == 1 && (get<0>(a(i)) != get<0>(a(i - 1)) || get<1>(a(i)) != get<1>(a(i - 1)) + 1 ||
                         get<1>(a(i - 1)) % 2 != 0))
        ++bad;
    }
  }
  // the K = 64 register A fragment indexes its (row, k) elements as the m64n64 accumulator does its (row, column):
  // an accumulator is the A operand of the next product element by element (R = INV Y, dY = INVᵀ dR)
  for (int t = 0; t < 128; ++t) {
    Tensor c = rs.get_slice(t).partition_C(make_identity_tensor(Shape<_64, _64>{}));
    Tensor a = rs.get_slice(t).partition_A(make_identity_tensor(Shape<_64, _64>{}));
    if (int(size(a)) != 32) ++bad;
    for (int i = 0; i < 32; ++i)
      if (get<0>(a(i)) != get<0>(c(i)) || get<1>(a(i)) != get<1>(c(i))) ++bad;
  }
  // a 64 x 64 [row][column] tile (Mqk, INV) read MN-major is its transpose; the MN-major view of a [64][128] tile's
  // 64-column half (dOᵀ of a warpgroup's value rows) is that half's rows
  using LayoutSq = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_64, _64>{}));
  using LayoutSqT = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<bf16_t>{}, Shape<_64, _64>{}));
  using LayoutTile0 = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_64, _128>{}));
  for (int r = 0; r < 64; ++r)
    for (int m = 0; m < 64; ++m) {
      if (int(LayoutSq{}(r, m)) != int(LayoutSqT{}(m, r))) ++bad;
      for (int w = 0; w < 2; ++w)
        if (int(LayoutTile0{}(r, 64 * w + m)) != 64 * 64 * w + int(LayoutSqT{}(m, r))) ++bad;
    }
  // the 32-token halves of a [64][128] operand tile (dA, dMqk: each warpgroup's B operand) are the tile's rows
  using LayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_64, _128>{}));
  alignas(1024) static bf16_t buf[64 * 128];
  Tensor full = make_tensor(make_smem_ptr(buf), LayoutTile{});
  for (int w = 0; w < 2; ++w) {
    Tensor half = local_tile(full, Shape<_32, _128>{}, make_coord(w, _0{}));
    for (int t = 0; t < 32; ++t)
      for (int v = 0; v < 128; ++v)
        if (&half(t, v) != &full(32 * w + t, v)) ++bad;
  }
  return bad;
}

// The packed hi / lo splits write a bf16 register fragment two elements at a time through recast<uint32_t>: word w
// must be elements 2 w (low half) and 2 w + 1 (high half) of the fragment's own storage.
int recast_mismatches() {
  int bad = 0;
  using MmaRS = SM90::GMMA::MMA_64x64x16_F32BF16BF16_RS<GMMA::Major::K, GMMA::Major::K>;
  auto rs = make_tiled_mma(MmaRS{});
  Tensor a = make_tensor<bf16_t>(partition_shape_A(rs, Shape<_64, _128>{}));
  for (int i = 0; i < int(size(a)); ++i) a(i) = bf16_t(float(i + 1));
  Tensor w = recast<uint32_t>(a);
  if (int(size(w)) * 2 != int(size(a))) ++bad;
  for (int j = 0; j < int(size(w)); ++j) {
    const uint32_t u = w(j);
    bf16_t lo, hi;
    lo.storage = uint16_t(u & 0xffffu);
    hi.storage = uint16_t(u >> 16);
    if (float(lo) != float(2 * j + 1) || float(hi) != float(2 * j + 2)) ++bad;
  }
  w(0) = 0u;  // a view: writing the word writes the fragment
  if (float(a(0)) != 0.f || float(a(1)) != 0.f) ++bad;
  return bad;
}

// The dA / dMqk scatter of the sweep: the m64n32 SS accumulator (row t', column t - 32 wg) indexes its elements as the
// m64n64 one does, and the offsets it forms from one base per 16-token block pair equal tri(t, t') of the packed
// lower-block-triangular matrices, stored where t's block >= t''s, with the same diagonal conditions.
int scatter_mismatches() {
  int bad = 0;
  using MmaSS32 = SM90::GMMA::MMA_64x32x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::K>;
  auto ss = make_tiled_mma(MmaSS32{});
  const auto tri_block = [](int I, int J) { return I * (I + 1) / 2 + J; };
  const auto tri = [&](int i, int j) { return (tri_block(i >> 4, j >> 4) << 8) + ((i & 15) << 4) + (j & 15); };
  for (int wg = 0; wg < 2; ++wg)
    for (int t128 = 0; t128 < 128; ++t128) {
      const int wq = t128 / 32, lane = t128 % 32, g = lane >> 2, q = lane & 3;
      Tensor c = ss.get_slice(t128).partition_C(make_identity_tensor(Shape<_64, _32>{}));
      if (int(size(c)) != 16) ++bad;
      for (int jb = 0; jb < 2; ++jb)
        for (int jj = 0; jj < 2; ++jj)
          for (int h = 0; h < 2; ++h)
            for (int e = 0; e < 2; ++e) {
              const int i = 4 * (2 * jb + jj) + 2 * h + e;
              const int tp = get<0>(c(i)), t = 32 * wg + get<1>(c(i));
              const int I = 2 * wg + jb, tl = 8 * jj + 2 * q + e, tpl = g + 8 * h;
              const bool stored_old = (tp >> 4) <= (t >> 4), stored_new = wq <= I, diag = wq == I;
              if (stored_old != stored_new) ++bad;
              if (!stored_new) continue;
              const int o = (tri_block(I, wq) << 8) + 32 * q + g + 128 * jj + 16 * e + 8 * h;
              if (o != tri(t, tp)) ++bad;
              if ((t > tp) != (!diag || tl > tpl) || (t >= tp) != (!diag || tl >= tpl)) ++bad;
            }
    }
  return bad;
}

int main() {
  const int frag = fragment_mismatches() + recast_mismatches() + scatter_mismatches();
  std::printf("fragment layouts: %d mismatches\n", frag);
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
  // the [64][128] token tile (LayoutTile of the sweep) at a 1024-byte aligned address, offsets through the pointer
  // (the swizzle acts on byte addresses, as the sweep's swz_offset): 8 rows further is 512 elements further, for
  // every column (the 128-byte swizzle repeats every 8 rows), so a thread's accumulator elements i and i + 4 (8 tokens
  // apart) are one offset plus 512
  int bad_rows = 0;
  {
    using LayoutTile = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<bf16_t>{}, Shape<_64, _128>{}));
    alignas(1024) static bf16_t tile[64 * 128];
    Tensor full = make_tensor(make_smem_ptr(tile), LayoutTile{});
    for (int t = 0; t + 8 < 64; ++t)
      for (int v = 0; v < 128; ++v)
        if (&full(t + 8, v) - &full(t, v) != 512) ++bad_rows;
    // and 8 columns from a multiple of 8 are one 16-byte piece (stmatrix's rows, dv's reads)
    for (int t = 0; t < 64; ++t)
      for (int v = 0; v < 128; ++v)
        if (&full(t, v) - &full(t, v & ~7) != (v & 7) || (&full(t, v & ~7) - &full(0, 0)) % 8 != 0) ++bad_rows;
  }
  std::printf("token tile: offset(t + 8, v) - offset(t, v) != 512 or a 16-byte piece not contiguous: %d cases\n",
              bad_rows);
  return frag != 0 || bad != 0 || bad_default == 0 || bad_rows != 0;
}
