"""lingc runtime: run compiled artifacts (eager on CPU today; CUDA graphs, caches and the scheduler come next)."""
