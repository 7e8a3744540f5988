"""hpcrl: Slurm-native GRPO/DAPO post-training for LLMs.

Layers as folders, top to bottom: ``cli`` -> ``launch`` (local start, sbatch, submit, the in-job
bootstrap) -> ``run`` (driver, loop, actors) -> ``trainer`` / ``rollout`` / ``rewards`` / ``algo`` /
``data`` -> ``plan`` (quirks, topology, memory) -> ``config`` (schemas, composition). ``config``,
``plan`` and ``launch`` import no torch, ray or vllm at module level, so ``hpcrl plan`` and
``render`` start in well under a second (tests/project/test_layout.py holds the rule).
"""

__version__ = "0.1.0"
