// One instantiation of the chunked kernel in backward-chain mode (training backward): 64 value rows per CTA, 2 operand
// stages, 2-deep raw ring (GPUs with ~100 KB of shared memory per block).
#include "kda/chunked/chunked_instantiations.h"
#include "kda/chunked/chunked_kernel.cuh"

template cudaError_t kda::prefill::run_chunked_<64, 2, 2, true>(const kda::RecurrentParams&, bool, int, cudaStream_t);
