"""The `xlakit` command run in the test's own process, its output captured."""

from xlakit import cli


def ckpt(capsys, *args: str) -> tuple[int, str, str]:
    code = cli.main(["ckpt", *args])
    out = capsys.readouterr()
    return code, out.out, out.err
