// One instantiation of the token-serial KDA kernel: K = V = 64, f32 state pool, 4 state rows per lane.
#include "kda/decode/recurrent_kernel.cuh"

template void kda::decode::run_recurrent_<64, float, 4>(const kda::RecurrentParams&,
                                                        const kda::decode::RecurrentLaunch&, cudaStream_t);
