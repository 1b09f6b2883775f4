// KVAUDIT_CPU_CLONES: compile a hot function twice on x86-64 Linux with GCC (function
// multi-versioning: the loader picks the x86-64-v3 clone, AVX2 + FMA, where the CPU has it, the
// default one elsewhere) and once on other compilers and targets. Used by the exact reference's
// loops (references/mla_reference.cpp, which says why FMA contraction is harmless there) and by
// the bench's plain binary64 baseline (src/tools/bench_cpu.cpp), so both run at the same level.
#pragma once

#include <atomic>

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KVAUDIT_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
// Three clones, the third for x86-64-v4 (AVX-512), for loops the compiler vectorises itself.
#define KVAUDIT_CPU_CLONES_V4 \
  __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
// A function compiled for x86-64-v3 only, for callers that choose it themselves at run time
// (kvaudit_cpu_has_v3()) because its default form is a different algorithm, not just other code.
#define KVAUDIT_HAVE_CPU_V3_TARGET 1
#define KVAUDIT_CPU_V3_TARGET __attribute__((target("arch=x86-64-v3")))
inline bool kvaudit_cpu_has_v3() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
// The same for x86-64-v4 (AVX-512 F, BW, CD, DQ, VL), for loops written for 8 doubles per
// register; their callers fall back to the 4-wide forms where the CPU lacks it.
#define KVAUDIT_HAVE_CPU_V4_TARGET 1
#define KVAUDIT_CPU_V4_TARGET __attribute__((target("arch=x86-64-v4")))
inline bool kvaudit_cpu_has_v4() {
  static const bool has = kvaudit_cpu_has_v3() && __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512cd") &&
                          __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
  return has;
}
// Where the CPU has x86-64-v4, whether its forms are used: true unless a test has turned them off
// to run the 4-wide forms on the same CPU (tests/references/test_mla_reference_sliced.cpp checks
// that both give the same bits).
inline std::atomic<bool> kvaudit_cpu_v4_off{false};
inline bool kvaudit_cpu_use_v4() {
  return kvaudit_cpu_has_v4() && !kvaudit_cpu_v4_off.load(std::memory_order_relaxed);
}
#else
#define KVAUDIT_CPU_CLONES
#define KVAUDIT_CPU_CLONES_V4
#endif
