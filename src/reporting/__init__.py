"""What a run tells people: train.log and config.yaml, TensorBoard and other trackers, the progress bar,
throughput and memory telemetry."""
