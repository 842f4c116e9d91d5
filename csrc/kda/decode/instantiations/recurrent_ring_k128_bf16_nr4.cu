// One instantiation of the warp-specialised token-serial KDA kernel: K = V = 128, bf16 state pool, 4 state rows per
// lane.
#include "kda/decode/recurrent_ring_kernel.cuh"

template void kda::decode::run_recurrent_ring_<128, __nv_bfloat16, 4, 0>(const kda::RecurrentParams&,
                                                                         const kda::decode::RecurrentLaunch&,
                                                                         cudaStream_t);
