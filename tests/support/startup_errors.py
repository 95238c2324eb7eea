"""What an app printed when it refused to start (bad input, checked before any process starts)."""

import pytest


def startup_error(main, capsys, argv: list[str]) -> str:
    """Runs ``main(argv)``, which must exit with code 2 and no traceback; returns its stderr."""
    capsys.readouterr()  # only what this run prints
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return err
