// Error propagation of the host-side launchers (csrc/kda/**/*.cu): every kernel launch is followed by
// KDA_CHECK_LAUNCH(), which returns the launch's error from the enclosing cudaError_t function, and every
// call of a CUDA runtime function or another launcher goes through KDA_RETURN_IF_ERROR. The torch-facing
// layer turns a returned error into a c10 error (check_cuda in csrc/api). Host-only, no torch.
#pragma once
#include <cuda_runtime_api.h>

#define KDA_RETURN_IF_ERROR(expr)                 \
  do {                                            \
    const cudaError_t kda_err_ = (expr);          \
    if (kda_err_ != cudaSuccess) return kda_err_; \
  } while (0)

// After a <<<...>>> launch: the launch error (bad configuration, too much shared memory, ...), if any.
#define KDA_CHECK_LAUNCH() KDA_RETURN_IF_ERROR(cudaGetLastError())
