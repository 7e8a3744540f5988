"""The login-node tools, one module per command beside ``plan``/``submit``: ``hpcrl eval`` (``evaluate``,
``eval_target``, ``eval_job``), ``export``, ``plot``, ``init`` (``siteinit``), ``doctor`` across a job's
nodes (``doctor_run``; the checks themselves are ``launch/doctor.py``, which every job runs), ``submit -m``
sweeps (``sweep``) and ``fetch``. Nothing below imports this folder; each module imports torch, if at all,
only where a command needs it (``export`` at module level: ``cli`` imports it inside the command)."""
