import numpy as np

from oasiskv.engine.sequence import Sequence
from oasiskv.sampling_params import SamplingParams


def test_last_token_id_is_the_newest_token():
    s = Sequence("r", [5, 6, 7], SamplingParams())
    assert s.last_token_id == 7
    s.output_token_ids.append(9)
    assert s.last_token_id == 9 == s.token_ids[-1]


def test_page_array_follows_appends_and_replacements():
    s = Sequence("r", [1], SamplingParams())
    s.pages.extend([4, 2])
    assert s.page_array().tolist() == [4, 2]
    s.pages.extend([8, 3])  # the block manager appends...
    assert s.page_array().tolist() == [4, 2, 8, 3]
    s.pages = [7]  # ...or replaces the list (freed, converted to sparse)
    assert s.page_array().tolist() == [7]
    s.pages = [7, 1, 5]  # a new list that starts the same
    assert s.page_array().tolist() == [7, 1, 5]
    assert s.page_array().dtype == np.int64
