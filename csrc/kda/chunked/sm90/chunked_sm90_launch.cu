// The Hopper chunked prefill kernel (csrc/kda/chunked/sm90/chunked_sm90_kernel.cuh): its instantiations and the
// launch of the route the spine chose (kda/route/route.h). Built for every CUDA arch of the extension; the kernel
// body exists only in the sm_90a image, and the spine routes to it only on a compute capability 9.0 device.
// The default build instantiates what a route can choose: design 3 (with and without outputs) for the forward,
// design 2 for the backward chain. Designs 1, 2, 4 (the folded WY operands, with and without outputs) and 5-8 (the
// CTA pair) of the forward, designs 1 and 5 of the chain and the profile instantiations (per-role cycle tables) are
// experiments (KDA_BUILD_EXPERIMENTS=1, KDA_EXPERIMENT=sm90_*).
#include <atomic>
#include <cuda.h>

#include <cstdint>

#include <cstdio>

#include "kda/chunked/sm90/chunked_sm90.h"
#include "kda/chunked/sm90/chunked_sm90_kernel.cuh"
#include "kda/common/device_info.h"
#include "kda/route/knobs.h"

namespace kda {

bool chunked_sm90_supported(const RecurrentParams& p) {
  if (!current_device_is_sm90()) return false;
  if (p.K != chunked_sm90::kD || p.V != chunked_sm90::kD || p.token_dtype != DType::kBFloat16) return false;
  if (p.num_spec_tokens > 0 || p.checkpoint_every_n_tokens % chunked_sm90::kC != 0) return false;
  if (p.state_source != nullptr && p.state_source_dtype != DType::kFloat32 && p.state_source_dtype != DType::kBFloat16)
    return false;
  if (p.checkpoint_every_n_tokens > 0 && p.checkpoint_dtype != DType::kFloat32 &&
      p.checkpoint_dtype != DType::kBFloat16)
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
// CuTe's make_tma_copy encodes the tensor map but only asserts on the driver's result (compiled out with
// NDEBUG). The driver rejects a map only for the documented limits of cuTensorMapEncodeTiled; they are checked
// here on the host (dims innermost first: channel, token, head, batch; box 128 x 16 x 1 x 1), so a map the driver
// would reject becomes a launch error instead of a garbage descriptor, and each map is encoded once per call.
bool token_map_valid(const char* name, const RecurrentParams& p, const TokenTensor& t, int heads) {
  const int64_t bs = p.B == 1 ? t.token_stride * p.T : t.batch_stride;
  const int64_t dims[4] = {chunked_sm90::kD, p.T, heads, p.B};
  const int64_t strides_bytes[3] = {t.token_stride * 2, t.head_stride * 2, bs * 2};
  bool ok = reinterpret_cast<uintptr_t>(t.ptr) % 16 == 0;
  for (int64_t d : dims) ok = ok && d >= 1 && d <= (int64_t(1) << 32);
  for (int64_t s : strides_bytes) ok = ok && s > 0 && s % 16 == 0 && s < (int64_t(1) << 40);
  if (!ok)
    std::fprintf(stderr,
                 "kda_chunked_sm90: tensor map %s out of the TMA limits (ptr %p dims 128,%lld,%d,%lld strides(B) "
                 "%lld,%lld,%lld)\n",
                 name, t.ptr, static_cast<long long>(p.T), heads, static_cast<long long>(p.B),
                 static_cast<long long>(strides_bytes[0]), static_cast<long long>(strides_bytes[1]),
                 static_cast<long long>(strides_bytes[2]));
  return ok;
}

chunked_sm90::TmaToken token_tma(const RecurrentParams& p, const TokenTensor& t, int heads) {
  // A batch of one row: any stride that is a multiple of 16 bytes (the mode has extent 1).
  const int64_t bs = p.B == 1 ? t.token_stride * p.T : t.batch_stride;
  return chunked_sm90::make_token_tma(t.ptr, static_cast<int>(p.T), heads, static_cast<int>(p.B), t.token_stride,
                                      t.head_stride, bs);
}

// The schedule bits (KernelArgs::schedule: 1 = the prep warpgroups' serial role warps rotated per warpgroup, 2 = the
// inverse's 16-byte row loads, 4 = per-warp output staging in the chain, 8 = the inverse's last phase on all 32
// lanes): the same results bit for bit in every setting; 11 measured fastest. Experiments may set others.
int sm90_schedule() {
  const int s = launch_knobs().exp.sm90_schedule;
  return s >= 0 ? s : (chunked_sm90::kRotateRoles | chunked_sm90::kVectorInverse | chunked_sm90::kSplitInverseRows);
}

using KernelFn = void (*)(const chunked_sm90::KernelArgs);
// One instantiation of the kernel with what its launch needs: threads, dynamic shared memory (+ 1024: the
// alignment of the 1024-byte swizzled tiles) and the sum of its warpgroups' setmaxnreg counts.
struct Design {
  KernelFn fn;
  int threads, smem, setmaxnreg_sum, cluster;  // (cluster: CTAs per task, 1 or designs 5-8's 2)
};
template <bool kProfile, int V, bool kBwd, bool kStateOnly = false>
Design design_of() {
  using namespace chunked_sm90;
  return {kda_chunked_sm90_kernel<kProfile, V, kBwd, kStateOnly>, Cfg<V>::kThreads,
          static_cast<int>(sizeof(SharedStorage<V>)) + 1024, setmaxnreg_sum<V>(), Cfg<V>::kCluster};
}
// The instantiation of a route (the backward chain has designs 1 and 2 and no profile instantiation; state-only
// calls have their own instantiations of designs 3 and 4, the other designs run them as calls with an output whose
// store is skipped). Null: not built (an experiment in a build without them).
Design design_for(bool profile, int variant, bool bwd, bool state_only) {
  if (!profile && bwd && variant == 2) return design_of<false, 2, true>();
  if (!profile && !bwd && variant == 3)
    return state_only ? design_of<false, 3, false, true>() : design_of<false, 3, false>();
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
  if (variant >= 5) {  // the CTA pair: no profile or state-only instantiation; the backward chain in design 5
    if (bwd) return design_of<false, 5, true>();
    if (profile || state_only) return Design{nullptr, 0, 0, 0, 1};
    if (variant == 5) return design_of<false, 5, false>();
    if (variant == 6) return design_of<false, 6, false>();
    return variant == 7 ? design_of<false, 7, false>() : design_of<false, 8, false>();
  }
  if (bwd) return variant == 1 ? design_of<false, 1, true>() : design_of<false, 2, true>();
  if (variant == 3 && state_only)
    return profile ? design_of<true, 3, false, true>() : design_of<false, 3, false, true>();
  if (variant == 4 && state_only) return design_of<false, 4, false, true>();
  if (variant == 4) return profile ? design_of<true, 4, false>() : design_of<false, 4, false>();
  if (variant == 1) return profile ? design_of<true, 1, false>() : design_of<false, 1, false>();
  if (variant == 3) return profile ? design_of<true, 3, false>() : design_of<false, 3, false>();
  return profile ? design_of<true, 2, false>() : design_of<false, 2, false>();
#else
  return Design{nullptr, 0, 0, 0, 1};
#endif
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
  std::fprintf(
      stderr,
      "kda_chunked_sm90 profile, variant %d, CTA 0: clock cycles per chunk per segment (lane 0 of each role's warp)\n",
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

cudaError_t launch_chunked_sm90(const RecurrentParams& p, const ForwardRoute& r, cudaStream_t stream,
                                bool backward_chain) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  using namespace chunked_sm90;
  if (!token_map_valid("q", p, p.q, p.H) || !token_map_valid("k", p, p.k, p.H) || !token_map_valid("g", p, p.g, p.HV) ||
      !token_map_valid("v", p, p.v, p.HV))
    return cudaErrorInvalidValue;
  const KernelArgs args{p,
                        token_tma(p, p.q, p.H),
                        token_tma(p, p.k, p.H),
                        token_tma(p, p.g, p.HV),
                        token_tma(p, p.v, p.HV),
                        sm90_schedule()};
  const bool profile = launch_knobs().exp.sm90_profile && !backward_chain;  // (experiments build only)
  const int variant = r.sm90_variant;
  const bool state_only = r.state_only;
  const Design dz = design_for(profile, variant, backward_chain, state_only);
  if (dz.fn == nullptr) return cudaErrorInvalidDeviceFunction;
  const KernelFn fn = dz.fn;
  const int smem = dz.smem, threads = dz.threads;
  const int which = state_only     ? (variant == 4 ? 13 : 9 + (profile ? 1 : 0))
                    : variant >= 5 ? 9 + variant + (backward_chain ? 4 : 0)
                    : variant == 4 ? 11 + (profile ? 1 : 0)
                                   : (backward_chain ? 6 : (profile ? 3 : 0)) + variant - 1;
  // Set once per (device, instantiation). Concurrent first calls may both set it: the attribute call is
  // idempotent, and the atomic flag keeps the check itself free of a data race.
  static std::atomic<bool> attr_set[64][21] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!attr_set[dev][which].load(std::memory_order_acquire)) {
    // setmaxnreg only moves registers within the CTA's launch allocation (ptxas's count x threads): if the
    // warpgroups' counts exceed it, the chain's increase would wait forever, so refuse the launch instead
    cudaFuncAttributes fa{};
    const cudaError_t ea = cudaFuncGetAttributes(&fa, fn);
    if (ea != cudaSuccess) return ea;
    if (fa.numRegs * (threads / 128) < dz.setmaxnreg_sum) {
      std::fprintf(stderr,
                   "kda_chunked_sm90: variant %d was compiled with %d registers per thread, fewer than its "
                   "setmaxnreg counts need (%d per thread over %d warpgroups): not launched\n",
                   variant, fa.numRegs, dz.setmaxnreg_sum, threads / 128);
      return cudaErrorLaunchOutOfResources;
    }
    const cudaError_t e = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    attr_set[dev][which].store(true, std::memory_order_release);
  }
  const int64_t blocks = p.N * p.HV * dz.cluster;
  cudaError_t e = cudaSuccess;
  if (dz.cluster > 1) {  // designs 5-8: a cluster of CTAs per (sequence, head), consecutive blocks
    cudaLaunchConfig_t cfg{};
    cfg.gridDim = dim3(static_cast<unsigned>(blocks));
    cfg.blockDim = dim3(static_cast<unsigned>(threads));
    cfg.dynamicSmemBytes = static_cast<size_t>(smem);
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = static_cast<unsigned>(dz.cluster);
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    e = cudaLaunchKernelEx(&cfg, fn, args);
    if (e == cudaSuccess) e = cudaGetLastError();
  } else {
    fn<<<dim3(static_cast<unsigned>(blocks)), threads, smem, stream>>>(args);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess)
    std::fprintf(stderr,
                 "kda_chunked_sm90: launch grid %lld x %d threads, %d B smem, N %lld HV %d T %lld B %lld%s variant %d "
                 "schedule %d%s%s: %s\n",
                 static_cast<long long>(blocks), threads, smem, static_cast<long long>(p.N), static_cast<int>(p.HV),
                 static_cast<long long>(p.T), static_cast<long long>(p.B), p.seq_order != nullptr ? " seq_order" : "",
                 variant, args.schedule, state_only ? " state-only" : "", profile ? " profile" : "",
                 cudaGetErrorString(e));
  if (e == cudaSuccess && profile) {
    const cudaError_t se = cudaStreamSynchronize(stream);
    if (se != cudaSuccess) return se;
    print_profile(variant);
  }
  return e;
}

}  // namespace kda
