#!/bin/bash
# The Slurm end-to-end test (CTest slurm_array): a single-node Slurm started here from Debian's
# packages, without systemd, a 4-shard `kvaudit check` array on datasets/glm5_page1.h5 submitted
# with scripts/slurm/kvaudit-array.sh (indices 1-4, so that kvaudit's SLURM_ARRAY_TASK_MIN offset
# is exercised too) as a sign-off with a key from kvaudit keygen, its merge job waited for, the
# merged report's signature verified (kvaudit verify-report --public-key), and the merged
# report.json compared with the unsharded check's by scripts/same_report.py (everything but
# timing, provenance and the dump's path must be equal; the comparison prints nothing).
#
#   bash scripts/slurm/test-slurm-array.sh BUILD/kvaudit
#
# Needs root (munged, slurmctld and slurmd run as root here); installs the Debian packages
# slurmctld, slurmd, slurm-client and munge with apt-get when they are missing. Exits 77 (CTest:
# skipped, with the reason) when not root or when they cannot be installed. The daemons run in a
# temporary directory with a generated slurm.conf, a generated munge key, their own munge socket
# and free TCP ports, and are stopped on every exit (trap), pass or fail.
set -uo pipefail

skip() {
  echo "slurm_array: SKIPPED: $*"
  exit 77
}
fail() {
  echo "slurm_array: FAILED: $*"
  exit 1
}

kvaudit=$(realpath "${1:?usage: test-slurm-array.sh BUILD/kvaudit}")
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
dump=$root/datasets/glm5_page1.h5
shards=4

[ "$(id -u)" -eq 0 ] || skip "needs root to start munged, slurmctld and slurmd"

# --- packages ---------------------------------------------------------------------------------
packages=(slurmctld slurmd slurm-client munge)
install_packages() {
  local missing=()
  for package in "${packages[@]}"; do
    dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
      missing+=("$package")
  done
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "slurm_array: installing ${missing[*]}"
  # No service may start from the packages' scripts: this test starts its own daemons.
  local policy=/usr/sbin/policy-rc.d added_policy=0
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy" && added_policy=1
  fi
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
     --no-install-recommends "${missing[@]}") > /tmp/slurm_array_apt.log 2>&1
  local status=$?
  [ "$added_policy" -eq 1 ] && rm -f "$policy"
  return $status
}
install_packages || skip "apt-get could not install ${packages[*]} (/tmp/slurm_array_apt.log)"
for tool in munged slurmctld slurmd sbatch squeue scontrol; do
  command -v "$tool" > /dev/null || skip "$tool not found after installing ${packages[*]}"
done

# --- daemons, stopped on every exit --------------------------------------------------------------
work=$(mktemp -d /tmp/kvaudit-slurm.XXXXXX)
chmod 755 "$work"
pids=()
stop_daemons() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  done
  if [ "${KVAUDIT_KEEP_SLURM_DIR:-0}" = 1 ]; then
    echo "slurm_array: kept $work"
  else
    rm -rf "$work"
  fi
}
trap stop_daemons EXIT
show_logs() {
  for log in "$work"/*.log "$work"/run/logs/*; do
    [ -f "$log" ] && { echo "----- $log"; tail -n 40 "$log"; }
  done
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_munge() {
  mkdir -p "$work/munge" && chmod 755 "$work/munge"  # clients need to reach the socket
  dd if=/dev/urandom of="$work/munge/munge.key" bs=1024 count=1 status=none
  chmod 400 "$work/munge/munge.key"
  munged --force --foreground --key-file="$work/munge/munge.key" \
    --socket="$work/munge/munge.socket" --pid-file="$work/munge/munged.pid" \
    --seed-file="$work/munge/munge.seed" > "$work/munged.log" 2>&1 &
  pids+=($!)
  for _ in $(seq 50); do [ -S "$work/munge/munge.socket" ] && return 0; sleep 0.1; done
  return 1
}

write_slurm_conf() {
  local host cpus
  host=$(hostname -s)
  cpus=$(nproc)
  mkdir -p "$work/state" "$work/spool"
  cat > "$work/slurm.conf" <<CONF
ClusterName=kvaudit-test
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
AuthInfo=socket=$work/munge/munge.socket
CredType=cred/munge
StateSaveLocation=$work/state
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=600
NodeName=kvaudit-node NodeHostname=$host NodeAddr=127.0.0.1 CPUs=$cpus State=UNKNOWN
PartitionName=kvaudit Nodes=kvaudit-node Default=YES MaxTime=INFINITE State=UP
CONF
}

start_slurm() {
  export SLURM_CONF=$work/slurm.conf
  slurmctld -D -i -f "$SLURM_CONF" > "$work/slurmctld.out" 2>&1 &
  pids+=($!)
  slurmd -D -N kvaudit-node -f "$SLURM_CONF" > "$work/slurmd.out" 2>&1 &
  pids+=($!)
  for _ in $(seq 100); do
    sinfo -h -N -o '%T' 2>/dev/null | grep -Eq '^(idle|mixed|allocated)' && return 0
    sleep 0.2
  done
  return 1
}

start_munge || { show_logs; fail "munged did not start"; }
write_slurm_conf
start_slurm || { show_logs; fail "slurmctld/slurmd did not bring the node up"; }
echo "slurm_array: single-node Slurm up ($(sinfo -h -o '%P %a %D %T'))"

# --- the sharded check on Slurm, a sign-off: the merge signs the report with the key -------------
"$kvaudit" keygen --out "$work/key" > /dev/null || fail "kvaudit keygen failed"
signoff=(--signoff --signed-by "slurm test" --model GLM-5)
submitted=$(bash "$root/scripts/slurm/kvaudit-array.sh" --dump "$dump" --shards "$shards" \
  --out "$work/run" --kvaudit "$kvaudit" --cpus 1 --first-index 1 --signing-key "$work/key" \
  -- "${signoff[@]}") ||
  { show_logs; fail "submission failed"; }
echo "$submitted"
merge_job=$(sed -n 's/^merge_job=//p' <<< "$submitted")
state=""
for _ in $(seq 600); do
  state=$(scontrol show job "$merge_job" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
  case $state in COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL|OUT_OF_MEMORY) break ;; esac
  sleep 0.5
done
[ "$state" = COMPLETED ] || { show_logs; fail "merge job $merge_job ended $state"; }
for index in $(seq 1 "$shards"); do
  grep -h '^shard ' "$work/run/logs/shard-$index.out"
done

# --- the unsharded check, the same options (one thread, as every task had) -------------------
"$kvaudit" check "$dump" --threads 1 "${signoff[@]}" --signing-key "$work/key" \
  --report "$work/unsharded-report" --json "$work/unsharded.json" > "$work/unsharded.out" 2>&1 ||
  fail "the unsharded check failed: $(tail -n 3 "$work/unsharded.out")"
merged=$work/run/report/report.json
"$kvaudit" verify-report "$work/run/report" --public-key "$work/key.pub" ||
  { show_logs; fail "the merged report's signature does not verify"; }
echo "slurm_array: python3 scripts/same_report.py unsharded.json run/report/report.json"
python3 "$root/scripts/same_report.py" "$work/unsharded.json" "$merged" ||
  { show_logs; fail "the merged report differs from the unsharded one"; }
parts=$(python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1]))["provenance"]["merged_from"]))' "$merged")
[ "$parts" = "$shards" ] || fail "the merged report names $parts parts, not $shards"
echo "slurm_array: PASSED: the merged report of $shards Slurm array tasks equals the unsharded one"
