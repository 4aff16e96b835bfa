"""The evaluation texts: every name resolves on a bare CPython (no system files for `code` and
`manual`), long enough for 16K-token contexts, the same on every call."""
import pytest

from oasiskv.eval.texts import text_content


def test_manual_is_long_english_in_a_fixed_order():
    text = text_content("manual")
    assert len(text) > 300_000 and text == text_content("manual")
    assert text.startswith('The "assert" statement')  # topics sorted by name


def test_code_is_the_typing_module_and_unknown_names_are_refused():
    assert "def overload(" in text_content("code")
    with pytest.raises(ValueError, match="manual"):
        text_content("no-such-text")
