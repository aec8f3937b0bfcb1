"""Issue 30: the README and docs/ say only what works.

Every shell command in README.md and docs/*.md (the lines of ```bash blocks and the inline code spans that start
with ``python``) parses: a script or module exists, a ``python -m`` command or a benchmark accepts the flags
shown (their own argparse parser runs on them; nothing trains), an example's Hydra overrides compose against
``configs/`` (an unknown key or group fails) and a PatrickStar strategy node builds, ``pytest`` paths exist,
and ``bash`` scripts exist. Every relative link resolves to an existing file, and its ``#anchor`` to a heading.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KNOWN_PROGRAMS = {"python", "pytest", "pip", "ruff", "mypy", "bash"}
HYDRA_DEFAULT_OVERRIDES = {"train_hf.py": "+experiment=hf_gpt2"}  # what the script adds when none is given
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
_INLINE = re.compile(r"`([^`]+)`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@dataclass(frozen=True)
class Command:
    page: str
    text: str

    def __str__(self) -> str:
        return f"{self.page}: {self.text}"


def _commands(page: Path) -> Iterator[Command]:
    text = page.read_text()
    name = str(page.relative_to(ROOT))
    for lang, body in _FENCE.findall(text):
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                yield Command(name, line)
    for span in _INLINE.findall(_FENCE.sub("", text)):
        span = " ".join(span.split())
        if span.startswith("python ") and (".py" in span or " -m " in span):
            yield Command(name, span)


def _split(command: str) -> list[list[str]]:
    """The simple commands of a line (``&&``, ``;`` and ``|`` separate them), without comments, environment
    assignments or a ``/usr/bin/time`` prefix."""
    out: list[list[str]] = []
    current: list[str] = []
    for token in shlex.split(command, comments=True) + ["&&"]:
        if token in ("&&", ";", "|", "||"):
            while current and (re.fullmatch(r"[A-Z_]+=\S*", current[0]) or current[0] == "/usr/bin/time"):
                current = current[2:] if current[:2] == ["/usr/bin/time", "-v"] else current[1:]
            if current:
                out.append(current)
            current = []
        else:
            current.append(token)
    return out


ALL_COMMANDS = [c for page in PAGES for c in _commands(page)]


class _Parsed(Exception):
    """Raised instead of running a program once its arguments were parsed."""


def _load(path: Path) -> ModuleType:
    """Import a script as a module (its ``__main__`` block does not run), once per test session."""
    name = f"_docs_{path.parent.name}_{path.stem}"
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(path.parent))  # benchmarks import their sibling `_launch`
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up while the class is built
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def _parse_only(main: Any, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Run ``main(argv)`` until its argparse parser has read ``argv``; a flag it does not know fails."""
    original = argparse.ArgumentParser.parse_args

    def parse_and_stop(self: argparse.ArgumentParser, args: Any = None, namespace: Any = None) -> Any:
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    try:
        main(argv)
    except _Parsed:
        return
    except SystemExit as exit_:  # argparse's --help (0) or its error (2)
        assert exit_.code == 0, f"argument parsing failed (exit status {exit_.code})"
        return
    raise AssertionError("the program ran past its argument parsing")


def _check_hydra_app(script: Path, overrides: list[str]) -> None:
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    config_name = re.search(r'config_name="([^"]+)"', script.read_text())
    assert config_name is not None, f"{script} is not a Hydra app"
    flags = {"--cfg", "--package", "-p", "--info"}
    args = [a for i, a in enumerate(overrides) if a not in flags and (i == 0 or overrides[i - 1] not in flags)]
    default = HYDRA_DEFAULT_OVERRIDES.get(script.name)
    if default and not any(a.lstrip("+~").startswith("experiment=") for a in args):
        args.insert(0, default)
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name=config_name.group(1), overrides=args, return_hydra_config=True)
    for key in ("strategy", "fabric_strategy"):
        node = cfg.get(key)
        if node is not None and str(node.get("_target_", "")).startswith("lightning_pstar."):
            import lightning_pstar

            cls = getattr(lightning_pstar, str(node._target_).rsplit(".", 1)[1])
            cls.from_config(OmegaConf.create(OmegaConf.to_container(node, resolve=True)))


