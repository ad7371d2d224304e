"""The misuse catalogue's table format (tests/misuse/): one row per bad call, the error it
must raise, and the words its message must hold (the argument or leaf, and the fix)."""

import pytest


def case(name, call, error, *words):
    """One row: ``call()`` raises ``error`` whose message holds every one of ``words``."""
    return pytest.param(call, error, words, id=name)


def assert_refused(call, error, words):
    with pytest.raises(error) as info:
        call()
    message = str(info.value)
    for word in words:
        assert word in message, f"{word!r} not in the message:\n{message}"
