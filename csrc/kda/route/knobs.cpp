// The launch knobs read from the environment (knobs.h). The only getenv calls of the C++ layer.
#include "kda/route/knobs.h"

#include <atomic>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <string>

namespace kda {
namespace {

std::string lower(const char* s) {
  std::string r(s);
  for (char& c : r) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  while (!r.empty() && std::isspace(static_cast<unsigned char>(r.back()))) r.pop_back();
  while (!r.empty() && std::isspace(static_cast<unsigned char>(r.front()))) r.erase(r.begin());
  return r;
}

void fail(LaunchKnobs& k, const std::string& msg) {
  if (k.error.empty()) k.error = msg;
}

// A non-negative integer, the whole string; -1 when it is not one.
long long parse_count(const std::string& v) {
  if (v.empty() || v.size() > 12) return -1;
  long long n = 0;
  for (char c : v) {
    if (c < '0' || c > '9') return -1;
    n = n * 10 + (c - '0');
  }
  return n;
}

bool parse_bool(const std::string& v, bool* out) {
  if (v == "1" || v == "true" || v == "on" || v == "yes") return (*out = true), true;
  if (v == "0" || v == "false" || v == "off" || v == "no") return (*out = false), true;
  return false;
}

template <class Pin, int N>
void read_pin(LaunchKnobs& k, const char* name, Pin* out, const char* const (&names)[N], const char* expected) {
  const char* e = std::getenv(name);
  if (e == nullptr || e[0] == '\0') return;
  const std::string v = lower(e);
  for (int i = 0; i < N; ++i)
    if (v == names[i]) return void(*out = static_cast<Pin>(i));
  fail(k, std::string(name) + " must be " + expected + ", got '" + e + "'");
}

constexpr const char* kDecodeNames[] = {"auto", "ring", "serial"};
constexpr const char* kChunkedNames[] = {"auto", "sm90", "mma", "mma64", "mma128", "mma_small"};
constexpr const char* kSweepNames[] = {"auto", "wgmma64", "sub16", "small", "host"};
constexpr const char* kSplitNames[] = {"auto", "0", "1"};

#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
// KDA_EXPERIMENT="key=value,key=value": the fields of ExperimentKnobs by name.
void read_experiments(LaunchKnobs& k, const std::string& spec) {
  ExperimentKnobs& x = k.exp;
  size_t at = 0;
  while (at <= spec.size()) {
    const size_t end = std::min(spec.find(',', at), spec.size());
    const std::string item = spec.substr(at, end - at);
    at = end + 1;
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    const std::string key = item.substr(0, eq), val = eq == std::string::npos ? "1" : item.substr(eq + 1);
    const long long n = val.size() > 0 && val[0] == '-' ? -parse_count(val.substr(1)) : parse_count(val);
    bool b = false;
    const bool is_bool = parse_bool(val, &b);
    auto count = [&](int* f, long long lo, long long hi) {
      if (n < lo || n > hi) return fail(k, "KDA_EXPERIMENT: " + key + " out of range, got '" + val + "'");
      *f = static_cast<int>(n);
    };
    auto flag = [&](bool* f) {
      if (!is_bool) return fail(k, "KDA_EXPERIMENT: " + key + " must be 0 or 1, got '" + val + "'");
      *f = b;
    };
    auto bit = [&](int mask) {
      if (!is_bool) return fail(k, "KDA_EXPERIMENT: " + key + " must be 0 or 1, got '" + val + "'");
      x.ring_flags = b ? (x.ring_flags | mask) : (x.ring_flags & ~mask);
    };
    if (key == "sm90_variant")
      count(&x.sm90_variant, 1, 8);
    else if (key == "sm90_schedule")
      count(&x.sm90_schedule, 0, 63);
    else if (key == "sm90_profile")
      flag(&x.sm90_profile);
    else if (key == "sm90_state_only")
      flag(&x.sm90_state_only);
    else if (key == "sweep64_profile")
      flag(&x.sweep64_profile);
    else if (key == "sweep64_profile_grid")
      count(&x.sweep64_profile_grid, 0, 1 << 20);
    else if (key == "rows_per_lane")
      count(&x.rows_per_lane, 0, 8);
    else if (key == "blocks_per_sm")
      count(&x.blocks_per_sm, 0, 64);
    else if (key == "carveout")
      count(&x.carveout, -3, 100);
    else if (key == "l1_prefetch")
      flag(&x.l1_prefetch);
    else if (key == "warps_per_block")
      count(&x.warps_per_block, 1, 4);
    else if (key == "pdl")
      flag(&x.pdl);
    else if (key == "ring_shape")
      count(&x.ring_shape, 0, 3);
    else if (key == "ring_state_first")
      bit(32);  // decode::kFlagRingStateFirst
    else if (key == "ring_dt_bias_global")
      bit(16);  // decode::kFlagRingDtBiasGlobal
    else if (key == "ring_producer_diverged")
      bit(64);  // decode::kFlagRingProducerDiverged
    else if (key == "ring_fp32")
      flag(&x.ring_fp32);
    else if (key == "recurrent_diag")
      count(&x.recurrent_diag, 0, 3);
    else if (key == "chunked_diag")
      count(&x.chunked_diag, 0, 1 << 16);
    else
      fail(k, "KDA_EXPERIMENT: unknown key '" + key + "' (docs/env.md lists them)");
  }
  if (x.rows_per_lane != 0 && x.rows_per_lane != 1 && x.rows_per_lane != 2 && x.rows_per_lane != 4 &&
      x.rows_per_lane != 8)
    fail(k, "KDA_EXPERIMENT: rows_per_lane must be 0, 1, 2, 4 or 8");
}
#endif

LaunchKnobs read_environment() {
  LaunchKnobs k;
  if (const char* e = std::getenv("KDA_VERBOSE")) {
    const std::string v = lower(e);
    if (!v.empty() && !parse_bool(v, &k.verbose)) fail(k, std::string("KDA_VERBOSE must be 0 or 1, got '") + e + "'");
  }
  if (const char* e = std::getenv("KDA_BATCH_INVARIANT")) {
    const std::string v(e);
    if (!v.empty() && !parse_bool(v, &k.batch_invariant))
      fail(k, std::string("KDA_BATCH_INVARIANT must be 0 or 1, got '") + e + "'");
  }
  read_pin(k, "KDA_DECODE_KERNEL", &k.decode, kDecodeNames, "auto, ring or serial");
  read_pin(k, "KDA_CHUNKED_KERNEL", &k.chunked, kChunkedNames, "auto, sm90, mma, mma64, mma128 or mma_small");
  read_pin(k, "KDA_TRAINING_SWEEP", &k.sweep, kSweepNames, "auto, wgmma64, sub16, small or host");
  read_pin(k, "KDA_SEQUENCE_SPLIT", &k.split, kSplitNames, "auto, 0 or 1");
  if (const char* e = std::getenv("KDA_SEQUENCE_SPLIT_TOKENS")) {
    const long long n = e[0] == '\0' ? 0 : parse_count(lower(e));
    if (n < 0 || n % 64 != 0)
      fail(k, std::string("KDA_SEQUENCE_SPLIT_TOKENS must be 0 or a positive multiple of 64, got '") + e + "'");
    else
      k.split_tokens = n;
  }
  if (const char* e = std::getenv("KDA_EXPERIMENT")) {
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
    read_experiments(k, lower(e));
#else
    if (e[0] != '\0')
      fail(k,
           "KDA_EXPERIMENT is set but this build has no experiments: rebuild with KDA_BUILD_EXPERIMENTS=1 "
           "(docs/env.md), or unset it");
#endif
  }
  return k;
}

std::mutex g_reload_mutex;
std::atomic<const LaunchKnobs*> g_knobs{nullptr};

}  // namespace

const LaunchKnobs& launch_knobs() {
  const LaunchKnobs* k = g_knobs.load(std::memory_order_acquire);
  if (k != nullptr) return *k;
  std::lock_guard<std::mutex> lock(g_reload_mutex);
  k = g_knobs.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = new LaunchKnobs(read_environment());  // (never freed: a snapshot may be in use by a concurrent call)
    g_knobs.store(k, std::memory_order_release);
  }
  return *k;
}

std::string reload_launch_knobs() {
  std::lock_guard<std::mutex> lock(g_reload_mutex);
  const LaunchKnobs* k = new LaunchKnobs(read_environment());
  g_knobs.store(k, std::memory_order_release);
  return k->error;
}

const char* pin_name(DecodePin p) {
  return kDecodeNames[static_cast<int>(p)];
}
const char* pin_name(ChunkedPin p) {
  return kChunkedNames[static_cast<int>(p)];
}
const char* pin_name(SweepPin p) {
  return kSweepNames[static_cast<int>(p)];
}
const char* pin_name(SplitPin p) {
  return kSplitNames[static_cast<int>(p)];
}

}  // namespace kda
