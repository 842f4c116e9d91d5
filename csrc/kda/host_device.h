// KDA_HD: functions shared by host code (the CPU ops, the launchers) and CUDA device code. The lowest
// header of csrc/kda, beside params.h: everything may include it, it includes nothing.
#pragma once
#if defined(__CUDACC__)
#define KDA_HD __host__ __device__ __forceinline__
#else
#define KDA_HD inline
#endif
