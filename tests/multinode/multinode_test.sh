#!/usr/bin/env bash
# Runs across two hosts (hosts.sh: network namespaces with their own hostnames and
# cores, Open MPI over TCP between them), against the same runs on one host.
# Usage: multinode_test.sh MPIPE CASE    (CASE: setup cleanup bitwise grid resume host-lost lock threads)
# Exit 77 (skipped) where network namespaces cannot be made (not root, no CAP_NET_ADMIN).
set -euo pipefail
mpipe=$(readlink -f "$1")
case_name=$2
here=$(cd "$(dirname "$0")" && pwd)
hosts=$here/hosts.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
work=$(mktemp -d /tmp/mpipe-multinode-XXXXXX)
pid=  # a job in the background, ended with what it started in the hosts if the test stops early
cleanup() {
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    kill -9 "$pid" 2>/dev/null
    for h in $(bash "$hosts" names 2>/dev/null); do bash "$hosts" kill "$h" 2>/dev/null; done
  fi
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "FAIL ($case_name): $*"; exit 1; }

if [[ $case_name == setup ]]; then
  # Skipped where network namespaces cannot be made at all (not root, no CAP_NET_ADMIN);
  # where they can, the hosts must come up.
  probe=mpipe-probe-$$
  if [[ $(id -u) != 0 ]] || ! ip netns add "$probe" 2> "$work/probe.log"; then
    echo "SKIP: no network namespaces here (root and CAP_NET_ADMIN needed): $(cat "$work/probe.log" 2>/dev/null)"
    exit 77
  fi
  ip netns del "$probe"
  bash "$hosts" up 2 > "$work/up.log" 2>&1 || fail "hosts.sh up 2: $(tail -3 "$work/up.log")"
  echo "hosts: $(bash "$hosts" names | tr '\n' ' ')"
  exit 0
fi
if [[ $case_name == cleanup ]]; then
  [[ $(id -u) == 0 ]] && command -v ip > /dev/null || { echo "SKIP: no hosts to remove (not root)"; exit 77; }
  bash "$hosts" down
  exit 0
fi
[[ $(bash "$hosts" names 2>/dev/null | wc -l) -ge 2 ]] || { echo "SKIP: no test hosts (the setup test was skipped)"; exit 77; }
mapfile -t names < <(bash "$hosts" names)
h1=${names[0]} h2=${names[1]}

mapfile -t across < <(bash "$hosts" mpirun-args)
# A small GPT: embedding and head tied across the first and last stage.
model=(--layers 4 --d-model 32 --heads 2 --seq-len 16 --vocab 64 --batch-size 8 --micro-batches 4 --threads 1
       --seed 7 --log-every 1)
# try NAME WHERE RANKS [options]: WHERE is "one" (this host) or "two" (h1 and h2, RANKS/2
# each); the log in $work/NAME.log. run: the same, which must succeed.
try() {
  local name=$1 where=$2 ranks=$3; shift 3
  local launch=(mpirun -n "$ranks" --oversubscribe -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS)
  [[ $where == two ]] && launch+=("${across[@]}" --host "$h1:$((ranks / 2)),$h2:$((ranks / 2))")
  timeout 120 "${launch[@]}" "$mpipe" train "${model[@]}" --p2p-timeout 5 "$@" > "$work/$name.log" 2>&1
}
run() { try "$@" || fail "$1 exited $?: $(grep -m3 "error" "$work/$1.log")"; }
same() {  # two checkpoints' parameters and optimizer state, bitwise
  h5diff "$1" "$2" /model /model > /dev/null || fail "/model of $(basename "$(dirname "$1")") and $(basename "$(dirname "$2")") differ"
  h5diff "$1" "$2" /optimizer /optimizer > /dev/null || fail "/optimizer of $1 and $2 differ"
}
on_hosts() {  # the run's log says its ranks ran on both hosts
  grep -q "^2 hosts: $h1 rank" "$work/$1.log" && grep -q ", $h2 rank" "$work/$1.log" \
    || fail "$1 did not run on $h1 and $h2: $(grep -m1 hosts "$work/$1.log" || echo no hosts line)"
}

