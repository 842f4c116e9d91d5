// One instantiation of the token-serial KDA kernel: K = V = 64, f32 state pool, 1 state rows per lane. An experiment:
// compiled only with KDA_BUILD_EXPERIMENTS=1.
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
#include "kda/decode/recurrent_kernel.cuh"

template void kda::decode::run_recurrent_<64, float, 1>(const kda::RecurrentParams&,
                                                        const kda::decode::RecurrentLaunch&, cudaStream_t);
#endif
