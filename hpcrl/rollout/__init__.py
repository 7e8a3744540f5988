"""Rollout backends (vllm, hf). Importing this package does not import vllm or torch."""
