// The split route (route.h): compiled in every build, CPU-only included, since the CPU ops split too when the
// split is forced (KDA_SEQUENCE_SPLIT=1). kda_ops/_split.py runs the plan it returns.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>

#include "kda/route/route.h"

#if defined(KDA_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace kda {
namespace {

// Auto leaves sequences shorter than this unsplit: the cost model has no term for the split's fixed cost (its
// extra launches and the scan); on an H200 the split won from 8K tokens at 32 heads, eager and in graphs.
constexpr int64_t kAutoMinTokens = 8192;
// The training split's own threshold: its backward repeats the chunk-parallel sweep (which no split speeds up)
// for each of its two passes, so it pays only on long sequences (measured from 64K tokens; at 32 heads of 8K
// it lost, 0.61x). Its model keeps the mma.sync kernel's row cost.
constexpr int64_t kAutoMinTokensTraining = 16384;
// Time per token of one chain when the mma.sync chunked kernel runs 128 value rows per CTA, relative to 64 rows
// (it takes 64 when the chains fill at most half of the SMs). The Hopper kernel runs every grid at one cost per
// chain (128 rows per CTA; as fast as the mma.sync kernel's 64-row CTAs on the H200): 1.0 there.
constexpr double kRows128Cost = 1.5;
constexpr double kMargin = 1.25;  // the split must win by this factor in the model (launches, scan, pool traffic)
constexpr int kNominalSms = 132;
constexpr int64_t kDeviceLengthsChainsPerSm =
    4;  // device-only lengths: auto needs SMs >= 4 N·HV  // CPU calls (tests) plan as for an H100 / H200

struct SplitFacts {
  int sms = kNominalSms;
  int cc = 0;
};

SplitFacts split_facts(bool on_cuda, int device_index) {
  SplitFacts f;
#if defined(KDA_WITH_CUDA)
  static std::atomic<int> cache_sms[64], cache_cc[64];
  if (!on_cuda || device_index < 0) return f;
  const int d = std::min(device_index, 63);
  int sms = cache_sms[d].load(std::memory_order_relaxed), cc = cache_cc[d].load(std::memory_order_relaxed);
  if (sms <= 0) {
    int major = 0, minor = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device_index) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device_index) != cudaSuccess ||
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device_index) != cudaSuccess || sms <= 0) {
      (void)cudaGetLastError();
      return f;
    }
    cc = major * 10 + minor;
    cache_cc[d].store(cc, std::memory_order_relaxed);
    cache_sms[d].store(sms, std::memory_order_relaxed);
  }
  f.sms = sms;
  f.cc = cc;
#else
  (void)on_cuda;
  (void)device_index;
#endif
  return f;
}

int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

void note_cpu_route(const char* family, int64_t N, int64_t HV, int64_t T, int64_t B, int64_t K) {
  if (!launch_knobs().verbose) return;
  std::fprintf(stderr, "kda route: %s kernel=cpu_token_loop | N=%lld HV=%lld T=%lld B=%lld K=%lld cpu\n", family,
               static_cast<long long>(N), static_cast<long long>(HV), static_cast<long long>(T),
               static_cast<long long>(B), static_cast<long long>(K));
}

int64_t plan_segments(const int64_t* lens, int64_t n, int HV, int sms, int64_t multiple) {
  int64_t longest = 0;
  for (int64_t i = 0; i < n; ++i) longest = std::max(longest, lens[i]);
  int64_t lo = 1, hi = std::max<int64_t>(1, ceil_div(longest, multiple));  // hi: one segment per sequence
  while (lo < hi) {  // the chains decrease with the segment length: binary search on Ls / multiple
    const int64_t mid = (lo + hi) / 2;
    int64_t chains = 0;
    for (int64_t i = 0; i < n; ++i)
      if (lens[i] > 0) chains += ceil_div(lens[i], mid * multiple);
    if (chains * HV <= sms)
      hi = mid;
    else
      lo = mid + 1;
  }
  return lo * multiple;
}

bool split_pays(const int64_t* lens, int64_t n, int HV, int sms, int64_t Ls, double rows128_cost) {
  // The critical path of the unsplit call (its longest sequence, at the cost of its grid's rows per CTA) against
  // the split's 3 passes (2 when no segment needs P) over Ls tokens.
  int64_t longest = 0, segments = 0, most = 0;
  for (int64_t i = 0; i < n; ++i) {
    longest = std::max(longest, lens[i]);
    const int64_t s = std::max<int64_t>(1, ceil_div(lens[i], Ls));
    segments += s;
    most = std::max(most, s);
  }
  if (longest <= Ls) return false;
  const double unsplit = double(longest) * (n * HV * 2 <= sms ? 1.0 : rows128_cost);
  const int64_t chains = segments * HV;
  const double split = (most >= 3 ? 3.0 : 2.0) * double(Ls) * (chains * 2 <= sms ? 1.0 : rows128_cost);
  return split * kMargin < unsplit;
}

int64_t route_split(const SplitQuery& query) {
  const LaunchKnobs& k = launch_knobs();
  if (k.split == SplitPin::kOff || k.batch_invariant || query.n <= 0 || query.HV <= 0 || query.multiple <= 0) return 0;
  // Lengths on the device only (a packed call as engines make it, eager or captured): planned as one sequence of
  // all the tokens (the longest any sequence can be), so a long one is cut into chains that fit the SMs, and one
  // shorter than a segment stays whole (it runs in the output pass alone, beside two passes with nothing to do
  // for it). Auto takes it only while the call's own chains fill at most a quarter of the SMs: the split does two to
  // three times the work, so it gains only where it can multiply the busy SMs by more than that (at half of the
  // SMs, 8 sequences of 2048 tokens on 8 heads, it breaks even at best).
  SplitQuery q = query;
  const int64_t all_tokens[1] = {std::max<int64_t>(q.tokens, 0)};
  const bool device_lengths = q.lens == nullptr;
  if (device_lengths) {
    if (k.split == SplitPin::kAuto &&
        q.n * q.HV * kDeviceLengthsChainsPerSm > split_facts(q.on_cuda, q.device_index).sms)
      return 0;
    q.lens = all_tokens;
    q.n = 1;
  }
  int64_t longest = 0;
  for (int64_t i = 0; i < q.n; ++i) longest = std::max(longest, q.lens[i]);
  const bool automatic = k.split == SplitPin::kAuto;
  // auto splits only CUDA calls: on the host the passes run one after another, so the split's extra work is
  // never hidden by idle SMs
  if (longest <= 64 || (automatic && (!q.on_cuda || longest < (q.training ? kAutoMinTokensTraining : kAutoMinTokens))))
    return 0;
  const SplitFacts f = split_facts(q.on_cuda, q.device_index);
  const int64_t Ls = k.split_tokens > 0 ? k.split_tokens : plan_segments(q.lens, q.n, q.HV, f.sms, q.multiple);
  if (longest <= Ls || Ls % q.multiple != 0) return 0;
  if (automatic) {
    const bool hopper_forward = f.cc == 90 && (k.chunked == ChunkedPin::kAuto || k.chunked == ChunkedPin::kSm90);
    const double cost = q.training || !hopper_forward ? kRows128Cost : 1.0;
    if (!split_pays(q.lens, q.n, q.HV, f.sms, Ls, cost)) return 0;
  }
  return Ls;
}

}  // namespace kda
