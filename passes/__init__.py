"""One module per graph pass: `run(gm, options, ctx) -> gm` beside its `CONTRACT`
(core/ir.PassContract: the keys it requires, reads and provides, its options). Passes never
import each other; the pass manager orders them from their contracts."""
