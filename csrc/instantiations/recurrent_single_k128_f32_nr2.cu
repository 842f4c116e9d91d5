// One instantiation of the one-item-per-warp token-serial KDA kernel: K = V = 128, f32 state pool, 2 state rows per lane.
#include "kda/decode/recurrent_single_kernel.cuh"

template void kda::decode::run_recurrent_single_<128, float, 2>(const kda::RecurrentParams&, const kda::decode::RecurrentLaunch&, cudaStream_t);
