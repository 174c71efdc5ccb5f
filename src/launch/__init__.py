"""From a launch (python, accelerate launch, torchrun, srun, submitit) to an Accelerator: what was asked for,
what cannot work, the banner, and ending the processes cleanly."""
