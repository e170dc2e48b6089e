#!/usr/bin/env bash
# A real single-node Slurm cluster (munged, slurmctld, slurmd started here, without
# systemd) running the project's own sbatch scripts: a CPU training job, a micro-batch
# sweep array, and a job sent SIGTERM mid-run that is requeued and resumes from its
# checkpoint. Stops only the daemons it started.
# Usage: slurm_test.sh MPIPE
set -euo pipefail
mpipe=$(readlink -f "$1")
root=$(cd "$(dirname "$0")/../.." && pwd)
work=
fail() { echo "FAIL: $*"; for f in "${work:-/nonexistent}"/*.log; do [[ -f $f ]] && { echo "--- $f"; tail -20 "$f"; }; done; exit 1; }

source "$(dirname "$0")/slurm_common.sh"
slurm_install

work=$(mktemp -d /tmp/mpipe-slurm-XXXXXX)
chmod 755 "$work"
started=()
cleanup() {
  for pid in "${started[@]}"; do kill "$pid" 2>/dev/null || true; done
  sleep 1
  for pid in "${started[@]}"; do kill -9 "$pid" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT

munged=$(slurm_munge) || fail "munged did not start"
[[ -z $munged ]] || started+=("$munged")

host=$(hostname -s)
mkdir -p "$work/state" "$work/spool"
cat > "$work/slurm.conf" <<CONF
ClusterName=mpipetest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=16817
SlurmdPort=16818
SlurmdSpoolDir=$work/spool
SlurmctldPidFile=$work/slurmctld.pid
SlurmdPidFile=$work/slurmd.pid
SlurmctldLogFile=$work/slurmctld.log
SlurmdLogFile=$work/slurmd.log
NodeName=$host NodeAddr=127.0.0.1 CPUs=8 State=UNKNOWN
$(slurm_conf_common "$work")
CONF
export SLURM_CONF=$work/slurm.conf
/usr/sbin/slurmctld -D -i -f "$SLURM_CONF" > "$work/slurmctld.out.log" 2>&1 &
started+=($!)
/usr/sbin/slurmd -D -f "$SLURM_CONF" > "$work/slurmd.out.log" 2>&1 &
started+=($!)
for _ in $(seq 60); do
  sinfo -h -o %T 2>/dev/null | grep -qE "^idle" && break
  sleep 0.5
done
sinfo -h -o %T | grep -qE "^idle" || fail "the node did not come up: $(sinfo 2>&1)"
echo "slurm: node $host idle"

cd "$root"
export MPIPE=$mpipe OMPI_MCA_rmaps_base_oversubscribe=1
slurm_small_config "$work/small.toml" 32 16

# 1. The CPU training script, two stages.
CHECKPOINT_DIR=$work/ckpt-cpu sbatch --wait -o "$work/cpu.log" slurm/train-cpu.sbatch "$work/small.toml" --steps 6 \
  > /dev/null || fail "train-cpu.sbatch failed"
grep -q "step      6/6" "$work/cpu.log" || fail "no final step in the CPU job's output"
grep -q "grid: 1 replica x 2 stages = 2 ranks" "$work/cpu.log" || fail "the CPU job did not run 2 stages"
# The job's time left (--time=01:00:00) less a minute, as --time-limit.
grep -Eq "^time limit: 0:5[0-9]:[0-9]{2} \(--time-limit 0:5[0-9]:[0-9]{2}\)" "$work/cpu.log" \
  || fail "the job did not pass its time left as --time-limit"
! grep -q $'\r' "$work/cpu.log" && ! grep -q $'\033' "$work/cpu.log" || fail "the job's log holds the live progress line"
[[ -f "$work/ckpt-cpu/ckpt-00000006.h5" ]] || fail "no checkpoint from the CPU job"
"$mpipe" inspect --verify "$work/ckpt-cpu/ckpt-00000006.h5" > /dev/null || fail "the CPU job's checkpoint does not verify"
echo "slurm: train-cpu.sbatch ok"

# 2. The sweep as a job array, collected into one CSV.
MS="1 2" SWEEP_CSV=$work/sweep.csv MICRO_SIZE=2 sbatch --wait --array=0-1 -o "$work/sweep-%a.log" \
  slurm/sweep-microbatches.sbatch "$work/small.toml" --steps 3 > /dev/null || fail "the sweep array failed"
[[ $(wc -l < "$work/sweep.csv") -eq 3 ]] || fail "sweep CSV: $(cat "$work/sweep.csv")"
grep -q "^2,gpipe,2,1," "$work/sweep.csv" || fail "no M=2 row: $(cat "$work/sweep.csv")"
bash scripts/sweep_microbatches.sh --slurm "$work/small.toml" --ms "1 2" --ranks 2 --micro-size 2 \
  --out "$work/sweep2.csv" -- --steps 3 > "$work/submit.log" || fail "sweep_microbatches.sh --slurm: $(cat "$work/submit.log")"
for _ in $(seq 240); do [[ -z "$(squeue -h 2>/dev/null)" ]] && break; sleep 0.5; done
[[ $(wc -l < "$work/sweep2.csv" 2>/dev/null) -eq 3 ]] || fail "sweep --slurm CSV: $(cat "$work/sweep2.csv" 2>&1)"
echo "slurm: sweep-microbatches.sbatch ok (direct and through sweep_microbatches.sh --slurm)"

# 3. SIGTERM mid-run: checkpoint, exit 75, requeue, resume, finish. The model is sized
# for ~25 ms steps (~12 s in all), so that the signal lands mid-run however late the
# job's output reaches the log.
job=$(CHECKPOINT_DIR=$work/ckpt-pre sbatch --parsable -o "$work/pre.log" slurm/train-cpu.sbatch "$work/small.toml" \
  --d-model 128 --seq-len 64 --steps 500)
for _ in $(seq 240); do grep -q "step      3/500" "$work/pre.log" 2>/dev/null && break; sleep 0.25; done
grep -q "step      3/500" "$work/pre.log" || fail "the job never started training"
scancel --signal=TERM "$job"
for _ in $(seq 240); do grep -q "requeueing job" "$work/pre.log" 2>/dev/null && break; sleep 0.25; done
grep -q "requeueing job" "$work/pre.log" || fail "the job was not requeued"
slurm_release_requeued "$job"
for _ in $(seq 600); do squeue -h -j "$job" 2>/dev/null | grep -q . || break; sleep 0.5; done
squeue -h -j "$job" 2>/dev/null | grep -q . && fail "the requeued job did not finish"
grep -q "stop signal received" "$work/pre.log" || fail "mpipe did not see the signal"
grep -q "resumed from .*ckpt-pre/ckpt-" "$work/pre.log" || fail "the requeued job did not resume from its checkpoint"
grep -q "step    500/500" "$work/pre.log" || fail "the resumed job did not finish"
[[ -f "$work/ckpt-pre/ckpt-00000500.h5" ]] || fail "no final checkpoint after resuming"
echo "slurm: SIGTERM, requeue and resume ok"
