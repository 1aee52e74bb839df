"""The V1 model runner's hooks, by job (each module's wrappers are named in ../patches.py):

* state.py: `GsdRunnerState` (the runner's `gsd` attribute) and which runners are gsd runners;
* setup_hooks.py: the runner's construction, logits processors, KV-cache and attention-builder
  set-up, dummy runs, the drafter's room check;
* step_hooks.py: a step's inputs (the verification trees, keyed roots), attention metadata and
  the timed target forward;
* sampling_hooks.py: after the tree scorer, the accepted nodes' KV compaction and the counters;
* draft_hooks.py: the drafter's proposal and the drafts handed to the scheduler;
* rank_failure.py: an error in gsd's rank-local work on one rank of a multi-worker engine stops
  the engine instead of leaving the other ranks waiting in a collective.
"""
