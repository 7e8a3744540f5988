"""hpcrl: Slurm-native GRPO/DAPO post-training for LLMs.

The package is split so that the command line can plan and render jobs without importing
torch, ray or vllm: everything under ``hpcrl.config``, ``hpcrl.topology``, ``hpcrl.memory``,
``hpcrl.quirks`` and ``hpcrl.launch`` is pure Python.
"""

__version__ = "0.1.0"
