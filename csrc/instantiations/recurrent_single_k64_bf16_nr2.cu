// One instantiation of the one-item-per-warp token-serial KDA kernel: K = V = 64, bf16 state pool, 2 state rows per lane.
#include "kda/decode/recurrent_single_kernel.cuh"

template void kda::decode::run_recurrent_single_<64, __nv_bfloat16, 2>(const kda::RecurrentParams&, const kda::decode::RecurrentLaunch&, cudaStream_t);
