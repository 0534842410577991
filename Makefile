# fxpar: `make demo` trains a small GPT on 2 CPU ranks; `make test` runs every test.
PY := .venv/bin/python

.PHONY: setup demo test test-fast bench clean
setup:
	bash scripts/setup.sh

demo: setup
	$(PY) -m fxpar demo --out out

test: setup
	$(PY) -m pytest -q tests

test-fast: setup
	$(PY) -m pytest -q -m "not slow" tests

bench: setup
	$(PY) benchmarks/dp_vs_ddp.py
	$(PY) benchmarks/zero_vs_fsdp.py
	$(PY) benchmarks/overlap.py
	$(PY) benchmarks/remat.py
	$(PY) benchmarks/pipeline_vs_torch.py
	$(PY) benchmarks/tp_vs_dtensor.py
	$(PY) benchmarks/kernels.py

clean:
	rm -rf out .venv *.egg-info
