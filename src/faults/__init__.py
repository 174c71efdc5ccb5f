"""What keeps a run alive or ends it cleanly: preemption signals, hung collectives, non-finite losses."""
