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


def assert_cli_refused(parse, argv, flag, message, capsys):
    """``parse(argv)`` exits with status 2, printing no traceback and a message that names
    ``flag`` (or the file at fault) and holds ``message``."""
    with pytest.raises(SystemExit) as info:
        parse(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and message in err, err
    assert "Traceback" not in err
