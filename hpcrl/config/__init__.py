"""The run's configuration: typed schemas (``schema``, with the cluster and model catalog schemas
``cluster``/``model`` it is built from, and ``eval`` for ``hpcrl eval``), composition of ``conf/`` and the
site's files (``compose``; ``fastcompose`` is the Hydra-free path; ``paths`` says where they are, ``site``
reads site.yaml), the checks that need a registry, the model or this machine (``preflight``; single values
are ``core/checks.py``'s) and what ``hpcrl init`` reads of Slurm (``slurminfo``). Pure Python: no torch,
ray or vllm."""
