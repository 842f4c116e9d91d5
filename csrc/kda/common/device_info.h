// Device attributes the launchers read on every call (SM count, shared-memory opt-in limit), queried
// once per device and cached. Host-only, no torch.
#pragma once
#include <cuda_runtime_api.h>

#include <atomic>

namespace kda {

// cudaDeviceGetAttribute(A) of the current device, cached per device (64 devices; more share the last
// entry). `fallback` when the query fails (the error is cleared so it cannot look like a launch error).
template <cudaDeviceAttr A>
int cached_device_attribute(int fallback) {
  static std::atomic<int> cache[64];
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || dev < 0) dev = 0;
  if (dev >= 64) dev = 63;
  int v = cache[dev].load(std::memory_order_relaxed);
  if (v <= 0) {
    if (cudaDeviceGetAttribute(&v, A, dev) != cudaSuccess || v <= 0) {
      (void)cudaGetLastError();
      v = fallback;
    }
    cache[dev].store(v, std::memory_order_relaxed);
  }
  return v;
}

// Whether the current device is compute capability 9.0 (H100 / H200: the sm_90a kernels' GPUs).
inline bool current_device_is_sm90() {
  int dev = 0, major = 0, minor = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) return false;
  if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess)
    return false;
  return major == 9 && minor == 0;
}

}  // namespace kda
