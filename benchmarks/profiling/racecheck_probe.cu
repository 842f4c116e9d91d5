// Does compute-sanitizer racecheck model producer/consumer named barriers (bar.arrive / bar.sync)?
// A correct hand-off: warp 0 writes shared memory then bar.arrive(1, 64); warp 1 bar.sync(1, 64) then
// reads. Run: nvcc -arch=sm_90a -o /tmp/probe benchmarks/profiling/racecheck_probe.cu &&
//             compute-sanitizer --tool racecheck /tmp/probe
// The chunked prefill kernel hands tiles between warp roles this way (KREADY/FULL/EMPTY barriers).
#include <cstdio>

__global__ void handoff(float* out, int rounds) {
  __shared__ float buf[32];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int r = 0; r < rounds; ++r) {
    if (warp == 0) {
      if (r > 0) asm volatile("bar.sync 2, 64;" ::: "memory");     // EMPTY: consumer is done with buf
      buf[lane] = float(r * 32 + lane);
      asm volatile("bar.arrive 1, 64;" ::: "memory");              // FULL
    } else {
      asm volatile("bar.sync 1, 64;" ::: "memory");                // FULL
      out[r * 32 + lane] = buf[31 - lane];
      if (r + 1 < rounds) asm volatile("bar.arrive 2, 64;" ::: "memory");  // EMPTY
    }
  }
}

int main() {
  const int rounds = 4;
  float* d;
  cudaMalloc(&d, rounds * 32 * sizeof(float));
  handoff<<<1, 64>>>(d, rounds);
  float h[rounds * 32];
  cudaMemcpy(h, d, sizeof(h), cudaMemcpyDeviceToHost);
  int bad = 0;
  for (int r = 0; r < rounds; ++r)
    for (int l = 0; l < 32; ++l) bad += h[r * 32 + l] != float(r * 32 + 31 - l);
  printf("handoff values %s\n", bad ? "WRONG" : "correct");
  return bad != 0;
}
