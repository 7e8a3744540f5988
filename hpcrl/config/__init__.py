"""The run's configuration: typed schemas (``schema``, with the cluster and model catalog schemas
``cluster``/``model`` it is built from), composition of ``conf/`` and the site's files (``compose``;
``fastcompose`` is the Hydra-free path; ``paths`` says where they are, ``site`` reads site.yaml), checks
(``checks`` for single values, ``preflight`` for what needs a registry, the model or this machine), the
``eval.*`` schema (``eval``) and what ``hpcrl init`` reads of Slurm (``slurminfo``). Pure Python: no torch, ray or vllm."""