def _check_python(args: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if not rest:  # the command named in prose ("... `python -m lightning_pstar.consolidate` prints ..."): it exists
            assert importlib.util.find_spec(module) is not None, f"no module {module}"
        elif module == "lightning_pstar.plan":
            from lightning_pstar.planning.cli import _parser as plan_parser

            _parse_only(lambda argv: plan_parser().parse_args(argv), rest, monkeypatch)
            target = next((a for a in rest if not a.startswith("-")), None)
            if target is not None and target.endswith((".yaml", ".yml")):
                assert (ROOT / target).is_file(), f"{target} does not exist"
        elif module == "lightning_pstar.consolidate":
            from lightning_pstar.checkpoint.cli import _parser as consolidate_parser

            _parse_only(lambda argv: consolidate_parser().parse_args(argv), rest, monkeypatch)
        else:
            raise AssertionError(f"no check for `python -m {module}`: add one here")
        return
    script = ROOT / args[0]
    assert script.is_file(), f"{args[0]} does not exist"
    if script.parent.name == "examples":
        _check_hydra_app(script, args[1:])
    elif script.parent.name == "benchmarks":
        _parse_only(_load(script).main, args[1:], monkeypatch)
    else:
        raise AssertionError(f"no check for scripts under {script.parent}: add one here")


def _check_pytest(args: list[str]) -> None:
    for arg in args:
        if arg.startswith("tests"):
            path = arg.split("::")[0]
            assert (ROOT / path).exists(), f"{path} does not exist"


def _check_pip(args: list[str]) -> None:
    import tomllib

    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for arg in args:
        found = re.fullmatch(r"\.\[([\w,]+)\]", arg)
        if found:
            assert set(found.group(1).split(",")) <= extras, f"unknown extra in {arg} (known: {sorted(extras)})"


@pytest.mark.parametrize("command", ALL_COMMANDS, ids=str)
def test_command_parses(command: Command, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)
    for args in _split(command.text):
        program, rest = args[0], args[1:]
        assert program in KNOWN_PROGRAMS, f"unknown program {program!r} in `{command.text}`"
        if program == "python":
            _check_python(rest, monkeypatch)
        elif program == "pytest":
            _check_pytest(rest)
        elif program == "pip":
            _check_pip(rest)
        elif program == "bash":
            assert (ROOT / rest[0]).is_file(), f"{rest[0]} does not exist"


def test_the_pages_show_commands() -> None:
    assert len(ALL_COMMANDS) > 40, "the command extraction found too little: check the patterns"
    assert any("examples/train_gpt.py" in c.text for c in ALL_COMMANDS)


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _links() -> Iterator[tuple[str, str]]:
    for page in PAGES:
        for target in _LINK.findall(_FENCE.sub("", page.read_text())):
            if not re.match(r"[a-z]+:", target):
                yield str(page.relative_to(ROOT)), target


@pytest.mark.parametrize(("page", "target"), list(_links()))
def test_relative_link_resolves(page: str, target: str) -> None:
    path, _, anchor = target.partition("#")
    file = (ROOT / page).parent / path if path else ROOT / page
    assert file.exists(), f"{page} links to {target}, which does not exist"
    if anchor and file.suffix == ".md":
        headings = [_slug(h) for h in re.findall(r"^#+ (.+)$", _FENCE.sub("", file.read_text()), re.M)]
        assert anchor in headings, f"{page} links to #{anchor}, not a heading of {path or page}: {headings}"


@pytest.mark.parametrize(
    "text",
    [
        "python benchmarks/placement.py --budgetz 0.5",
        "python examples/train_gpt.py strategy.chunks.sise=4096",
        "python examples/train_gpt.py strategy.placement.policy=sometimes",
        "python -m lightning_pstar.plan configs/model/gpt_small.yaml --device-memory lots --host-memory 1GiB",
        "python examples/no_such_script.py",
        "pytest tests/unit/test_no_such_file.py",
    ],
)
def test_a_wrong_command_fails_the_check(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(Exception):  # noqa: B017 - any failure of the check: argparse, Hydra, config or path
        test_command_parses(Command("test", text), monkeypatch)
