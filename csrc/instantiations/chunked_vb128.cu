// One instantiation of the chunked prefill kernel: 128 value rows per CTA.
#include "kda/prefill/chunked_instantiations.h"
#include "kda/prefill/chunked_kernel.cuh"

template cudaError_t kda::prefill::run_chunked_<128>(const kda::RecurrentParams&, bool, int, cudaStream_t);
