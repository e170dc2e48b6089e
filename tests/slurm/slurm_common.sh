# Shared by the Slurm tests (sourced): Debian's packages, munged, and the requeue's start.

# Debian's Slurm and munge (and any further packages named), if missing (scripts/setup.sh
# --test installs them too).
slurm_install() {
  local missing=() pkg
  for pkg in slurmctld slurmd slurm-client munge "$@"; do
    [[ "$(dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null)" == "install ok installed" ]] || missing+=("$pkg")
  done
  if ((${#missing[@]})); then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

# slurm_small_config FILE D_MODEL SEQ_LEN: the jobs' options file, a 2-layer GPT of that width
# and context (batch 8 in 4 micro-batches, a loss line every step).
slurm_small_config() {
  cat > "$1" <<TOML
model = "gpt"
layers = 2
d-model = $2
heads = 4
seq-len = $3
vocab = 64
batch-size = 8
micro-batches = 4
log-every = 1
lr = 0.003
TOML
}

# A working munged: the one running, or one started here, whose pid goes to stdout (the
# daemon's own, not runuser's), for the caller to stop. The key exists after Debian's
# install; /run/munge must belong to munge. Returns 1 when it does not start.
slurm_munge() {
  munge -n >/dev/null 2>&1 && return 0  # a working munged (a dying one does not count)
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  [[ -s /etc/munge/munge.key ]] || runuser -u munge -- /usr/sbin/mungekey --create
  rm -f /run/munge/munged.pid
  runuser -u munge -- /usr/sbin/munged > /dev/null 2>&1 < /dev/null  # not holding $(...) open
  for _ in $(seq 100); do munge -n >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n >/dev/null 2>&1 || return 1
  cat /run/munge/munged.pid
}

# The settings every test cluster shares, for slurm.conf (WORK: its state directory's
# parent): root, munge, PMIx, no cgroups, requeue, one partition of every node.
slurm_conf_common() {
  local work=$1
  cat <<CONF
SlurmUser=root
AuthType=auth/munge
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
StateSaveLocation=$work/state
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
}

# A requeued JOB may start again: Slurm refuses within the second its credential was
# revoked ("Job credential revoked"), then holds it a while; let that second pass, then
# let it start now.
slurm_release_requeued() {
  sleep 2
  for _ in $(seq 40); do scontrol update jobid="$1" StartTime=now 2>/dev/null && break; sleep 0.25; done
}
