import os

os.environ.setdefault("FXPAR_DEVICE", "cpu")   # tests run the CPU/gloo path
os.environ.setdefault("FXPAR_TIMEOUT", "120")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
