"""Runs one rank's Program on torch.distributed. Never imports fxpar.passes."""
