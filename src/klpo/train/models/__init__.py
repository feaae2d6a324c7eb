"""The models: loading, the backbone and critic, LoRA, FSDP, and moving the reference."""
