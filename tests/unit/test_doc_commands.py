"""Every `qos-serve ...` command that README.md and docs/*.md show, as written: the parser takes
it, and those that need no cluster (tenants, keys, billing, certs init, alerts --rules, bench
--help) run for real against a throwaway store and config in a temporary folder.

A code block is what a reader copies, so each of its commands must parse in full. Inline code may
name a command without its required arguments ("SIGTERM, or `qos-serve drain worker`"): that
passes as a mention; any other refusal fails. Synopses are expanded: each `[...]` both left out and
given, each `a|b` every way; placeholders (FILE, HOST:PORT, N, ...) become real values.
"""
from __future__ import annotations

import contextlib
import io
import itertools
import re
import shlex
import sys
from pathlib import Path

import pytest

from services.tools import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)
COMMAND_IN_CODE = re.compile(r"(?:^|(?<=[\s=(]))(?:\S*/bin/)?qos-serve[ \t]+(.+)$")
INLINE_CODE = re.compile(r"`([^`]+)`")
INLINE_COMMAND = re.compile(r"(?:\S*/bin/)?qos-serve\s+(.+)", re.S)
SHELL_OPERATORS = {"|", "||", "&&", ";", "&", ">", ">>", "<", "2>&1"}
ALTERNATIVES = re.compile(r"[\w.:/-]+(?:\|[\w.:/-]+)+")
REFERENCE_ONLY = "the following arguments are required"
RUN_FOR_REAL = {"tenants", "keys", "billing", "certs", "bench"}


def _placeholders(tmp: Path) -> dict[str, str]:
    address = "127.0.0.1:50099"
    return {"FILE": str(tmp / "cluster.toml"), "F": str(tmp / "cluster.toml"), "HOST:PORT": address,
            "SCHEDULER_HOST:PORT": address, "SCHEDULER": address, "ADDR": address, "NAME": "cpu",
            "HOST": "127.0.0.1", "N": "1", "SECONDS": "2", "T": "acme", "YYYY-MM-DD": "2024-01-01", "UNIX_S": "1700000000",
            "DIR": "certs", "PEM": str(tmp / "ca.pem"), "$KEY": "qsk_doc-example"}


def _argv(words: str) -> list[str]:
    """The command's arguments, up to a comment or a shell operator."""
    argv = shlex.split(words, comments=True)
    cut = next((i for i, word in enumerate(argv) if word in SHELL_OPERATORS), len(argv))
    return argv[:cut]


def _synopsis_forms(argv: list[str]) -> list[list[str]]:
    """`[...]` parts all left out and all given; then every choice of each `a|b`."""
    shortest, longest, depth = [], [], 0
    for word in argv:
        opens = len(word) - len(word.lstrip("["))
        closes = len(word) - len(word.rstrip("]"))
        bare = word.strip("[]")
        if depth == 0 and opens == 0:
            shortest.append(bare)
        longest.append(bare)
        depth += opens - closes
    forms = []
    for form in (shortest, longest):
        choices = [w.split("|") if ALTERNATIVES.fullmatch(w) else [w] for w in form]
        forms += [list(c) for c in itertools.product(*choices)]
    return [f for i, f in enumerate(forms) if f and f not in forms[:i]]


def documented_commands() -> list[tuple[str, list[str], bool]]:
    """(where, argv, whether a mention without required arguments passes), each argv once."""
    found, seen = [], set()

    def add(path: Path, offset: int, text: str, words: str, inline: bool) -> None:
        argv = _argv(words.replace("\n", " "))
        if not argv or argv[0].endswith(":"):        # `qos-serve worker: ...` is the program's output
            return
        if "..." in argv or "…" in argv:
            argv, inline = argv[:argv.index("..." if "..." in argv else "…")], True
        where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, offset) + 1}"
        for form in _synopsis_forms(argv):
            if (tuple(form), inline) not in seen:
                seen.add((tuple(form), inline))
                found.append((where, form, inline))

    for path in DOCS:
        text = path.read_text()
        for block in FENCE.finditer(text):
            start = block.start(1)
            for line in block.group(1).replace("\\\n", "  ").splitlines(keepends=True):
                if match := COMMAND_IN_CODE.search(line.rstrip("\n")):
                    add(path, start, text, match.group(1), inline=False)
                start += len(line)
        prose = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        for span in INLINE_CODE.finditer(prose):
            if match := INLINE_COMMAND.fullmatch(span.group(1).strip()):
                add(path, span.start(), prose, match.group(1), inline=True)
    return found


COMMANDS = documented_commands()


def _complaint(argv: list[str]) -> str | None:
    """What the parser says when it refuses argv; None when it takes it."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            cli.parse_args(argv)
        except SystemExit as exc:
            if exc.code:
                return err.getvalue().strip().splitlines()[-1]
    return None


def _run(argv: list[str], tmp: Path, store_url: str, monkeypatch, capsys) -> None:
    from services.store.store import Store, Tenant
    if argv[0] == "bench":                 # the benchmark itself takes minutes: it finds its script
        argv = ["bench", "--help"]
        monkeypatch.setattr(sys, "argv", list(sys.argv))
    if argv[0] in ("keys", "billing") or argv[:2] == ["tenants", "set"]:
        store = Store(store_url)
        for name in ("acme", "batchco"):
            store.add_tenant(Tenant(name))
        _, prefix = store.create_key("acme")
        store.close()
        if argv[:2] == ["keys", "revoke"]:
            argv = [*argv[:2], prefix]     # the docs' example prefix, made real
    with pytest.raises(SystemExit) as exit:
        cli.main(argv)
    out = capsys.readouterr()
    assert exit.value.code in (0, None), f"qos-serve {shlex.join(argv)} exited {exit.value.code}: {out.err}"


def test_the_docs_show_commands():
    assert len(COMMANDS) > 20
    assert {argv[0] for _, argv, _ in COMMANDS} >= {"up", "generate", "stats", "tenants", "keys", "billing"}


@pytest.mark.parametrize("where, argv, mention", COMMANDS,
                         ids=[f"{where}: {' '.join(argv)}" for where, argv, _ in COMMANDS])
def test_documented_command(where, argv, mention, tmp_path, monkeypatch, capsys):
    store_url = f"sqlite:///{tmp_path}/store.db"
    (tmp_path / "cluster.toml").write_text(
        (ROOT / "configs" / "sla-demo.toml").read_text() + f'\n[store]\nurl = "{store_url}"\n')
    values = _placeholders(tmp_path)
    argv = [values.get(word, str(ROOT / word) if (ROOT / word).is_file() else word) for word in argv]

    complaint = _complaint(argv)
    if complaint and mention and REFERENCE_ONLY in complaint:
        return                             # a command named in a sentence, its arguments left out
    assert complaint is None, f"{where}: `qos-serve {shlex.join(argv)}` is refused: {complaint}"

    if argv[0] in RUN_FOR_REAL or (argv[0] == "alerts" and "--rules" in argv):
        monkeypatch.chdir(tmp_path)
        monkeypatch.setenv("QOS_STORE_URL", store_url)
        _run(argv, tmp_path, store_url, monkeypatch, capsys)
