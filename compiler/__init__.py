"""Front door and orchestration: capture, plan, pass manager, cost model."""
