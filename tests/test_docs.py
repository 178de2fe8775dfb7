"""The documentation runs as written: README.md's and docs/**/*.md's code blocks, on a tiny model.

What runs:

- Every ```python block of README.md and docs/**/*.md is executed in this process in a fresh
  namespace (`__name__ == "__main__"`, the working directory a fresh temporary one), with
  the embedded default model swapped for the tiny random Llama of `tests/conftest.py` and,
  for `LLM(...)`, small engine sizes wherever the block sets none (`max_model_len`,
  `max_num_seqs`, `max_num_batched_tokens`, `num_kv_blocks`: one or two compiled programs
  instead of every bucket of the defaults). A block must run as written: a NameError or
  any other exception fails it, with the traceback pointing at the markdown file's line.
- The README's quick-start shell blocks (the first two ```bash/```sh/```shell/```console
  blocks) and every shell block of README.md and docs/**/*.md with a command that starts
  with `jaxserve`, command by command
  (`&&`, `;`, `|` and line continuations split and joined as a shell would; `VAR=value`
  prefixes dropped; the commands of one block share a temporary working directory):
  `jaxserve generate` and `jaxserve convert` run for real through
  `jaxserve.entrypoints.cli.main` on the tiny model (`--model <tiny>` added where the
  command names none or a path that does not exist); every other `jaxserve` command
  (serve, chat, run-batch, bench, diagnose: slow or needing a server) runs as
  `jaxserve <command> --help`, and each flag the line uses must be one of that command's.
  `pip install` lines are not run, but every extra they name (`'.[test]'`) must exist in
  pyproject.toml; `python3 -m venv`, `. .venv/bin/activate`, `pytest`, `curl`, `python -c`
  and other non-`jaxserve` commands are skipped.

Markers (an HTML comment, invisible when rendered, on the line before a block's opening
fence; blank lines between are allowed):

    <!-- docs-test: skip (needs a server) -->     the block is not run (the reason is shown)
    <!-- docs-test: slow (loads the full model) -->   the block runs in the slow tier (-m slow)

The files are parsed when the tests are collected: nothing here depends on their text.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import io
import os
import re
import shlex
import tomllib
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
PYTHON_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
MARKER = re.compile(r"<!--\s*docs-test:\s*(skip|slow)\b\s*(.*?)\s*-->")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
EXTRAS = re.compile(r"\.\[([^\]]+)\]")
# Engine sizes for `LLM(...)` in python blocks, where the block sets none (see above).
SMALL_ENGINE = {"max_model_len": 256, "max_num_seqs": 8, "num_kv_blocks": 128}
# max_num_batched_tokens (at least max_num_seqs): two token buckets (the XLA path's 4 and
# 8) for a warm-up to compile, where 16 made three.
SMALL_BUDGET = 8
# Commands that run for real on the tiny model; every other one gets --help.
RUN_FOR_REAL = {"generate", "convert"}


@dataclass(frozen=True)
class Block:
    """One fenced code block of a markdown file."""

    path: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str | None  # "skip" or "slow"
    reason: str

    @property
    def name(self) -> str:
        return f"{os.path.relpath(self.path, ROOT)}:{self.line}"


def code_blocks(path: str) -> list[Block]:
    """Every fenced block of `path` (indentation of the fence removed), with its marker."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = len(m.group(1)), m.group(2), m.group(3).lower()
        start, body = i, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and not lines[i].strip().strip(fence[0])):
            line = lines[i]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            i += 1
        i += 1  # the closing fence
        prev = start - 1
        while prev >= 0 and not lines[prev].strip():
            prev -= 1
        mark = MARKER.search(lines[prev]) if prev >= 0 else None
        blocks.append(Block(path, start + 1, lang, "\n".join(body) + "\n",
                            mark.group(1) if mark else None,
                            mark.group(2).strip("() ") if mark else ""))
    return blocks


