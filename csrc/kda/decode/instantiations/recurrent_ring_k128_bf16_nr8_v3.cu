// One instantiation of the warp-specialised token-serial KDA kernel: K = V = 128, bf16 state pool, 8 state rows per
// lane, block shape 3 (RingShape). An experiment: compiled only with KDA_BUILD_EXPERIMENTS=1.
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
#include "kda/decode/recurrent_ring_kernel.cuh"

template void kda::decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 3>(const kda::RecurrentParams&,
                                                                         const kda::decode::RecurrentLaunch&,
                                                                         cudaStream_t);
#endif
