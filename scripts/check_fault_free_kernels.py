#!/usr/bin/env python3
"""Checks that the production kernels hold no fault-injection code: the fault variants of
mla_attention_kernel and mla_decode_registers_kernel (template argument AttentionFault,
kernels/mla_attention/params.cuh) are instantiated in kernels/mla_attention_faults.cu alone, and the
KV write under any rule but kvdump's (kv_write_fp8_kernel<rule, kWrapSlot>: the write faults and the
--reciprocal-scale option) in kernels/kv_write_rules.cu alone.

Reads the device code's entry functions (the __global__ kernels of the embedded cubin, `cuobjdump
-symbols`) of the two objects, the production launcher's (mla_attention.cu.o) and the fault
variants' (mla_attention_faults.cu.o), found among the object files given, and requires:
  * the production object has attention kernels, each an AttentionFault::kNone instantiation
    (template argument `(...AttentionFault)0`), and no other AttentionFault instantiation;
  * the production object's KV write is kv_write_fp8_kernel<(KvWriteRule)0, false> alone
    (kvdump's rule, no slot offset);
  * the faults object has attention kernels, each a fault instantiation (a non-zero
    AttentionFault), and no kNone one, nor any other kernel (it includes no other kernel header);
  * the write-rules object (kv_write_rules.cu.o) has kv_write_fp8_kernel<rule, true>
    instantiations and no other kernel.
Prints every violation and exits 1; exits 0 when clean, 77 (skipped) without cuobjdump.

    check_fault_free_kernels.py [--cuobjdump PATH] OBJECT...
"""
import argparse
import os
import pathlib
import re
import shutil
import subprocess
import sys

ATTENTION_KERNELS = ("mla_attention_kernel<", "mla_decode_registers_kernel<")
FAULT_ARGUMENT = re.compile(r"\(kvaudit::cuda::detail::AttentionFault\)(\d+)")
WRITE_KERNEL = "kv_write_fp8_kernel<"
PRODUCTION_WRITE = re.compile(r"kv_write_fp8_kernel<\(kvaudit::KvWriteRule\)0, false>")
RULES_WRITE = re.compile(r"kv_write_fp8_kernel<\(kvaudit::KvWriteRule\)\d+, true>")
PRODUCTION_OBJECT = "mla_attention.cu.o"
FAULTS_OBJECT = "mla_attention_faults.cu.o"
RULES_OBJECT = "kv_write_rules.cu.o"


def entry_functions(cuobjdump: str, obj: pathlib.Path):
    """Demangled names of the device code's entry functions (kernels) in `obj`."""
    listing = subprocess.run([cuobjdump, "-symbols", str(obj)], check=True, capture_output=True,
                             text=True).stdout
    mangled = [line.split()[-1] for line in listing.splitlines()
               if "STT_FUNC" in line and "STO_ENTRY" in line]
    if not mangled:
        return []
    demangled = subprocess.run(["c++filt"], input="\n".join(mangled), check=True,
                               capture_output=True, text=True).stdout
    return demangled.splitlines()


def faults_of(name: str):
    return [int(value) for value in FAULT_ARGUMENT.findall(name)]


def is_attention(name: str):
    return any(kernel in name for kernel in ATTENTION_KERNELS)


def check_production(kernels):
    problems = []
    attention = [k for k in kernels if is_attention(k)]
    if not attention:
        problems.append(f"{PRODUCTION_OBJECT}: no attention kernel found (is this the launcher?)")
    for kernel in kernels:
        faults = faults_of(kernel)
        if is_attention(kernel) and faults != [0]:
            problems.append(f"{PRODUCTION_OBJECT}: attention kernel not AttentionFault::kNone: "
                            f"{kernel}")
        elif any(value != 0 for value in faults):
            problems.append(f"{PRODUCTION_OBJECT}: fault instantiation: {kernel}")
        elif WRITE_KERNEL in kernel and not PRODUCTION_WRITE.search(kernel):
            problems.append(f"{PRODUCTION_OBJECT}: a KV write other than kvdump's rule: {kernel}")
    return problems, sum(1 for k in attention if faults_of(k) == [0])


def check_rules(kernels):
    problems = []
    writes = [k for k in kernels if RULES_WRITE.search(k)]
    if not writes:
        problems.append(f"{RULES_OBJECT}: no KV write rule instantiation found")
    for kernel in kernels:
        if not RULES_WRITE.search(kernel):
            problems.append(f"{RULES_OBJECT}: a kernel other than the write rules: {kernel}")
    return problems, len(writes)


def check_faults(kernels):
    problems = []
    attention = [k for k in kernels if is_attention(k)]
    if not attention:
        problems.append(f"{FAULTS_OBJECT}: no fault variant of the attention kernels found")
    for kernel in kernels:
        faults = faults_of(kernel)
        if not is_attention(kernel):
            problems.append(f"{FAULTS_OBJECT}: a kernel other than the attention variants: "
                            f"{kernel}")
        elif len(faults) != 1 or faults[0] == 0:
            problems.append(f"{FAULTS_OBJECT}: not a fault instantiation: {kernel}")
    return problems, sum(1 for k in attention if any(value != 0 for value in faults_of(k)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuobjdump", default="")
    parser.add_argument("objects", nargs="+", type=pathlib.Path)
    args = parser.parse_args()
    cuobjdump = args.cuobjdump if args.cuobjdump and os.path.exists(args.cuobjdump) else (
        shutil.which("cuobjdump"))
    if not cuobjdump:
        print("fault-free kernels: skipped, no cuobjdump (CUDA toolkit or nvidia-cuda-cuobjdump)")
        return 77
    by_name = {obj.name: obj for obj in args.objects}
    missing = [name for name in (PRODUCTION_OBJECT, FAULTS_OBJECT, RULES_OBJECT)
               if name not in by_name]
    if missing:
        print(f"fault-free kernels: object(s) not given: {', '.join(missing)}")
        return 1
    production, kept = check_production(entry_functions(cuobjdump, by_name[PRODUCTION_OBJECT]))
    faults, variants = check_faults(entry_functions(cuobjdump, by_name[FAULTS_OBJECT]))
    rules, rule_writes = check_rules(entry_functions(cuobjdump, by_name[RULES_OBJECT]))
    problems = production + faults + rules
    for problem in problems:
        print(problem)
    print(f"fault-free kernels: {kept} production attention kernels (AttentionFault::kNone), "
          f"{variants} fault variants in {FAULTS_OBJECT}, {rule_writes} write-rule kernels in "
          f"{RULES_OBJECT}, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