def markdown_files() -> list[str]:
    files = [README] if os.path.exists(README) else []
    return files + sorted(glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def python_blocks() -> list[Block]:
    return [b for p in markdown_files() for b in code_blocks(p) if b.lang in PYTHON_LANGS]


def readme_shell_blocks() -> list[Block]:
    return [b for b in code_blocks(README) if b.lang in SHELL_LANGS] \
        if os.path.exists(README) else []


def shell_commands(code: str) -> list[list[str]]:
    """The simple commands of a shell snippet as argv lists: continuation lines joined,
    comments dropped, split at `&&`, `||`, `;` and `|`, `VAR=value` prefixes removed."""
    text = re.sub(r"\\\n", " ", code)
    lines = [line.strip() for line in text.splitlines()]
    if any(line.startswith("$ ") for line in lines):  # a console session: commands only
        lines = [line[2:] for line in lines if line.startswith("$ ")]
    commands = []
    for line in lines:
        if not line or line.startswith("#"):
            continue
        lex = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lex.whitespace_split = True
        lex.commenters = "#"
        current: list[str] = []
        for token in lex:
            if token in ("&&", "||", ";", "|", "&"):
                commands.append(current)
                current = []
            else:
                current.append(token)
        commands.append(current)
    out = []
    for argv in commands:
        while argv and ENV_ASSIGNMENT.match(argv[0]):
            argv = argv[1:]
        if argv:
            out.append(argv)
    return out


def runs_jaxserve(block: Block) -> bool:
    try:
        return any(argv[0] == "jaxserve" for argv in shell_commands(block.code))
    except ValueError:  # unbalanced quotes: collected, so that its test says so
        return "jaxserve" in block.code


def quick_start_blocks() -> list[Block]:
    """The README's first two shell blocks and every shell block that runs `jaxserve`."""
    blocks = readme_shell_blocks()
    return [b for i, b in enumerate(blocks) if i < 2 or runs_jaxserve(b)]


def docs_jaxserve_blocks() -> list[Block]:
    """Every shell block of docs/**/*.md that runs `jaxserve` (README's are above)."""
    return [b for p in markdown_files() if p != README for b in code_blocks(p)
            if b.lang in SHELL_LANGS and runs_jaxserve(b)]


def params_of(blocks: list[Block]) -> list:
    out = []
    for b in blocks:
        marks = [pytest.mark.slow] if b.marker == "slow" else []
        if b.marker == "skip":
            marks.append(pytest.mark.skip(reason=f"docs-test: skip ({b.reason or 'no reason'})"))
        out.append(pytest.param(b, id=b.name, marks=marks))
    return out


@pytest.fixture
def tiny_default(tiny_model_dir, monkeypatch, tmp_path):
    """The embedded default model is the tiny one; the working directory is a fresh one."""
    import models.default_model

    # NOTE: every loader finds the default through this module attribute
    # (`models.loaders.model_source.local_model_path`).
    monkeypatch.setattr(models.default_model, "default_model_path", lambda *a: tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    return tiny_model_dir


# --------------------------------------------------------------------------- python blocks


@pytest.fixture
def small_llm(monkeypatch):
    """`LLM(...)` gets the small engine sizes wherever the caller sets none."""
    from jaxserve.engine.llm import LLM

    init = LLM.__init__

    def small_init(self, model=None, **kwargs):
        for key, value in SMALL_ENGINE.items():
            kwargs.setdefault(key, value)
        chunked = (kwargs.get("enable_chunked_prefill", True)
                   and kwargs.get("scheduling_mode", "continuous+chunked")
                   == "continuous+chunked")
        if chunked:  # NOTE: without chunking the budget must hold max_model_len
            kwargs.setdefault("max_num_batched_tokens",
                              max(SMALL_BUDGET, kwargs["max_num_seqs"]))
        init(self, model, **kwargs)

    monkeypatch.setattr(LLM, "__init__", small_init)


@pytest.mark.parametrize("block", params_of(python_blocks()))
def test_python_block(block, tiny_default, small_llm):
    # Blank lines first: the compiled code's line numbers are the markdown file's, so a
    # traceback names README.md and the line that failed.
    code = compile("\n" * block.line + block.code, block.path, "exec")
    namespace = {"__name__": "__main__"}
    try:
        exec(code, namespace)
    finally:
        namespace.clear()
        gc.collect()


# --------------------------------------------------------------------------- shell blocks


def pyproject_extras() -> set[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        return set(tomllib.load(f)["project"].get("optional-dependencies", {}))


def command_parser(argv: list[str]):
    """(the argparse parser of the `jaxserve` (sub)command argv names, its words in argv)."""
    import argparse

    from jaxserve.entrypoints.cli import build_parser

    parser, path = build_parser(), []
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or len(path) >= len(argv) or argv[len(path)] not in subs[0].choices:
            break
        parser = subs[0].choices[argv[len(path)]]
        path.append(argv[len(path)])
    return parser, path


def run_cli(argv: list[str]) -> tuple[int, str]:
    from jaxserve.entrypoints.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        try:
            code = main(argv)
        except SystemExit as e:
            code = e.code
    return code, out.getvalue()


def run_jaxserve(argv: list[str], tiny: str) -> None:
    """Runs one documented `jaxserve ...` command (argv without "jaxserve") as described
    above."""
    parser, path = command_parser(argv)
    shown = "jaxserve " + shlex.join(argv)
    assert path, f"{shown}: no such command"
    if path[0] in RUN_FOR_REAL and not {"-h", "--help"} & set(argv):
        argv = list(argv)
        if path[0] == "generate":
            if "--model" not in argv:
                argv += ["--model", tiny]
            elif not os.path.exists(argv[argv.index("--model") + 1]):
                argv[argv.index("--model") + 1] = tiny
        code, out = run_cli(argv)
        assert code == 0, f"{shown} exited {code}:\n{out}"
        return
    known = {s for a in parser._actions for s in a.option_strings}
    unknown = [t.split("=")[0] for t in argv[len(path):]
               if t.startswith("-") and t != "-" and t.split("=")[0] not in known]
    assert not unknown, f"{shown}: {' '.join(path)} has no option {', '.join(unknown)}"
    code, out = run_cli([*path, "--help"])
    assert code == 0 and "usage: jaxserve" in out, f"jaxserve {' '.join(path)} --help:\n{out}"


@pytest.mark.parametrize("block", params_of(quick_start_blocks() + docs_jaxserve_blocks()))
def test_shell_block(block, tiny_default):
    try:
        commands = shell_commands(block.code)
    except ValueError as e:
        pytest.fail(f"{block.name}: not a valid shell command line ({e})")
    assert commands, f"{block.name}: no command in the block"
    extras = pyproject_extras()
    for argv in commands:
        if argv[0] == "jaxserve":
            run_jaxserve(argv[1:], tiny_default)
        elif argv[0] in ("pip", "pip3") or argv[:3] in (["python", "-m", "pip"],
                                                           ["python3", "-m", "pip"]):
            named = {e.strip() for t in argv for m in EXTRAS.finditer(t)
                     for e in m.group(1).split(",")}
            assert named <= extras, (f"{block.name}: pip extras {sorted(named - extras)} are "
                                     f"not in pyproject.toml (it has {sorted(extras)})")


def test_readme_has_a_quick_start():
    blocks = quick_start_blocks()
    assert blocks, "README.md has no shell block"
    commands = [argv for b in blocks for argv in shell_commands(b.code)]
    assert any(argv[:2] == ["jaxserve", "generate"] for argv in commands), \
        "the README's quick start runs no `jaxserve generate`"


def test_block_parser(tmp_path):
    """The parser itself: fences, indentation, markers, commands."""
    md = tmp_path / "x.md"
    md.write_text("text\n<!-- docs-test: skip (needs a server) -->\n\n```python\nx = 1\n```\n"
                  "- item\n\n  ```bash\n  A=1 jaxserve serve \\\n    --port 1 && pip install "
                  "-e '.[test,bench]'  # note\n  ```\n<!-- docs-test: slow -->\n~~~py\n"
                  "```\n~~~\n")
    b = code_blocks(str(md))
    assert [(x.line, x.lang, x.marker, x.reason) for x in b] == [
        (4, "python", "skip", "needs a server"), (9, "bash", None, ""), (14, "py", "slow", "")]
    assert b[0].code == "x = 1\n" and b[2].code == "```\n"
    assert shell_commands(b[1].code) == [["jaxserve", "serve", "--port", "1"],
                                         ["pip", "install", "-e", ".[test,bench]"]]
    assert shell_commands("$ jaxserve chat; echo 'a b'\nsome output\n") == [
        ["jaxserve", "chat"], ["echo", "a b"]]


def test_tiny_model_dir_loads(tiny_model_dir, smollm2_tokenizer):
    """The stand-in for the default model: jaxserve's loaders read it, tokenizer included."""
    from models.loaders import load_model, load_tokenizer, resolve_model

    assert resolve_model(tiny_model_dir) == ("hf", tiny_model_dir)
    model, tok = load_model(tiny_model_dir), load_tokenizer(tiny_model_dir)
    assert model.cfg.vocab_size == len(tok) == len(smollm2_tokenizer) == 49152
    assert model.cfg.num_layers == 2 and model.cfg.hidden_size == 72
    assert tok.chat_template and tok.eos_token_id in model.cfg.eos_token_ids
    text = "Once upon a time"
    assert tok(text).input_ids == smollm2_tokenizer(text).input_ids
