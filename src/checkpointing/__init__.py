"""What a run keeps on disk and reads back: atomic checkpoints, resume, integrity checks, the exported model."""
