"""The ground layer: the graph IR and its metadata keys, Plan, errors, logging, the cost model, and pipeline schedules as pure action lists. Imports nothing of fxpar above it."""
