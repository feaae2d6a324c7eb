"""The commands beside training: make-reference, make-reward-model, export, docs."""
