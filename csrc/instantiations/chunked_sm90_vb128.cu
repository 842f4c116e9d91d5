// The Hopper chunked prefill kernel (csrc/kda/chunked/sm90/chunked_sm90_kernel.cuh) and its host launch.
// Built for every CUDA arch of the extension; the kernel body exists only in the sm_90a image, and the host
// routes to it only on a compute capability 9.0 device.
#include <cstdlib>
#include <cstring>

#include "kda/chunked/sm90/chunked_sm90.h"
#include "kda/chunked/sm90/chunked_sm90_kernel.cuh"
#include "kda/common/device_info.h"

namespace kda {

bool chunked_sm90_requested() {
  const char* e = std::getenv("KDA_CHUNKED_KERNEL");
  return e != nullptr && std::strcmp(e, "sm90") == 0;
}

bool chunked_sm90_supported(const RecurrentParams& p) {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return false;
  if (major != 9 || minor != 0) return false;
  if (p.K != chunked_sm90::kD || p.V != chunked_sm90::kD || p.token_dtype != DType::kBFloat16) return false;
  if (p.num_spec_tokens > 0 || p.checkpoint_every_n_tokens > 0 || p.state_source != nullptr ||
      p.seq_order != nullptr)
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
chunked_sm90::TmaToken token_tma(const RecurrentParams& p, const TokenTensor& t, int heads) {
  // A batch of one row: any stride that is a multiple of 16 bytes (the mode has extent 1).
  const int64_t bs = p.B == 1 ? t.token_stride * p.T : t.batch_stride;
  return chunked_sm90::make_token_tma(t.ptr, static_cast<int>(p.T), heads, static_cast<int>(p.B), t.token_stride,
                                      t.head_stride, bs);
}
}  // namespace

cudaError_t launch_chunked_sm90(const RecurrentParams& p, cudaStream_t stream) {
  if (p.N <= 0 || p.HV <= 0) return cudaSuccess;
  using namespace chunked_sm90;
  const KernelArgs args{p, token_tma(p, p.q, p.H), token_tma(p, p.k, p.H), token_tma(p, p.g, p.HV),
                        token_tma(p, p.v, p.HV)};
  constexpr int smem = static_cast<int>(sizeof(SharedStorage)) + 1024;  // + alignment of the 1024-byte swizzle
  static bool attr_set[64] = {};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) dev = 0;
  if (!attr_set[dev]) {
    const cudaError_t e = cudaFuncSetAttribute(kda_chunked_sm90_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
    attr_set[dev] = true;
  }
  const int64_t blocks = p.N * p.HV;
  kda_chunked_sm90_kernel<<<dim3(static_cast<unsigned>(blocks)), kThreads, smem, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace kda
