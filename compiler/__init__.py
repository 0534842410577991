"""The compiler: capture, the pass manager, the planner, code generation, and compile() -> Program. On passes/ and core/."""
