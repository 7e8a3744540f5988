"""The run's configuration: typed schemas (``schema``, with the cluster and model catalog schemas
``cluster``/``model`` it is built from), composition of ``conf/`` (``compose``; ``fastcompose`` is the
Hydra-free path) and small value checks (``checks``). Pure Python: no torch, ray or vllm."""
