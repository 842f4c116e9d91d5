// One instantiation of the token-serial KDA kernel: K = V = 128, f32 state pool, 4 state rows per lane.
#include "kda/decode/recurrent_kernel.cuh"

template void kda::decode::run_recurrent_<128, float, 4>(const kda::RecurrentParams&,
                                                         const kda::decode::RecurrentLaunch&, cudaStream_t);
