"""The model's layers call the sparse machinery through one interface, `AttentionHooks`: the
pipeline, the conversions' query recorder and the in-line reference's hooks implement it with
the same signatures."""
import inspect

import pytest
from inline_reference import SparseStepHooks

from oasiskv.layers.attention import AttentionHooks
from oasiskv.sparse.pipeline import LookaheadPipeline
from oasiskv.sparse.query_recorder import QueryRecorder


@pytest.mark.parametrize("implementation", [LookaheadPipeline, QueryRecorder, SparseStepHooks])
def test_every_implementation_implements_the_attention_hooks(implementation):
    hooks = [name for name in vars(AttentionHooks) if not name.startswith("_")]
    assert sorted(hooks) == ["after_attention", "before_attention", "fork_point", "summary_fold"]
    for name in hooks:  # the same parameters (a return type may be narrower)
        want = inspect.signature(getattr(AttentionHooks, name)).parameters
        assert inspect.signature(getattr(implementation, name)).parameters == want, name
