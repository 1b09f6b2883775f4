// KVAUDIT_CPU_CLONES: compile a hot function twice on x86-64 Linux with GCC (function
// multi-versioning: the loader picks the x86-64-v3 clone, AVX2 + FMA, where the CPU has it, the
// default one elsewhere) and once on other compilers and targets. Used by the exact reference's
// loops (references/mla_reference.cpp, which says why FMA contraction is harmless there) and by
// the bench's plain binary64 baseline (src/tools/bench_cpu.cpp), so both run at the same level.
#pragma once

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__linux__)
#define KVAUDIT_CPU_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
// A function compiled for x86-64-v3 only, for callers that choose it themselves at run time
// (kvaudit_cpu_has_v3()) because its default form is a different algorithm, not just other code.
#define KVAUDIT_HAVE_CPU_V3_TARGET 1
#define KVAUDIT_CPU_V3_TARGET __attribute__((target("arch=x86-64-v3")))
inline bool kvaudit_cpu_has_v3() {
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
}
#else
#define KVAUDIT_CPU_CLONES
#endif
