"""One module per graph pass. A pass is `run(gm, plan, ctx) -> gm`; passes never import each other."""
