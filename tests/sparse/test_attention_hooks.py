"""The model's layers call the sparse machinery through one interface, `AttentionHooks`: the
in-line path's hooks and the batched pipeline implement it with the same signatures."""
import inspect

import pytest

from oasiskv.layers.attention import AttentionHooks
from oasiskv.sparse.pipeline import LookaheadPipeline
from oasiskv.sparse.step_hooks import SparseStepHooks


@pytest.mark.parametrize("implementation", [SparseStepHooks, LookaheadPipeline])
def test_both_paths_implement_the_attention_hooks(implementation):
    hooks = [name for name in vars(AttentionHooks) if not name.startswith("_")]
    assert sorted(hooks) == ["after_attention", "before_attention", "fork_point", "summary_fold"]
    for name in hooks:  # the same parameters (a return type may be narrower)
        want = inspect.signature(getattr(AttentionHooks, name)).parameters
        assert inspect.signature(getattr(implementation, name)).parameters == want, name
