"""Timing and what is decided from it: one call timed (`timing`), latency arithmetic and rooflines (`latency`),
where independent tasks run (`executor`), and Pareto fronts and recommendations (`recommend`). A core subpackage."""