case $case_name in
  bitwise)  # K = 2 over two hosts, bitwise K = 1 on one
    run k1 one 1 --steps 4 --checkpoint-dir "$work/k1" --checkpoint-every 4
    run k2 two 2 --steps 4 --checkpoint-dir "$work/k2" --checkpoint-every 4
    on_hosts k2
    grep -q "^grid: 1 replica x 2 stages" "$work/k2.log" || fail "k2 is not 2 stages"
    same "$work/k1/ckpt-00000004.h5" "$work/k2/ckpt-00000004.h5"
    # mpirun's keepalives given (hosts.sh's options): no note; without them, the note says
    # how late a lost node would end the job (Open MPI's defaults: 300 + 20 x 9 s, later
    # than --p2p-timeout 5 + 5 s; with the default 600 s the keepalives come first).
    ! grep -q "^note: across hosts" "$work/k2.log" || fail "a note about keepalives that were given"
    plain=()
    for ((i = 0; i < ${#across[@]}; i++)); do
      if [[ ${across[i]} == --mca && ${across[i + 1]} == oob_tcp_keepalive_* ]]; then ((i += 2)); continue; fi
      plain+=("${across[i]}")
    done
    timeout 60 mpirun -n 2 -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "${plain[@]}" --host "$h1:1,$h2:1" "$mpipe" train \
      "${model[@]}" --p2p-timeout 5 --steps 1 > "$work/plain.log" 2>&1 || fail "plain: $(tail -2 "$work/plain.log")"
    grep -q "^note: across hosts, a node that goes silent .* 480 s after it goes silent here" "$work/plain.log" \
      || fail "no note about mpirun's keepalives: $(grep -m1 "^note" "$work/plain.log")"
    echo "ok: K=2 over $h1 and $h2 is bitwise K=1 on one host; the keepalive note where they are not given" ;;

  grid)  # D = 2 x K = 2: replicas across hosts, stages across hosts, one host
    run one one 4 --replicas 2 --steps 3 --checkpoint-dir "$work/one" --checkpoint-every 3
    run pipe two 4 --replicas 2 --rank-order pipeline --steps 3 --checkpoint-dir "$work/pipe" --checkpoint-every 3
    run data two 4 --replicas 2 --rank-order data --steps 3 --checkpoint-dir "$work/data" --checkpoint-every 3
    run auto two 4 --replicas 2 --steps 3 --checkpoint-dir "$work/auto" --checkpoint-every 3
    on_hosts pipe && on_hosts data
    # This model's replica sums outweigh its boundaries: auto puts the stages across hosts.
    grep -q "^rank order data (--rank-order auto; bytes a step sends out of its busiest host: pipeline order" "$work/auto.log" \
      || fail "auto did not choose the data order: $(grep -m1 "rank order" "$work/auto.log")"
    same "$work/one/ckpt-00000003.h5" "$work/auto/ckpt-00000003.h5"
    # pipeline order: a replica's two stages on one host, its replica on the other; data
    # order: a stage's two replicas on one host, the next stage on the other.
    grep -q "rank order pipeline" "$work/pipe.log" && grep -q "rank order data" "$work/data.log" || fail "rank orders"
    same "$work/one/ckpt-00000003.h5" "$work/pipe/ckpt-00000003.h5"
    same "$work/one/ckpt-00000003.h5" "$work/data/ckpt-00000003.h5"
    echo "ok: D=2 x K=2 across hosts, both rank orders and auto (data), bitwise one host" ;;

  resume)  # a host killed mid-run; resumed across the hosts; bitwise an uninterrupted run
    # A constant learning rate after the warm-up: the cut run's --steps leaves no mark.
    model+=(--lr-schedule constant --warmup 2)
    launch=(mpirun -n 2 -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "${across[@]}" --host "$h1:1,$h2:1")
    "${launch[@]}" "$mpipe" train "${model[@]}" --p2p-timeout 5 --steps 100000 --d-model 64 --seq-len 64 \
      --checkpoint-dir "$work/cut" --checkpoint-every 2 > "$work/cut.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do [[ -f $work/cut/ckpt-00000004.h5 ]] && break; sleep 0.1; done
    [[ -f $work/cut/ckpt-00000004.h5 ]] || { fail "no checkpoint at step 4: $(tail -3 "$work/cut.log")"; }
    bash "$hosts" kill "$h2"
    rc=0; timeout 30 tail --pid=$pid -f /dev/null || rc=$?
    wait $pid && fail "the job went on after $h2 was killed" || true
    ((rc == 0)) || fail "mpirun did not end within 30 s of losing $h2"
    for f in "$work"/cut/ckpt-*.h5; do "$mpipe" inspect --verify "$f" > /dev/null || fail "$f does not verify"; done
    # Resumed 8 steps past the newest checkpoint on the two hosts, against as many
    # uninterrupted steps on one (the kill may come some steps after step 4: on a loaded
    # machine the run had reached step 14 when a fixed target of 12 was asked for).
    newest=$(ls "$work"/cut/ckpt-*.h5 | tail -1)
    target=$((10#$(basename "$newest" .h5 | sed 's/ckpt-//') + 8))
    final=$(printf 'ckpt-%08d.h5' "$target")
    run ref one 1 --steps "$target" --d-model 64 --seq-len 64 --checkpoint-dir "$work/ref" --checkpoint-every "$target"
    run again two 2 --steps "$target" --d-model 64 --seq-len 64 --checkpoint-dir "$work/cut" --checkpoint-every "$target" --resume auto
    on_hosts again
    grep -q "resumed from $newest" "$work/again.log" || fail "did not resume from $newest: $(grep -m1 resumed "$work/again.log")"
    same "$work/ref/$final" "$work/cut/$final"
    echo "ok: $h2 killed after step $(basename "$newest" .h5 | sed 's/ckpt-0*//'), resumed across hosts, bitwise an uninterrupted run" ;;

  host-lost)  # a host's link down mid-step: a line naming the rank and its host, promptly;
    # its processes killed (its Open MPI daemon too): Open MPI names the host, as promptly.
    # HOST_LOST_TRIALS=N: N trials of the link (2), then one of the kill.
    timeout_s=3
    for trial in $(seq "${HOST_LOST_TRIALS:-2}") kill; do
      dir=$work/lost$trial
      launch=(mpirun -n 2 -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "${across[@]}" --host "$h1:1,$h2:1")
      "${launch[@]}" "$mpipe" train "${model[@]}" --p2p-timeout $timeout_s --steps 100000 --log-every 1000 \
        --checkpoint-dir "$dir" --checkpoint-every 20 > "$work/lost.out" 2> "$work/lost.err" &
      pid=$!
      for _ in $(seq 300); do [[ -f $dir/ckpt-00000040.h5 ]] && break; sleep 0.1; done
      [[ -f $dir/ckpt-00000040.h5 ]] || { fail "no checkpoint at step 40: $(tail -3 "$work/lost.err")"; }
      sleep 0.$((RANDOM % 10))
      start=$(date +%s.%N)
      if [[ $trial == kill ]]; then bash "$hosts" kill "$h2"; else bash "$hosts" link "$h2" down; fi
      rc=0; timeout 30 tail --pid=$pid -f /dev/null || rc=$?
      took=$(echo "$(date +%s.%N) - $start" | bc)
      bash "$hosts" link "$h2" up
      # What the lost host still runs (its daemon and rank, cut off) goes, as a rebooted
      # node's would, before the next trial.
      bash "$hosts" kill "$h2"
      wait $pid && fail "the job went on after losing $h2 ($trial)" || true
      ((rc == 0)) || fail "mpirun did not end within 30 s of losing $h2 ($trial)"
      (($(echo "$took <= $timeout_s + 5" | bc))) || fail "ended after $took s (--p2p-timeout $timeout_s)"
      for f in "$dir"/ckpt-*.h5; do "$mpipe" inspect --verify "$f" > /dev/null || fail "$f does not verify"; done
      if [[ $trial == kill ]]; then
        grep -q "lost communication with a remote daemon" "$work/lost.err" && grep -Eq "on node +$h2$" "$work/lost.err" \
          || fail "Open MPI did not name $h2: $(head -5 "$work/lost.err")"
        echo "ok: $h2's processes killed, ended in $took s, Open MPI names $h2"
        continue
      fi
      # Who speaks first: mpipe's heartbeats (--p2p-timeout) name the rank and its host,
      # or mpirun's keepalives (~2 s, hosts.sh) find the daemon gone and name the host;
      # usually both. Never a second mpipe line, and never a line naming another host.
      [[ $(grep -c "^mpipe: error" "$work/lost.err") -le 1 ]] || fail "more than one error line: $(grep "mpipe: error" "$work/lost.err")"
      if grep -q "^mpipe: error" "$work/lost.err"; then
        # (or, lost just before a checkpoint's rendezvous: "did not reach checkpoint step N")
        grep -Eq "^mpipe: error: rank 1 on $h2 (stopped answering|did not reach)" "$work/lost.err" \
          || fail "rank 1 on $h2 not named: $(grep -m1 "mpipe: error" "$work/lost.err")"
        said=$(grep -m1 "mpipe: error" "$work/lost.err" | cut -c1-70)
      else
        grep -q "lost communication with a remote daemon" "$work/lost.err" && grep -Eq "on node +$h2$" "$work/lost.err" \
          || fail "neither mpipe nor Open MPI named $h2: $(head -5 "$work/lost.err")"
        said="Open MPI: lost communication with the daemon on $h2"
      fi
      echo "ok: trial $trial: $h2's link down, ended in $took s: $said"
    done ;;

  lock)  # the lock names rank 0's host; a dead job's lock there is taken over
    launch=(mpirun -n 2 -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "${across[@]}" --host "$h1:1,$h2:1")
    "${launch[@]}" "$mpipe" train "${model[@]}" --p2p-timeout 5 --steps 100000 --checkpoint-dir "$work/lk" \
      --checkpoint-every 50 > "$work/lk.log" 2>&1 &
    pid=$!
    for _ in $(seq 300); do [[ -f $work/lk/ckpt-00000050.h5 ]] && break; sleep 0.1; done
    lock=$(cat "$work/lk/.mpipe.lock" 2>/dev/null) || { fail "no lock file"; }
    grep -q "^host=$h1 pid=" <<<"$lock" || { fail "the lock does not name $h1: $lock"; }
    # Another job on the same directory is refused, naming the holder's host.
    try other two 2 --steps 1 --checkpoint-dir "$work/lk" && fail "a second job took a live lock"
    grep -q "in use by another job (host $h1, pid" "$work/other.log" || fail "refusal: $(grep -m1 error "$work/other.log")"
    bash "$hosts" kill "$h1"
    timeout 30 tail --pid=$pid -f /dev/null || fail "mpirun did not end after $h1 was killed"
    wait $pid || true
    [[ -f $work/lk/.mpipe.lock ]] || fail "a killed job left no lock (test expects one)"
    done_steps=$(ls "$work"/lk/ckpt-*.h5 | tail -1 | sed 's/.*ckpt-0*//; s/\.h5//')
    run after two 2 --steps $((done_steps + 2)) --checkpoint-dir "$work/lk" --resume auto
    grep -q "taking over the lock of a job that is gone (host $h1, pid" "$work/after.log" \
      || fail "the dead job's lock was not taken over: $(grep -m1 -E "lock|error" "$work/after.log")"
    echo "ok: the lock names $h1; refused while live, taken over once that host's job is gone" ;;

  threads)  # threads per rank from the node-local rank count (hosts not pinned: all cores)
    export MPIPE_HOSTS_NO_PIN=1
    cores=$(nproc --all)
    model=(--layers 2 --d-model 32 --heads 2 --seq-len 16 --vocab 64 --batch-size 8 --micro-batches 2 --threads 0)
    run two_one two 2 --steps 1
    grep -q "$cores thread" "$work/two_one.log" || fail "one rank per host should use its $cores cores: $(grep -m1 "per rank" "$work/two_one.log")"
    launch=(mpirun -n 2 -x OMP_NUM_THREADS -x OPENBLAS_NUM_THREADS "${across[@]}" --host "$h1:2")
    timeout 60 "${launch[@]}" "$mpipe" train "${model[@]}" --steps 1 > "$work/one_two.log" 2>&1 || fail "one_two: $(tail -2 "$work/one_two.log")"
    want=$((cores / 2 > 0 ? cores / 2 : 1))
    grep -q " $want thread" "$work/one_two.log" || fail "two ranks on one host should share its cores: $(grep -m1 "per rank" "$work/one_two.log")"
    echo "ok: $cores threads per rank with one rank per host, $want with two on one host" ;;

  *) fail "unknown case" ;;
esac
