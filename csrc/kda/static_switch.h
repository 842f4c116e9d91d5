// Runtime value -> compile-time template parameter, in one place (FA3 hopper/static_switch.h style).
// Each macro takes the runtime value, the name of the constant (or type) it defines, and a lambda
// `[&] { ... }` that uses it. An unsupported value throws std::invalid_argument naming the value: the
// torch-facing layer (csrc/api) validates first, so reaching the default branch is a bug, and it fails
// loudly instead of silently running a wrong instantiation. No torch headers here (docs/design.md, "Layer map").
#pragma once
#include <stdexcept>
#include <string>

#include <cuda_bf16.h>

#include "kda/params.h"

#define KDA_SWITCH_FAIL(what, value)                                                          \
  throw std::invalid_argument(std::string("kda static switch: unsupported ") + (what) + " " + \
                              std::to_string(static_cast<long long>(value)))

#define KDA_BOOL_SWITCH(cond, kName, ...) \
  [&] {                                   \
    if (cond) {                           \
      constexpr bool kName = true;        \
      return __VA_ARGS__();               \
    } else {                              \
      constexpr bool kName = false;       \
      return __VA_ARGS__();               \
    }                                     \
  }()

// Head dim K (= V): 64 or 128.
#define KDA_HEADDIM_SWITCH(d, kName, ...) \
  [&] {                                   \
    switch (d) {                          \
      case 64: {                          \
        constexpr int kName = 64;         \
        return __VA_ARGS__();             \
      }                                   \
      case 128: {                         \
        constexpr int kName = 128;        \
        return __VA_ARGS__();             \
      }                                   \
      default:                            \
        KDA_SWITCH_FAIL("head dim", (d)); \
    }                                     \
  }()

// Storage dtype of a state pool: kda::DType::kFloat32 -> float, kBFloat16 -> __nv_bfloat16.
#define KDA_STATE_DTYPE_SWITCH(dt, TName, ...)                \
  [&] {                                                       \
    switch (dt) {                                             \
      case ::kda::DType::kFloat32: {                          \
        using TName = float;                                  \
        return __VA_ARGS__();                                 \
      }                                                       \
      case ::kda::DType::kBFloat16: {                         \
        using TName = __nv_bfloat16;                          \
        return __VA_ARGS__();                                 \
      }                                                       \
      default:                                                \
        KDA_SWITCH_FAIL("state dtype", static_cast<int>(dt)); \
    }                                                         \
  }()

// State rows held per lane by the token-serial kernel: 4 or 8 (the tiles a route chooses); 1 and 2 too in an
// experiments build (KDA_BUILD_EXPERIMENTS=1: they lost everywhere on the H200).
#if defined(KDA_EXPERIMENTS) && KDA_EXPERIMENTS
#define KDA_EXPERIMENT_ROWS_PER_LANE_CASES(kName, ...) \
  case 1: {                                            \
    constexpr int kName = 1;                           \
    return __VA_ARGS__();                              \
  }                                                    \
  case 2: {                                            \
    constexpr int kName = 2;                           \
    return __VA_ARGS__();                              \
  }
#else
#define KDA_EXPERIMENT_ROWS_PER_LANE_CASES(kName, ...)
#endif
#define KDA_ROWS_PER_LANE_SWITCH(nr, kName, ...)             \
  [&] {                                                      \
    switch (nr) {                                            \
      KDA_EXPERIMENT_ROWS_PER_LANE_CASES(kName, __VA_ARGS__) \
      case 4: {                                              \
        constexpr int kName = 4;                             \
        return __VA_ARGS__();                                \
      }                                                      \
      case 8: {                                              \
        constexpr int kName = 8;                             \
        return __VA_ARGS__();                                \
      }                                                      \
      default:                                               \
        KDA_SWITCH_FAIL("rows per lane", (nr));              \
    }                                                        \
  }()
