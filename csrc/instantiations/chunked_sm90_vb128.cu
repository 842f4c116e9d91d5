// The Hopper chunked prefill kernel (csrc/kda/chunked/sm90/chunked_sm90_kernel.cuh) and its host launch.
// Built for every CUDA arch of the extension; the kernel body exists only in the sm_90a image, and the host
// routes to it only on a compute capability 9.0 device.
#include <atomic>
#include <cuda.h>

#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "kda/chunked/sm90/chunked_sm90.h"
#include "kda/chunked/sm90/chunked_sm90_kernel.cuh"
#include "kda/common/device_info.h"

namespace kda {

int chunked_sm90_mode() {
  const char* e = std::getenv("KDA_CHUNKED_KERNEL");
  if (e == nullptr || e[0] == '\0' || std::strcmp(e, "auto") == 0) return 2;
  return std::strcmp(e, "sm90") == 0 ? 1 : 0;
}

bool chunked_sm90_supported(const RecurrentParams& p) {
  if (!current_device_is_sm90()) return false;
  if (p.K != chunked_sm90::kD || p.V != chunked_sm90::kD || p.token_dtype != DType::kBFloat16) return false;
  if (p.num_spec_tokens > 0 || p.checkpoint_every_n_tokens % chunked_sm90::kC != 0) return false;
  if (p.state_source != nullptr && p.state_source_dtype != DType::kFloat32 && p.state_source_dtype != DType::kBFloat16)
    return false;
  if (p.checkpoint_every_n_tokens > 0 && p.checkpoint_dtype != DType::kFloat32 && p.checkpoint_dtype != DType::kBFloat16)
    return false;
  if (p.state != nullptr && p.state_dtype != DType::kFloat32 && p.state_dtype != DType::kBFloat16) return false;
  if (p.T <= 0 || p.T >= (int64_t(1) << 31) || p.B >= (int64_t(1) << 31) || p.N * p.HV >= (int64_t(1) << 31))
    return false;
  // TMA: 16-byte aligned base, strides multiples of 16 bytes (8 bf16 elements)
  auto ok = [&](const TokenTensor& t) {
    return reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0 && t.token_stride % 8 == 0 && t.head_stride % 8 == 0 &&
           t.token_stride > 0 && t.head_stride > 0 && (p.B == 1 || (t.batch_stride % 8 == 0 && t.batch_stride > 0));
  };
  return ok(p.q) && ok(p.k) && ok(p.g) && ok(p.v);
}

namespace {
// KDA_SM90_VERBOSE=1: one stderr line per call (grid, shared memory, the encode results, the launch error).
bool verbose() {
  const char* e = std::getenv("KDA_SM90_VERBOSE");
  return e != nullptr && e[0] != '\0' && e[0] != '0';
}

// CuTe's make_tma_copy encodes the tensor map but only asserts on the driver's result (compiled out with
// NDEBUG). Encode the same geometry once more here (dims innermost first: channel, token, head, batch; box
// 128 x 16 x 1 x 1, no swizzle, no interleave) and return the driver's CUresult, so a rejected map becomes a
// launch error instead of a garbage descriptor.
CUresult check_token_map(const char* name, const RecurrentParams& p, const TokenTensor& t, int heads) {
  const int64_t bs = p.B == 1 ? t.token_stride * p.T : t.batch_stride;
  CUtensorMap map;
  const cuuint64_t dims[4] = {cuuint64_t(chunked_sm90::kD), cuuint64_t(p.T), cuuint64_t(heads), cuuint64_t(p.B)};
  const cuuint64_t strides[3] = {cuuint64_t(t.token_stride) * 2, cuuint64_t(t.head_stride) * 2, cuuint64_t(bs) * 2};
  const cuuint32_t box[4] = {cuuint32_t(chunked_sm90::kD), cuuint32_t(chunked_sm90::kC), 1, 1};
  const cuuint32_t estr[4] = {1, 1, 1, 1};
  const CUresult r = cutlass::call_cuTensorMapEncodeTiled(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, const_cast<void*>(t.ptr), dims, strides, box, estr,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_NONE, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS || verbose())
    std::fprintf(stderr,
                 "kda_chunked_sm90: tensor map %s: CUresult %d (ptr %p dims 128,%lld,%d,%lld strides(B) %lld,%lld,%lld)\n",
                 name, static_cast<int>(r), t.ptr, static_cast<long long>(p.T), heads, static_cast<long long>(p.B),
                 static_cast<long long>(t.token_stride * 2), static_cast<long long>(t.head_stride * 2),
                 static_cast<long long>(bs * 2));
  return r;
}

chunked_sm90::TmaToken token_tma(const RecurrentParams& p, const TokenTensor& t, int heads) {
  // A batch of one row: any stride that is a multiple of 16 bytes (the mode has extent 1).
  const int64_t bs = p.B == 1 ? t.token_stride * p.T : t.batch_stride;
  return chunked_sm90::make_token_tma(t.ptr, static_cast<int>(p.T), heads, static_cast<int>(p.B), t.token_stride,
                                      t.head_stride, bs);
}

// KDA_SM90_VARIANT=1|2|3 (read per call, default 3, the fastest measured): which design of the kernel
// (chunked_sm90_kernel.cuh, Cfg: 1 = a producer warpgroup and one prep warpgroup, 2 = two prep warpgroups
// loading their own chunks, 3 = three of them), so one process can time them. The backward chain has variants
// 1 and 2 (3, the default, runs it on 2).
// KDA_SM90_PROFILE=1: the profile instantiation, then a stream sync and the per-segment cycle table of CTA 0
// on stderr (a debugging aid: not for graph capture).
int sm90_variant() {
  const char* e = std::getenv("KDA_SM90_VARIANT");
  if (e == nullptr || e[0] == '\0' || e[1] != '\0') return 3;
  return e[0] == '1' ? 1 : (e[0] == '2' ? 2 : 3);
}
// KDA_SM90_SCHEDULE=0..15 (read per call, default 11 = 1 + 2 + 8): the schedule bits (KernelArgs::schedule: 1 = the
// prep warpgroups' serial role warps rotated per warpgroup, 2 = the inverse's 16-byte row loads, 4 = per-warp output
// staging in the chain, 8 = the inverse's last phase on all 32 lanes), so one process can time them; the same results
// bit for bit in every setting.
int sm90_schedule() {
  const char* e = std::getenv("KDA_SM90_SCHEDULE");
  char* end = nullptr;
  const long v = e != nullptr ? std::strtol(e, &end, 10) : -1;
  if (e != nullptr && end != e && *end == '\0' && v >= 0 && v <= 15) return static_cast<int>(v);
  return chunked_sm90::kRotateRoles | chunked_sm90::kVectorInverse | chunked_sm90::kSplitInverseRows;
}
// KDA_SM90_STATE_ONLY (read per call; default on; off: 0/false/off/no, any case, as KDA_DECODE_PDL): off, state-only
// calls run the instantiation with an output (products made, store skipped) instead of the state-only one, so
// one process can time both; the same bits.
bool sm90_state_only() {
  const char* e = std::getenv("KDA_SM90_STATE_ONLY");
  if (e == nullptr) return true;
  std::string v(e);
  for (char& c : v) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return !(v == "0" || v == "false" || v == "off" || v == "no");
}
bool sm90_profile() {
  const char* e = std::getenv("KDA_SM90_PROFILE");
  return e != nullptr && e[0] != '\0' && e[0] != '0';
}

using KernelFn = void (*)(const chunked_sm90::KernelArgs);
// One instantiation of the kernel with what its launch needs: threads, dynamic shared memory (+ 1024: the
// alignment of the 1024-byte swizzled tiles) and the sum of its warpgroups' setmaxnreg counts.
struct Design {
  KernelFn fn;
  int threads, smem, setmaxnreg_sum;
};
template <bool kProfile, int V, bool kBwd, bool kStateOnly = false>
Design design_of() {
  using namespace chunked_sm90;
  return {kda_chunked_sm90_kernel<kProfile, V, kBwd, kStateOnly>, Cfg<V>::kThreads,
          static_cast<int>(sizeof(SharedStorage<V>)) + 1024, setmaxnreg_sum<V>()};
}
// (the backward chain has variants 1 and 2, and no profile instantiation; state-only calls have their own
// instantiations of variant 3, the other variants run them as calls with an output whose store is skipped)
Design design_for(bool profile, int variant, bool bwd, bool state_only) {
  if (bwd) return variant == 1 ? design_of<false, 1, true>() : design_of<false, 2, true>();
  if (variant == 3 && state_only) return profile ? design_of<true, 3, false, true>() : design_of<false, 3, false, true>();
  if (variant == 1) return profile ? design_of<true, 1, false>() : design_of<false, 1, false>();
  if (variant == 3) return profile ? design_of<true, 3, false>() : design_of<false, 3, false>();
  return profile ? design_of<true, 2, false>() : design_of<false, 2, false>();
}

void print_profile(int variant) {
  using namespace chunked_sm90;
  unsigned long long h[kProfRoles][kProfSegs + 1] = {};
  if (cudaMemcpyFromSymbol(h, kda_sm90_prof, sizeof(h)) != cudaSuccess) {
    std::fprintf(stderr, "kda_chunked_sm90 profile: read failed\n");
    return;
  }
  static const char* const roles1[kProfRoles] = {"producer", "prep (warp 0)", "chain WG2", "chain WG3"};
  static const char* const roles2[kProfRoles] = {"prep WG0 (L warp)", "prep WG1 (L warp)", "chain WG A", "chain WG B"};
  // (variants 2, 3 profile lane 0 of each prep WG's L/inverse warp, warp w of WG w under the role rotation, warp
  // 0 without it; the TMA issue of its leader warp is not on that warp)
  const char* const* roles = variant == 1 ? roles1 : roles2;
  static const char* const segs[kProfRoles][kProfSegs] = {
      {"acq raw", "TMA qkg", "acq v", "TMA v", "-", "-", "-", "-"},
      {"acq op", "wait raw", "named bar", "gate+norm", "operands", "L+Mqk", "inverse", "commit+loop"},
      {"wait op", "wait v", "X(+Oi)", "v+Y", "U+gamma", "S+O", "out", "loop+ckpt"},
      {"wait op", "wait v", "X(+Oi)", "v+Y", "U+gamma", "S+O", "out", "loop+ckpt"}};
  std::fprintf(stderr, "kda_chunked_sm90 profile, variant %d, CTA 0: clock cycles per chunk per segment (lane 0 of each role's warp)\n",
               variant);
  for (int r = 0; r < kProfRoles; ++r) {
    const unsigned long long nc = h[r][kProfSegs] > 0 ? h[r][kProfSegs] : 1;
    unsigned long long tot = 0;
    for (int s = 0; s < kProfSegs; ++s) tot += h[r][s];
    std::fprintf(stderr, "  %-14s chunks %llu total/chunk %7.0f |", roles[r], h[r][kProfSegs], double(tot) / nc);
    const char* const* sg = (variant >= 2 && r == 0) ? segs[1] : segs[r];  // (variants 2, 3: two prep rows)
    for (int s = 0; s < kProfSegs; ++s)
      if (sg[s][0] != '-') std::fprintf(stderr, " %s %.0f", sg[s], double(h[r][s]) / nc);
    std::fprintf(stderr, "\n");
  }
}
}  // namespace

cudaError_t launch_chunked_sm90(const RecurrentParams& p, cudaStream_t stream, bool backward_chain) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  using namespace chunked_sm90;
  if (check_token_map("q", p, p.q, p.H) != CUDA_SUCCESS ||
      check_token_map("k", p, p.k, p.H) != CUDA_SUCCESS ||
      check_token_map("g", p, p.g, p.HV) != CUDA_SUCCESS ||
      check_token_map("v", p, p.v, p.HV) != CUDA_SUCCESS)
    return cudaErrorInvalidValue;
  const KernelArgs args{p, token_tma(p, p.q, p.H), token_tma(p, p.k, p.H), token_tma(p, p.g, p.HV),
                        token_tma(p, p.v, p.HV), sm90_schedule()};
  const bool profile = sm90_profile() && !backward_chain;  // (no profile instantiation of the backward chain)
  int variant = sm90_variant();
  if (backward_chain && variant == 3) variant = 2;  // (the backward chain has variants 1 and 2)
  const bool state_only = p.out == nullptr && !backward_chain && variant == 3 && sm90_state_only();
  const Design dz = design_for(profile, variant, backward_chain, state_only);
  const KernelFn fn = dz.fn;
  const int smem = dz.smem, threads = dz.threads;
  const int which = state_only ? 9 + (profile ? 1 : 0) : (backward_chain ? 6 : (profile ? 3 : 0)) + variant - 1;
  // Set once per (device, instantiation). Concurrent first calls may both set it: the attribute call is
  // idempotent, and the atomic flag keeps the check itself free of a data race.
  static std::atomic<bool> attr_set[64][11] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!attr_set[dev][which].load(std::memory_order_acquire)) {
    // setmaxnreg only moves registers within the CTA's launch allocation (ptxas's count x threads): if the
    // warpgroups' counts exceed it, the chain's increase would wait forever, so refuse the launch instead
    cudaFuncAttributes fa{};
    const cudaError_t ea = cudaFuncGetAttributes(&fa, fn);
    if (ea != cudaSuccess) return ea;
    if (fa.numRegs * (threads / 128) < dz.setmaxnreg_sum) {
      std::fprintf(stderr, "kda_chunked_sm90: variant %d was compiled with %d registers per thread, fewer than its "
                           "setmaxnreg counts need (%d per thread over %d warpgroups): not launched\n",
                   variant, fa.numRegs, dz.setmaxnreg_sum, threads / 128);
      return cudaErrorLaunchOutOfResources;
    }
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    attr_set[dev][which].store(true, std::memory_order_release);
  }
  const int64_t blocks = p.N * p.HV;
  fn<<<dim3(static_cast<unsigned>(blocks)), threads, smem, stream>>>(args);
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess || verbose())
    std::fprintf(stderr, "kda_chunked_sm90: launch grid %lld x %d threads, %d B smem, N %lld HV %d T %lld B %lld%s variant %d schedule %d%s%s: %s\n",
                 static_cast<long long>(blocks), threads, smem, static_cast<long long>(p.N), static_cast<int>(p.HV),
                 static_cast<long long>(p.T), static_cast<long long>(p.B), p.seq_order != nullptr ? " seq_order" : "",
                 variant, args.schedule, state_only ? " state-only" : "", profile ? " profile" : "", cudaGetErrorString(e));
  if (e == cudaSuccess && profile) {
    const cudaError_t se = cudaStreamSynchronize(stream);
    if (se != cudaSuccess) return se;
    print_profile(variant);
  }
  return e;
}

}  // namespace kda
