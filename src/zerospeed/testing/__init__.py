"""Helpers for testing zerospeed: multi-process gloo runs and parity checks."""

from zerospeed.distributed.defaults import free_port
from zerospeed.testing.cluster import Cluster, cluster_or_skip, cluster_unavailable_reason
from zerospeed.testing.dist import RankFailed, one_process_group, run_distributed
from zerospeed.testing.logs import log_messages
from zerospeed.testing.parity import assert_close_tree, seed_all

__all__ = ["Cluster", "cluster_or_skip", "cluster_unavailable_reason", "RankFailed", "free_port", "one_process_group", "run_distributed", "assert_close_tree", "log_messages", "seed_all"]
