"""Pipeline parallelism (package marker; the real init comes from another branch)."""
