import os

os.environ.setdefault("FXPAR_DEVICE", "cpu")   # tests run the CPU/gloo path
os.environ.setdefault("FXPAR_TIMEOUT", "120")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Plan.codegen="auto" compiles every graph with Inductor (seconds to minutes per model on a
# 2-core machine): the suite runs op by op unless a test is about code generation and asks
# for codegen="inductor" itself (tests/test_codegen.py, the codegen parity tests)
os.environ.setdefault("FXPAR_CODEGEN", "eager")
