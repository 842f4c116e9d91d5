// One instantiation of the chunked prefill kernel: 128 value rows per CTA, 3 operand stages, 4-deep raw ring.
// State-only variant (no output product: kOut = false).
#include "kda/chunked/chunked_instantiations.h"
#include "kda/chunked/chunked_kernel.cuh"

template cudaError_t kda::prefill::run_chunked_<128, 3, 4, false, false>(const kda::RecurrentParams&, bool, int,
                                                                         cudaStream_t);
