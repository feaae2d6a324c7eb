"""The studies: `klpo compare` and its frontiers, a client of `klpo train`.

A study is a grid of ordinary ``klpo train`` runs (each its own process) that differ only in the
KL choice, its coefficient and the seed; its rooms: the spec and presets (:mod:`.spec`), the grid
(:mod:`.grid`), the runner (:mod:`.runner`), the per-run and per-cell summaries (:mod:`.summary`),
the report (:mod:`.report`), the plots (:mod:`.plots`) and the over-optimisation frontiers
(:mod:`.frontier`).
"""
