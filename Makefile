# fxpar: `make demo` trains a small GPT on 2 CPU ranks; `make test` runs the tests.
# PYTHONSAFEPATH: the checkout's folders are the package's (fxpar.kernels, fxpar.core...),
# not top-level modules: with the current folder on sys.path (python -m from the checkout),
# `import kernels` in a dependency (transformers' Hugging Face kernels) finds ours
PY := PYTHONSAFEPATH=1 .venv/bin/python

.PHONY: setup demo test test-slow test-full test-all bench clean
setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m fxpar demo --out out

# every test not marked slow (unit tests of each pass, in-process parity) on TEST_WORKERS
# pytest-xdist workers, whole files each: one line per file as it ends (tests/conftest.py)
# and the 10 slowest at the end; about 4 minutes on 2 quiet cores
TEST_WORKERS ?= 2
test: setup
	$(PY) -m pytest -m "not slow" -n $(TEST_WORKERS) --dist loadfile --durations=10 tests

# the multi-process parity / timing / large-model tests (CI runs them after `make test`),
# every zoo model under every plan: those in one process on TEST_WORKERS workers, then
# those starting rank processes or asserting a wall-clock time one at a time (each rank
# a core); the second part runs whatever the first's outcome
test-slow: setup
	status=0; \
	$(PY) -m pytest -m "slow and not full and not multiprocess and not timing" \
		-n $(TEST_WORKERS) --dist loadfile --durations=10 tests || status=$$?; \
	$(PY) -m pytest -m "slow and not full and (multiprocess or timing)" --durations=10 tests \
		|| status=$$?; \
	exit $$status

# what CI leaves out for time: the rest of the zoo compiled by Inductor and the planner's
# choice measured against every plan on 8 ranks
test-full: setup
	$(PY) -m pytest -m full --durations=10 tests

test-all: setup
	$(PY) -m pytest tests

bench: setup
	$(PY) benchmarks/dp_vs_ddp.py
	$(PY) benchmarks/zero_vs_fsdp.py
	$(PY) benchmarks/overlap.py
	$(PY) benchmarks/remat.py
	$(PY) benchmarks/pipeline_vs_torch.py
	$(PY) benchmarks/tp_vs_dtensor.py
	$(PY) benchmarks/fsdp_tp_2d.py
	$(PY) benchmarks/meta_memory.py
	$(PY) benchmarks/kernels.py

clean:
	rm -rf out .venv *.egg-info
