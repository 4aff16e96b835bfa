"""The evaluation's baseline drafters, registered beside the engine's (`sparse.drafters`):

- `oracle`: a first pass of each step finds the true next token, which the second pass sends as
  the draft: the best any lookahead token could do (`oasiskv eval agreement`, `passkey`).
- `ondemand`: no lookahead; each layer retrieves its blocks with the current token's query
  before its attention, on the critical path (Quest-style retrieval).

Both are modes of the pipeline's step (eager: evaluation only): the oracle's first pass is
`SparseDecodeStep.first_pass`, on-demand retrieval `LookaheadPipeline.on_demand`. The package
root imports this module, so `--drafter oracle` works wherever an engine is configured.
"""
from oasiskv.sparse.drafters import Drafter, register

register(Drafter("oracle", sends_draft_token=True, first_pass=True, runs_with_tensor_parallel=False))
register(Drafter("ondemand", sends_draft_token=False, retrieves_on_demand=True))
