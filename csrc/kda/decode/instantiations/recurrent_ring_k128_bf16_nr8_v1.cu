// One instantiation of the warp-specialised token-serial KDA kernel: K = V = 128, bf16 state pool, 8 state rows per
// lane, block shape 1 (RingShape).
#include "kda/decode/recurrent_ring_kernel.cuh"

template void kda::decode::run_recurrent_ring_<128, __nv_bfloat16, 8, 1>(const kda::RecurrentParams&,
                                                                         const kda::decode::RecurrentLaunch&,
                                                                         cudaStream_t);
