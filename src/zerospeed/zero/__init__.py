"""ZeRO data parallelism: gradient reduction (stage 0 now; stages 1-3 later)."""
