// One instantiation of the warp-specialised token-serial KDA kernel: K = V = 128, fp32 state pool, 4 state rows per
// lane (a 4 KB tile, as the bf16 8-row one), block shape 1 (RingShape).
#include "kda/decode/recurrent_ring_kernel.cuh"

template void kda::decode::run_recurrent_ring_<128, float, 4, 1>(const kda::RecurrentParams&,
                                                                 const kda::decode::RecurrentLaunch&, cudaStream_t);
