"""The public API on top of every layer: parallelize() (compile, then run) and the planner's machine measurement. The only place compile meets run."""
