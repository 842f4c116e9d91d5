// One instantiation of the chunked kernel in backward-chain mode (training backward): 128 value rows per CTA.
#include "kda/chunked/chunked_instantiations.h"
#include "kda/chunked/chunked_kernel.cuh"

template cudaError_t kda::prefill::run_chunked_<128, 3, 4, true>(const kda::RecurrentParams&, bool, int, cudaStream_t);
