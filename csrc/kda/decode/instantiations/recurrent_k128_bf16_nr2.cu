// One instantiation of the token-serial KDA kernel: K = V = 128, bf16 state pool, 2 state rows per lane. An experiment:
// compiled only with KDA_BUILD_EXPERIMENTS=1.
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
#include "kda/decode/recurrent_kernel.cuh"

template void kda::decode::run_recurrent_<128, __nv_bfloat16, 2>(const kda::RecurrentParams&,
                                                                 const kda::decode::RecurrentLaunch&, cudaStream_t);
#endif
