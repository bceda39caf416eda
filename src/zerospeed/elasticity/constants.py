"""The ``elasticity`` section's keys and defaults, under DeepSpeed's names (``deepspeed.elasticity.constants``).

The values are DeepSpeed's (0.19.7, the last release that shipped elastic training): a config written
for DeepSpeed's elasticity means the same batch arithmetic here.
"""

from __future__ import annotations

FORMAT = """
Elasticity should be enabled as:
"elasticity": {
  "enabled": true,
  "max_train_batch_size": 2000,
  "micro_batch_sizes": [2,4,6],
  "min_gpus": 1,
  "max_gpus" : 10000,
  "min_time": 20,
  "prefer_larger_batch": true,
  "ignore_non_elastic_batch_info": false,
  "version": 0.1
}
"""

ELASTICITY = "elasticity"

#: The newest elasticity algorithm ("version" key) this runtime knows.
LATEST_ELASTICITY_VERSION = 0.2

ENABLED = "enabled"
ENABLED_DEFAULT = False

#: The largest global batch (``train_batch_size``) the job accepts.
MAX_ACCEPTABLE_BATCH_SIZE = "max_train_batch_size"
MAX_ACCEPTABLE_BATCH_SIZE_DEFAULT = 2000

#: The micro batches per GPU the job accepts (``train_micro_batch_size_per_gpu`` candidates).
MICRO_BATCHES = "micro_batch_sizes"
MICRO_BATCHES_DEFAULT = (2, 4, 6)

MIN_GPUS = "min_gpus"
MIN_GPUS_DEFAULT = 1
MAX_GPUS = "max_gpus"
MAX_GPUS_DEFAULT = 10000

NUM_GPUS_PER_NODE = "num_gpus_per_node"
NUM_GPUS_PER_NODE_DEFAULT = 1

MODEL_PARALLEL_SIZE = "model_parallel_size"
MODEL_PARALLEL_SIZE_DEFAULT = 1

#: Minutes the job runs before a scheduler may rescale it (0: unknown); informational.
MIN_TIME = "min_time"
MIN_TIME_DEFAULT = 0

#: Among batch sizes with equally many valid GPU counts, take the largest (else the smallest).
PREFER_LARGER_BATCH = "prefer_larger_batch"
PREFER_LARGER_BATCH_DEFAULT = True

#: With elasticity on, batch keys outside the section are an error unless this is true (then ignored).
IGNORE_NON_ELASTIC_BATCH_INFO = "ignore_non_elastic_batch_info"
IGNORE_NON_ELASTIC_BATCH_INFO_DEFAULT = False

VERSION = "version"
VERSION_DEFAULT = LATEST_ELASTICITY_VERSION

#: The oldest DeepSpeed release with elasticity; ``compute_elastic_config`` refuses older targets.
MINIMUM_DEEPSPEED_VERSION = "0.3.8"

#: The environment variable in which a resource scheduler passes the elasticity section it planned with.
DEEPSPEED_ELASTICITY_CONFIG = "DEEPSPEED_ELASTICITY_CONFIG"
