# zerospeed developer commands. `make demo` and `make test` each work alone on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# Installed before the package so pip never resolves torch from a range (a multi-GB CUDA build).
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.zerospeed-installed

.PHONY: install cluster-deps demo test test-cluster test-fast bench clean infinity zero-inference

install: $(STAMP)

$(STAMP): pyproject.toml Makefile setup.py src/zerospeed/ops/csrc/cpu_optim.c
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[test,integrations,plot]"
	touch $(STAMP)

demo: install
	$(BIN)/zerospeed --num_procs 2 examples/demo.py

# Debian packages of the one-machine test cluster (sshd, pdsh, Open MPI, MPICH, Slurm, munge; see
# .ci/cluster-deps): one quick `dpkg -s` when installed; installs with daemons kept from starting when
# root with apt-get; else nothing (the cluster tests skip, naming what is missing).
cluster-deps:
	.ci/cluster-deps

# --durations: the slowest tests, so a test that grows slow is seen at once. Everything but the multi-host
# lane, which has a target of its own (CI runs both).
test: install cluster-deps
	$(BIN)/python -m pytest -q --durations=15 -m "not cluster"

# The multi-host lane (tests marked `cluster`, ~7 minutes): 3 namespace "hosts" with real sshd, pdsh, Open MPI,
# MPICH and Slurm run the launcher's acceptance jobs (zerospeed.testing.cluster). Needs root; skipped, naming
# what is missing, elsewhere.
test-cluster: install cluster-deps
	$(BIN)/python -m pytest -q --durations=10 -m cluster

# The inner loop (well under 2 minutes): every test in a module that starts no process, plus the few
# quick 2-rank tests marked smoke (see tests/conftest.py).
test-fast: install
	$(BIN)/python -m pytest -q --durations=5 -m "not spawns or smoke"

# ZeRO-Infinity: a ~2.5B-parameter GPT whose training state is > 1.5 x RAM, on NVMe (~45 GB of swap files
# under the temp dir, about 10 minutes); see examples/infinity/README.md.
infinity: install
	$(BIN)/python examples/infinity/train.py

# ZeRO-Inference: a ~9.6B-parameter Llama (fp32, ~38 GB of weights, >= 1.5 x free RAM) built straight onto
# NVMe and generating a few tokens with every layer streamed from disk (~40 GB of swap files under the temp
# dir, removed at the end; tens of minutes on 2 cores); see examples/zero_inference/README.md.
zero-inference: install
	$(BIN)/python examples/zero_inference/generate.py

bench: install
	$(BIN)/python benchmarks/bench_comm.py
	$(BIN)/python benchmarks/bench_ddp.py
	$(BIN)/python benchmarks/bench_comm_compression.py --quick
	$(BIN)/python benchmarks/bench_onebit.py --quick
	$(BIN)/python benchmarks/bench_zero.py --quick
	$(BIN)/python benchmarks/bench_checkpoint.py --quick
	$(BIN)/python benchmarks/bench_cpu_adam.py --quick
	$(BIN)/python benchmarks/bench_offload.py --quick
	$(BIN)/python benchmarks/bench_tp.py --quick
	$(BIN)/python benchmarks/bench_pipe.py --quick
	$(BIN)/python benchmarks/bench_pipe.py --quick --device-ms 10
	$(BIN)/python benchmarks/bench_moe.py --quick
	$(BIN)/python benchmarks/bench_int8.py --quick
	$(BIN)/python benchmarks/bench_inference.py --quick
	$(BIN)/python benchmarks/bench_pld.py --quick
	$(BIN)/python benchmarks/bench_wall_clock.py --quick
	$(BIN)/python benchmarks/bench_flops_profiler.py --rounds 3
	$(BIN)/python benchmarks/bench_comms_logger.py --calls 20000 --rounds 3
	$(BIN)/python benchmarks/bench_plan.py --model demo --malloc fixed
	$(BIN)/python benchmarks/bench_import.py --runs 3
	$(BIN)/python benchmarks/bench_multinode.py --quick

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache
