"""EngineConfig: the flat keywords users and the CLI pass land in its nested SparseConfig."""
import pytest

from oasiskv.config import EngineConfig
from oasiskv.sparse.config import SparseConfig, auto_threshold


def test_flat_keywords_fill_the_nested_sparse_config():
    cfg = EngineConfig.from_flat(block_size=32, sparse=True, top_k_blocks=32, drafter="ngram", fetch_budget="off")
    assert cfg.block_size == 32
    assert cfg.sparse == SparseConfig(enabled=True, top_k_blocks=32, drafter="ngram", fetch_budget="off",
                                      sparse_threshold=auto_threshold(32, 1, 4, 32))
    assert EngineConfig.from_flat() == EngineConfig()
    with pytest.raises(TypeError, match="enabled"):  # the flat name is `sparse`
        EngineConfig.from_flat(enabled=True)


def test_the_threshold_default_is_set_once_with_the_block_size():
    assert SparseConfig().sparse_threshold is None  # the engine's block size decides it
    cfg = EngineConfig(block_size=8, sparse=SparseConfig(enabled=True, top_k_blocks=300))
    assert cfg.sparse.sparse_threshold == auto_threshold(300, 1, 4, 8) == 2 * 305 * 8
    again = cfg.with_sparse(fetch_ratio=0.5)
    assert again.sparse.sparse_threshold == cfg.sparse.sparse_threshold and again.sparse.fetch_ratio == 0.5
