// One instantiation of the chunked prefill kernel: 64 value rows per CTA, 2 operand stages, 2-deep raw ring (GPUs with
// ~100 KB of shared memory per block). State-only variant (no output product: kOut = false).
#include "kda/chunked/chunked_instantiations.h"
#include "kda/chunked/chunked_kernel.cuh"

template cudaError_t kda::prefill::run_chunked_<64, 2, 2, false, false>(const kda::RecurrentParams&, bool, int,
                                                                        cudaStream_t);
