"""Training backends (fsdp, megatron). Importing this package does not import torch."""
