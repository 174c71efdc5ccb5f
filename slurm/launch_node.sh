#!/bin/bash
# One node's share of a SLURM job: one `accelerate launch` that starts this node's training processes and
# joins the others'. srun runs it once per node (slurm/train_multi_node.sbatch), and so does each job of a
# `hydra/launcher=submitit_slurm` sweep (src/launch/slurm_sweep.py).
#   slurm/launch_node.sh train.py OVERRIDES...
# Processes per node: PROCS_PER_NODE, else the node's GPUs, else 1. The main address: MAIN_HOST:MAIN_PORT,
# by default the job's first host and a port derived from the job id (the sbatch script checks it is free).
set -euo pipefail
PROCS=${PROCS_PER_NODE:-${SLURM_GPUS_ON_NODE:-1}}
MAIN_HOST=${MAIN_HOST:-$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)}
MAIN_PORT=${MAIN_PORT:-$(( 20000 + SLURM_JOB_ID % 20000 ))}  # per-job port: concurrent jobs don't collide
# SLURM_NODEID is this node's own: every node that claimed machine rank 0 would time out the rendezvous.
# `trap "" USR1 USR2` + exec: the launcher ignores the preemption signals (it would die of them); the
# training processes inherit that and install their own handler (src/faults/preemption.py).
trap "" USR1 USR2
LAUNCH=(accelerate launch --num_machines "$SLURM_JOB_NUM_NODES" --machine_rank "$SLURM_NODEID"
        --num_processes $(( SLURM_JOB_NUM_NODES * PROCS ))
        --main_process_ip "$MAIN_HOST" --main_process_port "$MAIN_PORT" --dynamo_backend no)
# accelerate refuses --multi_gpu for one process (a 1-node, 1-GPU or 1-CPU job): that one is a plain launch.
(( SLURM_JOB_NUM_NODES * PROCS > 1 )) && LAUNCH+=(--multi_gpu --rdzv_backend static)
exec "${LAUNCH[@]}" "$@"
