"""Running `gqakit` in-process in a test, and what a refusal must look like on stderr."""

from __future__ import annotations

from gqakit.cli import main


def run_cli(args: list, capsys) -> tuple[int, str, str]:
    """`gqakit ARGS` in-process: (exit code, stdout, stderr) of the command alone."""
    capsys.readouterr()  # what building the test's inputs printed is not the command's
    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(code: int, err: str, *needles: str) -> None:
    """Exit 2 and one `gqakit: error:` line naming every needle, no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("gqakit: error: "), (code, err)
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
