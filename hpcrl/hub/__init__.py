"""The Hugging Face cache: where models and ``hf:`` data sets are fetched to (``hpcrl fetch``, on a login
node) and resolved from offline (in the job). Torch-free: the planner side imports it."""
