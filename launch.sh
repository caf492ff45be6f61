#!/usr/bin/env bash
# Thin torchrun wrapper around trainer/main.py.
#
#   ./launch.sh                                   # the embedded default: +experiment=debug
#   ./launch.sh +experiment=38m_ddp training.steps=50
#   NPROC=4 ./launch.sh +experiment=debug parallelism.dp_replicate=2 parallelism.dp_shard=2
#   NNODES=4 NODE_RANK=$i RDZV_ENDPOINT=host0:29500 ./launch.sh +experiment=7b_hsdp
#   FT_GROUPS=2 NPROC=1 ./launch.sh +experiment=debug   # fault tolerance: a lighthouse + 2 replica groups
#
# NPROC defaults to the number of visible GPUs, else 2 CPU ranks (gloo). Multi-node without
# a scheduler: run the same command on every node with NNODES, NODE_RANK (0..NNODES-1) and
# RDZV_ENDPOINT=<host of node 0>:<free port> (RDZV_ID names the run; any string shared by the
# nodes). `kill -USR1` or `kill -TERM` of this script's torchrun checkpoints and stops the run.
set -euo pipefail
cd "$(dirname "$0")"

if [[ -z "${NPROC:-}" ]]; then
  NPROC=0
  if command -v nvidia-smi >/dev/null 2>&1; then
    NPROC=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
  fi
  if [[ -n "${FT_GROUPS:-}" ]]; then   # ranks per replica group: the GPUs shared out, else 1 CPU rank
    NPROC=$(( NPROC / FT_GROUPS ))
    [[ "$NPROC" -gt 0 ]] || NPROC=1
  fi
  [[ "$NPROC" -gt 0 ]] || NPROC=2
fi
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
RDZV_ENDPOINT=${RDZV_ENDPOINT:-localhost:0}

if [[ $# -eq 0 ]]; then
  set -- +experiment=debug
fi

# CPU ranks share the cores: one thread each avoids oversubscription.
if [[ -z "${OMP_NUM_THREADS:-}" ]]; then
  export OMP_NUM_THREADS=1
fi

# Preemption (trainer/resilience/preemption.py): torchrun forwards SIGTERM to its workers, and SIGUSR1
# (Slurm's "time is nearly up" warning) too once it is listed here; each worker then finishes
# its step, all of them checkpoint together and exit with status 75. torchrun waits
# TORCH_ELASTIC_SHUTDOWN_TIMEOUT seconds (default 30) for that before it kills them.
# (PET_SIGNALS_TO_HANDLE is torchrun's --signals-to-handle; older releases read the other name.)
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCHELASTIC_SIGNALS_TO_HANDLE=${TORCHELASTIC_SIGNALS_TO_HANDLE:-$PET_SIGNALS_TO_HANDLE}

# With torchrun restarts (TORCHRUN_ARGS="--max-restarts=N"), restarted gloo workers can fail to
# reconnect to the shared rendezvous store (pytorch/pytorch#135712): give them their own.
if [[ "${TORCHRUN_ARGS:-}" == *max[-_]restarts* ]]; then
  export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
fi

# Fault tolerance (README "Fault tolerance"): a torchft lighthouse and FT_GROUPS replica groups of
# NPROC ranks each, every group its own torchrun, supervised by trainer/resilience/supervisor.py
# (restart loop with a fresh torchrun per incarnation, hang watchdog). FT_LIGHTHOUSE_PORT (29510)
# and FT_ARGS (supervisor options, e.g. "--max-restarts 5") tune it. One machine: the lighthouse and
# the groups' servers listen on localhost only; the supervisor writes the job's secret (mode 600,
# README "What fault tolerance trusts") and removes it at exit.
if [[ -n "${FT_GROUPS:-}" ]]; then
  exec python -m trainer.resilience.supervisor --groups "$FT_GROUPS" --nproc "$NPROC" --start-lighthouse \
    --lighthouse "http://localhost:${FT_LIGHTHOUSE_PORT:-29510}" --address localhost --new-secret \
    ${FT_ARGS:-} -- "$@"
fi

if [[ "$NNODES" -gt 1 ]]; then
  exec torchrun --nnodes="$NNODES" --node_rank="$NODE_RANK" --nproc_per_node="$NPROC" \
    --rdzv_backend=c10d --rdzv_endpoint="$RDZV_ENDPOINT" --rdzv_id="${RDZV_ID:-meshwright}" \
    ${TORCHRUN_ARGS:-} trainer/main.py "$@"
fi
exec torchrun --standalone --nproc_per_node="$NPROC" ${TORCHRUN_ARGS:-} trainer/main.py "$@"
