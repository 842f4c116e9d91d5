// One instantiation of the one-item-per-warp token-serial KDA kernel: K = V = 64, f32 state pool, 8 state rows per lane.
#include "kda/decode/recurrent_single_kernel.cuh"

template void kda::decode::run_recurrent_single_<64, float, 8>(const kda::RecurrentParams&, const kda::decode::RecurrentLaunch&, cudaStream_t);
