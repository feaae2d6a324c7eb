"""What a run needs around its steps: processes, checkpoints, metrics, signals, progress, the report."""
