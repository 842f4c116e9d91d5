// One instantiation of the bulk-copy token-serial KDA kernel: K = V = 128, f32 state pool, 8 state rows per lane.
#include "kda/decode/recurrent_bulk_kernel.cuh"

template void kda::decode::run_recurrent_bulk_<128, float, 8>(const kda::RecurrentParams&, const kda::decode::RecurrentLaunch&, cudaStream_t);
