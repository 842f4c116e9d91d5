// Programmatic dependent launch (PDL, sm_90+): a kernel launched with the programmatic-serialization
// attribute may be scheduled while the previous kernel of its stream still runs; it must wait
// (griddepcontrol.wait) before touching memory that kernel writes. A kernel that signals
// griddepcontrol.launch_dependents lets the next PDL-launched kernel start early. Both instructions are
// no-ops for a grid launched without the attribute, and the wait returns only when every grid this one
// depends on has completed with its writes visible, so where the signal sits changes timing, never results.
// The decode kernels use it to hide the launch latency of back-to-back steps (on by default; KDA_EXPERIMENT=pdl=0 turns
// it off in an experiments build).
#pragma once
#include <cuda_runtime.h>

#include <utility>

namespace kda {

// First statement of a PDL-aware kernel: wait for the grids this one depends on, then allow the next
// PDL-launched grid to launch (its CTAs wait in their own prologue; they only take SM slots this grid's
// resident CTAs leave free).
__device__ __forceinline__ void pdl_wait_and_release_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// kernel<<<grid, block, smem, stream>>>(args...), with the programmatic-serialization attribute when pdl.
// Returns the launch error, which also stays the thread's last error either way (cudaGetLastError after
// this sees it).
template <class... KernelArgs, class... Args>
cudaError_t launch_kernel(void (*kernel)(KernelArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          bool pdl, Args&&... args) {
  if (!pdl) {
    kernel<<<grid, block, smem, stream>>>(std::forward<Args>(args)...);
    return cudaPeekAtLastError();  // (peek: the error stays set for a caller that reads cudaGetLastError)
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute = {};
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace kda
