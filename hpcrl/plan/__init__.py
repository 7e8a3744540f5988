"""From a composed config to a checked plan: model quirks (``quirks``), the frozen topology
(``topology``), the per-GPU memory estimate (``memory``), the plan itself (``planner``) and its
rendering for people (``show``). Pure Python: no torch, ray or vllm."""
