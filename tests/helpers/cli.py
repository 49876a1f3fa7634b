"""Driving the `hybrid` command in-process, and what every user error must look like."""

import io
import sys

import pytest

from mlx_hybrid.cli.main import main


def run(monkeypatch, capsys, *args, stdin=None):
    monkeypatch.setattr(sys, "argv", ["hybrid", *map(str, args)])
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    capsys.readouterr()  # drop what fixtures printed
    with pytest.raises(SystemExit) as exit_info:
        main()
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def assert_one_line_error(code, err, *fragments):
    assert code != 0
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
