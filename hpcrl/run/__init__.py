"""Inside the run: the driver (``driver``), the GRPO/DAPO loop (``loop``), the Ray actors (``actors``)
and the driver's handle on them (``fleet``), weight sync, checkpoints, metrics, preemption, run
directories (``rundir``, torch-free: the launch side writes them too) and the tiny model."""
