#!/bin/bash
# Submits a sharded `kvaudit check` to Slurm: a job array of N tasks, one shard each
# (kvaudit-shard.sbatch: `kvaudit check DUMP --shard auto/N`), and a merge job that starts when
# every task succeeded (--dependency=afterok, kvaudit-merge.sbatch: `kvaudit merge`) and writes
# OUT/report/ (report.json, report.md, report.html; with --signoff also report.manifest.json and
# report.sig, signed), the report the unsharded check gives (README "Sharding").
#
#   scripts/slurm/kvaudit-array.sh --dump FILE --shards N --out DIR [--backend NAME]
#       [--kvaudit PATH] [--cpus C] [--first-index K] [--signing-key FILE] [--sbatch OPTION]...
#       [-- CHECK_OPTION...]
#
#   --dump FILE       the kvdump to check (a path every node can read)
#   --shards N        how many parts (shard i holds the i-th of N contiguous groups of layers)
#   --out DIR         created; parts go to DIR/parts, logs to DIR/logs, the report to DIR/report
#                     (refused when DIR/parts already holds parts: a stale part would be merged)
#   --backend NAME    kvaudit check --backend (default cpu-fp8); a CUDA backend needs a GPU per
#                     task: --sbatch --gres=gpu:1
#   --kvaudit PATH    the kvaudit binary (default: kvaudit on PATH)
#   --cpus C          CPUs per task, also kvaudit's --threads (default 1); every task gets the
#                     same, as kvaudit merge requires the same backend description of every part
#   --first-index K   array indices K..K+N-1 (default 0); kvaudit subtracts SLURM_ARRAY_TASK_MIN
#   --signing-key FILE  for a sign-off (-- --signoff --signed-by NAME --model NAME): the Ed25519
#                     private key (kvaudit keygen), on a path every node reads; given to every
#                     task's check and to the merge, which signs OUT/report with it
#   --sbatch OPTION   passed to both sbatch calls, e.g. --sbatch --partition=gpu --sbatch --time=1:00:00
#   -- CHECK_OPTION   the rest goes to kvaudit check (--policy, --signoff, --layers, --inject ...)
#
# Prints the two job ids, "array_job=ID" and "merge_job=ID". The merge job's exit status is the
# verdict: 0 pass, 1 checks failed (sacct, or scontrol show job ID while Slurm keeps it). A task
# that cannot write its part (bad input, internal error) fails the array; the merge job is then
# cancelled (--kill-on-invalid-dep=yes) rather than left pending.
set -euo pipefail

usage() {
  sed -n '6,8p' "$0" | sed 's/^# *//' >&2
  exit 2
}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
dump="" shards="" out="" backend=cpu-fp8 kvaudit=kvaudit cpus=1 first=0 signing_key=""
sbatch_options=()
while [ $# -gt 0 ]; do
  case $1 in
    --dump) dump=$2; shift 2 ;;
    --shards) shards=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --backend) backend=$2; shift 2 ;;
    --kvaudit) kvaudit=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --first-index) first=$2; shift 2 ;;
    --signing-key) signing_key=$2; shift 2 ;;
    --sbatch) sbatch_options+=("$2"); shift 2 ;;
    --) shift; break ;;
    -h|--help) usage ;;
    *) echo "kvaudit-array.sh: unknown option $1" >&2; usage ;;
  esac
done
[ -n "$dump" ] && [ -n "$shards" ] && [ -n "$out" ] || usage
for number in "$shards" "$cpus" "$first"; do
  [[ $number =~ ^[0-9]+$ ]] || { echo "kvaudit-array.sh: '$number' is not a whole number" >&2; exit 2; }
done
[ "$shards" -ge 1 ] || { echo "kvaudit-array.sh: --shards must be at least 1" >&2; exit 2; }
[ -r "$dump" ] || { echo "kvaudit-array.sh: cannot read $dump" >&2; exit 2; }
kvaudit=$(command -v "$kvaudit") || { echo "kvaudit-array.sh: no kvaudit binary" >&2; exit 2; }
# A sign-off is signed by the merge: refused here, before any job, without the key.
signing=()
for option in "$@"; do
  if [ "$option" = --signoff ] && [ -z "$signing_key" ]; then
    echo "kvaudit-array.sh: --signoff needs --signing-key FILE (the merge signs the report)" >&2
    exit 2
  fi
done
if [ -n "$signing_key" ]; then
  case " $* " in
    *" --signoff "*) ;;
    *) echo "kvaudit-array.sh: --signing-key needs -- --signoff (only a sign-off is signed)" >&2
       exit 2 ;;
  esac
  [ -r "$signing_key" ] || { echo "kvaudit-array.sh: cannot read $signing_key" >&2; exit 2; }
  signing=(--signing-key "$(realpath "$signing_key")")
fi

# Absolute paths: the jobs run wherever Slurm starts them.
dump=$(realpath "$dump")
kvaudit=$(realpath "$kvaudit")
mkdir -p "$out/parts" "$out/logs"
out=$(realpath "$out")
if compgen -G "$out/parts/part-*.json" > /dev/null; then
  echo "kvaudit-array.sh: $out/parts already holds parts; use a new --out" >&2
  exit 2
fi

last=$((first + shards - 1))
array_job=$(sbatch --parsable "${sbatch_options[@]}" --array="$first-$last" \
  --cpus-per-task="$cpus" --output="$out/logs/shard-%a.out" \
  "$here/kvaudit-shard.sbatch" "$kvaudit" "$dump" "$shards" "$out" --backend "$backend" \
  "${signing[@]}" "$@")
array_job=${array_job%%;*}  # "id;cluster" on a federation
merge_job=$(sbatch --parsable "${sbatch_options[@]}" --dependency="afterok:$array_job" \
  --kill-on-invalid-dep=yes --cpus-per-task=1 --output="$out/logs/merge.out" \
  "$here/kvaudit-merge.sbatch" "$kvaudit" "$out" "${signing[@]}")
merge_job=${merge_job%%;*}
echo "array_job=$array_job"
echo "merge_job=$merge_job"
