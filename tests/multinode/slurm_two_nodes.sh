#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine: two test hosts of hosts.sh (network
# namespaces mps1 and mps2 with their own hostnames, one core each), each running its own
# slurmd, and slurmctld in the root namespace on the bridge's address. It runs the
# project's multi-node script slurm/train.sbatch with -N 2 (srun --mpi=pmix puts one
# pipeline stage on each node; Open MPI moves activations over TCP on the bridge), then
# sends a second such job SIGTERM mid-run: mpipe checkpoints and exits 75, the script
# requeues the job, and it resumes on both nodes and ends bitwise equal to the first,
# uninterrupted job. There are no GPUs here: the jobs ask for none (--gpus-per-task=0, one
# task and one CPU per node) and mpipe gets --device cpu after the script's --device cuda
# (the last one wins). Stops only the daemons it started and removes its hosts.
# Usage: slurm_two_nodes.sh MPIPE
# Environment: SLURM2_PREFIX (mps: hosts mps1, mps2), SLURM2_NET (10.214.0), SLURM2_PORT
# (16827: slurmctld's port; slurmd's is the next).
#
# Two things differ from one machine's single slurmd (tests/slurm/slurm_test.sh):
# - slurmd enters its host with nsenter --net, not ip netns exec: the latter mounts a new
#   /sys without /sys/fs/cgroup, and slurmd 22.05 then stops ("No filesystem mounted on
#   /sys/fs/cgroup", "Unable to initialize cgroup plugin").
# - Each slurmd has its own TmpFS (a private directory bound there in its own mount
#   namespace): mpi/pmix makes TmpFS/spmix_appdir_<uid>_<job>.<step> on every node of a
#   step, and on one shared /tmp the second node fails ("Cannot create directory ...: File
#   exists") and the step with it.
set -euo pipefail
mpipe=$(readlink -f "${1:?usage: slurm_two_nodes.sh MPIPE}")
[[ -x $mpipe ]] || { echo "FAIL: $1 is not an executable"; exit 1; }
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
export MPIPE_HOSTS_PREFIX=${SLURM2_PREFIX:-mps} MPIPE_HOSTS_NET=${SLURM2_NET:-10.214.0}
prefix=$MPIPE_HOSTS_PREFIX net=$MPIPE_HOSTS_NET
ctld_port=${SLURM2_PORT:-16827} slurmd_port=$((${SLURM2_PORT:-16827} + 1))
nodes=("${prefix}1" "${prefix}2")
work=
started=()
hosts_up=0
fail() {
  echo "FAIL: $*"
  local f
  for f in "${work:-/nonexistent}"/*.log; do [[ -f $f ]] && { echo "--- $f"; tail -25 "$f"; }; done
  exit 1
}

source "$here/../slurm/slurm_common.sh"
slurm_install hdf5-tools
command -v nsenter >/dev/null || fail "needs nsenter (util-linux)"
ss -Htln "sport = :$ctld_port" 2>/dev/null | grep -q . \
  && fail "port $ctld_port is taken (a slurmctld left by an earlier run?); set SLURM2_PORT"

cleanup() {
  local pid _
  set +e
  for pid in "${started[@]}"; do kill "$pid" 2>/dev/null; done
  for _ in $(seq 20); do
    alive=0
    for pid in "${started[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    ((alive)) || break
    sleep 0.25
  done
  for pid in "${started[@]}"; do kill -9 "$pid" 2>/dev/null; done
  wait 2>/dev/null
  # Every process left in the hosts (slurmstepd, ranks of a job cut short) goes with them.
  ((hosts_up)) && bash "$here/hosts.sh" down
  [[ -n $work ]] && rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

# Skipped (77) where network namespaces cannot be made at all (not root, no CAP_NET_ADMIN).
probe=mpipe-probe-$$
if [[ $(id -u) != 0 ]] || ! ip netns add "$probe" 2>/dev/null; then
  echo "SKIP: no network namespaces here (root and CAP_NET_ADMIN needed) for the two nodes"
  exit 77
fi
ip netns del "$probe"
# The hosts; a set left by an earlier run that was killed goes first (and any slurmd in it).
hosts_up=1
bash "$here/hosts.sh" down
bash "$here/hosts.sh" up 2 || fail "hosts.sh up 2"

work=$(mktemp -d /tmp/mpipe-slurm2-XXXXXX)
chmod 755 "$work"

munged=$(slurm_munge) || fail "munged did not start"
[[ -z $munged ]] || started+=("$munged")

# slurmctld listens on the bridge's address; the nodes by their addresses on the bridge
# (no name resolution needed: slurmd is told its node name, NodeAddr is an address).
# %n: the node's name, so that the two slurmd on one file system keep apart.
mkdir -p "$work/state" "$work/nodetmp"
for h in "${nodes[@]}"; do mkdir -p "$work/spool-$h" "$work/tmp-$h"; done
cat > "$work/slurm.conf" <<CONF
ClusterName=mpipetest2
SlurmctldHost=$(hostname -s)($net.254)
SlurmctldPort=$ctld_port
SlurmdPort=$slurmd_port
SlurmdSpoolDir=$work/spool-%n
TmpFS=$work/nodetmp
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd-%n.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd-%n.log
NodeName=${prefix}[1-2] NodeAddr=$net.[1-2] CPUs=1 State=UNKNOWN
$(slurm_conf_common "$work")
CONF
export SLURM_CONF=$work/slurm.conf
/usr/sbin/slurmctld -D -i -f "$SLURM_CONF" > "$work/slurmctld.out.log" 2>&1 < /dev/null &
started+=($!)
# Each slurmd in its host: its network namespace, its hostname (a new UTS namespace), its
# core (taskset, inherited by the job's tasks: mpipe's --threads 0 sees one) and its own
# TmpFS (a new mount namespace). The execs keep $! the slurmd's pid.
for h in "${nodes[@]}"; do
  nsenter --net="/run/netns/$h" taskset -c "$(cat "/run/mpipe-hosts/$prefix/$h.cpus")" \
    unshare --uts --mount --propagation private /bin/sh -c \
    'hostname "$1" && mount --bind "$2/tmp-$1" "$2/nodetmp" && exec /usr/sbin/slurmd -D -N "$1" -f "$3"' \
    sh "$h" "$work" "$SLURM_CONF" > "$work/slurmd-$h.out.log" 2>&1 < /dev/null &
  started+=($!)
done
idle() { [[ $(sinfo -h -N -o '%N %T' 2>/dev/null | grep -c ' idle$') -eq 2 ]]; }
for _ in $(seq 80); do idle && break; sleep 0.25; done
idle || fail "the two nodes did not come up: $(sinfo -N 2>&1)"
hosts=$(srun -N 2 --ntasks-per-node=1 hostname 2>&1 | sort | tr '\n' ' ') || fail "srun hostname: $hosts"
[[ $hosts == "${nodes[0]} ${nodes[1]} " ]] || fail "srun -N 2 hostname gave: $hosts"
echo "slurm2: two slurmd up, ${nodes[0]} ($net.1) and ${nodes[1]} ($net.2); srun -N 2 hostname: $hosts"

cd "$root"
# What sbatch passes on (it exports this environment): Open MPI on the bridge.
export MPIPE=$mpipe OMPI_MCA_btl_tcp_if_include=$net.0/24 OMPI_MCA_oob_tcp_if_include=$net.0/24 \
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
slurm_small_config "$work/small.toml" 128 64
steps=150
# train.sbatch's GPU shape, made what these nodes have: one task of one CPU a node, no GPUs.
shape=(-N 2 --ntasks-per-node=1 --cpus-per-task=1 --gpus-per-task=0)
args=("$work/small.toml" --steps "$steps" --device cpu)
link_bytes() {  # bytes through mps2's link, both ways
  echo $(( $(cat "/sys/class/net/${prefix}v2/statistics/rx_bytes") + $(cat "/sys/class/net/${prefix}v2/statistics/tx_bytes") ))
}
# Until JOB has left the queue, ended with exit code 0 (sbatch --wait polls at up to 32 s).
wait_job() {
  for _ in $(seq 480); do squeue -h -j "$1" 2>/dev/null | grep -q . || break; sleep 0.25; done
  squeue -h -j "$1" 2>/dev/null | grep -q . && fail "job $1 did not finish"
  scontrol show job "$1" | grep -q " ExitCode=0:0" || fail "job $1: $(scontrol show job "$1" | grep -o 'JobState=.*')"
}
launched() {  # launched JOB NODE: how often JOB's step 0 was launched on NODE
  grep -c "launch task StepId=$1\.0 " "$work/slurmd-$2.log" || true
}

# 1. train.sbatch with -N 2, uninterrupted: the reference.
before=$(link_bytes)
ref=$(CHECKPOINT_DIR=$work/ckpt-ref sbatch --parsable "${shape[@]}" -o "$work/ref.log" slurm/train.sbatch \
  "${args[@]}") || fail "sbatch: $ref"
wait_job "$ref"
moved=$(( $(link_bytes) - before ))
grep -q "^mpipe job $ref (restart 0) on ${prefix}\[1-2\]" "$work/ref.log" || fail "job $ref did not get both nodes"
grep -q "grid: 1 replica x 2 stages = 2 ranks" "$work/ref.log" || fail "job $ref did not run 2 stages"
grep -q "^device: cpu" "$work/ref.log" || fail "job $ref did not train on the CPU"
grep -Eq "step +$steps/$steps " "$work/ref.log" || fail "no final step in job $ref's output"
for h in "${nodes[@]}"; do
  [[ $(launched "$ref" "$h") -eq 1 ]] || fail "job $ref's training step was not launched on $h"
done
# Activations and gradients between the stages crossed the bridge: ~64 KiB a message,
# 4 each way a step (8 in all).
((moved > steps * 8 * 60000)) || fail "only $moved bytes crossed ${prefix}2's link during job $ref"
"$mpipe" inspect --verify "$work/ckpt-ref/ckpt-$(printf %08d "$steps").h5" > /dev/null \
  || fail "job $ref's checkpoint does not verify"
echo "slurm2: train.sbatch -N 2 ok (job $ref: a stage on each of ${nodes[0]} and ${nodes[1]}," \
  "$((moved / 1000000)) MB over the bridge)"

# 2. The same job, sent SIGTERM mid-run: checkpoint, exit 75, requeue, resume on both
# nodes, finish. Steps of 25 ms or more (~60 ms here: TCP between the hosts, one core
# each): the signal lands mid-run however late the log shows them.
job=$(CHECKPOINT_DIR=$work/ckpt-pre sbatch --parsable "${shape[@]}" -o "$work/pre.log" slurm/train.sbatch \
  "${args[@]}") || fail "sbatch: $job"
for _ in $(seq 240); do grep -Eq "step +3/$steps " "$work/pre.log" 2>/dev/null && break; sleep 0.25; done
grep -Eq "step +3/$steps " "$work/pre.log" || fail "job $job never started training"
scancel --signal=TERM "$job"
for _ in $(seq 240); do grep -q "requeueing job" "$work/pre.log" 2>/dev/null && break; sleep 0.25; done
grep -q "requeueing job $job" "$work/pre.log" || fail "job $job was not requeued"
slurm_release_requeued "$job"
wait_job "$job"
grep -q "stop signal received" "$work/pre.log" || fail "mpipe did not see the signal"
stopped=$(ls "$work/ckpt-pre" | grep -v "ckpt-$(printf %08d "$steps").h5" | grep -m1 '^ckpt-.*\.h5$' || true)
[[ -n $stopped ]] || fail "no checkpoint from the stopped run of job $job: $(ls "$work/ckpt-pre")"
grep -q "^mpipe job $job (restart 1) on ${prefix}\[1-2\]" "$work/pre.log" \
  || fail "the requeued job $job did not run again on both nodes"
grep -q "resumed from .*ckpt-pre/$stopped" "$work/pre.log" || fail "job $job did not resume from $stopped"
grep -Eq "step +$steps/$steps " "$work/pre.log" || fail "the resumed job $job did not finish"
for h in "${nodes[@]}"; do
  [[ $(launched "$job" "$h") -eq 2 ]] || fail "job $job's training step did not run twice on $h"
done
echo "slurm2: SIGTERM, checkpoint $stopped, exit 75, requeue, resume on both nodes ok (job $job)"

# 3. Exactly the uninterrupted run: the final weights and optimizer state, bit for bit,
# and the last step's loss.
final=ckpt-$(printf %08d "$steps").h5
[[ -f $work/ckpt-pre/$final ]] || fail "no final checkpoint after resuming"
for g in /model /optimizer; do
  h5diff -q "$work/ckpt-ref/$final" "$work/ckpt-pre/$final" "$g" "$g" > "$work/h5diff.out" 2>&1 \
    || fail "the resumed run's $g differs from the uninterrupted one's: $(head -5 "$work/h5diff.out")"
done
lossof() { grep -E "step +$steps/$steps " "$1" | tail -1 | grep -o 'loss [0-9.]*'; }
[[ -n $(lossof "$work/ref.log") && $(lossof "$work/ref.log") == $(lossof "$work/pre.log") ]] \
  || fail "final loss: $(lossof "$work/ref.log") uninterrupted, $(lossof "$work/pre.log") resumed"
echo "slurm2: the resumed job equals the uninterrupted one (h5diff /model /optimizer, $(lossof "$work/pre.log"))"
