"""Memory planning before a run: DeepSpeed's estimators, the per-rank plan, ``zerospeed plan``."""
