// Host check of the shared-memory layout facts the Hopper chunked kernel relies on (variant 1):
//  * swz_offset (the swizzle applied to element offsets) equals the element distance CuTe's swizzled smem
//    pointer gives, for a 1024-byte aligned base, in every operand layout (LayoutKd, LayoutKr, LayoutT16);
//  * in LayoutKd (K-major SW128, bf16) and LayoutKr (MN-major SW128, fp16) the 8 channels d0..d0+7 (d0 a
//    multiple of 8) of one token are 8 consecutive elements starting at a multiple of 8 (16-byte stores).
//   nvcc -std=c++17 --expt-relaxed-constexpr -Icsrc -I<cutlass include> tests/layout/sm90_layout_check.cu -o /tmp/lc && /tmp/lc
#include <cstdio>

#include "kda/chunked/sm90/chunked_sm90_kernel.cuh"

using namespace kda::chunked_sm90;
using kda::swz_offset;

template <class T, class L>
int check_offsets(const char* name, L layout, int m0, int m1) {
  alignas(1024) static T buf[cute::cosize_v<L> + 1024];
  auto t = make_tensor(make_smem_ptr(buf), layout);
  int bad = 0;
  for (int s = 0; s < kOpStages; ++s)
    for (int a = 0; a < m0; ++a)
      for (int b = 0; b < m1; ++b) {
        const long ptr = static_cast<long>(&t(a, b, s) - buf);
        if (ptr != swz_offset(layout, a, b, s)) ++bad;
      }
  std::printf("%-10s cosize %6d: %d offset mismatches\n", name, int(cute::cosize_v<L>), bad);
  return bad;
}

int main() {
  int bad = 0;
  bad += check_offsets<bf16_t>("LayoutKd", LayoutKd{}, kC, kD);
  bad += check_offsets<f16_t>("LayoutKr", LayoutKr{}, kD, kC);
  bad += check_offsets<f16_t>("LayoutT16", LayoutT16{}, kC, kC);
  int nc = 0;
  for (int s = 0; s < kOpStages; ++s)
    for (int i = 0; i < kC; ++i)
      for (int d0 = 0; d0 < kD; d0 += 8) {
        const int a = swz_offset(LayoutKd{}, i, d0, s), b = swz_offset(LayoutKr{}, d0, i, s);
        if (a % 8 != 0 || b % 8 != 0) ++nc;
        for (int e = 0; e < 8; ++e) {
          if (swz_offset(LayoutKd{}, i, d0 + e, s) != a + e) ++nc;
          if (swz_offset(LayoutKr{}, d0 + e, i, s) != b + e) ++nc;
        }
      }
  std::printf("16-byte contiguity/alignment of 8 channels: %d violations\n", nc);
  bad += nc;
  std::printf("%s\n", bad ? "layout check: FAIL" : "layout check: OK");
  return bad ? 1 : 0;
}
