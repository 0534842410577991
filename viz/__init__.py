"""Pictures of what each pass did: graph DOT/SVG (more views arrive with later issues)."""
