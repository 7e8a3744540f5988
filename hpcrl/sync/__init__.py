"""How new weights reach the rollout engines, below both sides: the trainer ranks send and the engines
receive through it (``broadcast``: a process group of its own, bucketed). The driver only chooses and
starts a transport (``run.fleet``)."""
