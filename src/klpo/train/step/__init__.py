"""One training step's parts: scoring, the update, the after-step control and the step's metrics."""
