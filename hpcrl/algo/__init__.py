"""GRPO/DAPO pieces: advantages, losses, sampling filters. Pure functions over tensors."""
