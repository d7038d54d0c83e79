"""The READMEs and guides tell the truth about the tree: the virtual environment comes before any `python`
command, every relative link (anchors included) resolves, every command names a script that exists, with
flags that some module of the repository defines and launcher variables that the launcher reads."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import helpers

REPO = helpers.REPO_ROOT
ACTIVATE = "source .venv/bin/activate"
# Names of files that are not in this repository: DeepSpeed's, the official SQuAD scripts, a file made by
# a command in the text.
EXTERNAL_FILES = {"zero_to_fp32.py", "ds_to_universal.py", "evaluate-v1.1.py", "evaluate-v2.0.py", "lans_before.py"}

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A command: optional VAR=value prefixes, then the program and its script.
COMMAND = re.compile(r"(?P<env>(?:\b[A-Z][A-Z0-9_]*=\S*\s+)*)"
                     r"(?<![\w/.-])(?P<program>python|bash|source|torchrun)\s+(?P<args>.*)")
FLAG = re.compile(r"(?<![\w-])(--[a-zA-Z][\w-]*)")
DEFINED_FLAG = re.compile(r"""["'](--[a-zA-Z][\w-]*)["']""")
FILE_NAME = re.compile(r"(?<![\w./$<-])([\w./-]*[\w-]\.(?:py|sh))\b")
HL_VARIABLE = re.compile(r"\bHL_[A-Z0-9_]+\b")


def documents() -> list:
    """The texts a user reads: the READMEs and the guides in docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md",
            REPO / "tests" / "README.md", REPO / "data" / "README.md"]


def tracked_files() -> list:
    return subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set:
    """The anchors of a markdown text's headings (outside code blocks), with GitHub's -1, -2 for repeats."""
    seen, result = {}, set()
    for line in FENCE.sub("", text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*)", line)
        if heading:
            base = slug(heading.group(1))
            count = seen.get(base, 0)
            result.add(base if count == 0 else f"{base}-{count}")
            seen[base] = count + 1
    return result


def broken_links(path: Path, text: str) -> list:
    """The relative links of `text` (the file at `path`) whose file or anchor does not exist."""
    problems = []
    for target in LINK.findall(FENCE.sub("", text)):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: outside the repository
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            problems.append(f"{path.name}: link to {target}: no such file")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked.read_text())):
            problems.append(f"{path.name}: link to {target}: no such heading")
    return problems


def commands(text: str) -> list:
    """Every command of a text: the lines of its code blocks (with continuations joined) and its code spans."""
    lines = []
    for block in FENCE.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    lines += CODE_SPAN.findall(FENCE.sub("", text))
    found = []
    for line in lines:
        line = line.split(" #")[0]
        for part in re.split(r"&&|;|\|", line):
            match = COMMAND.search(part.strip())
            if match:
                found.append(match)
    return found


def defined_flags() -> set:
    flags = set()
    for name in tracked_files():
        if name.endswith(".py"):
            flags.update(DEFINED_FLAG.findall((REPO / name).read_text()))
    return flags


def script_of(match: re.Match):
    """The repository file a command runs (None when it runs a module, pytest or a placeholder), and the rest."""
    words = match.group("args").split()
    if match.group("program") == "torchrun":
        words = [word for word in words if word.endswith(".py")] or words
    while words and words[0].startswith("-") and words[0] != "-m":
        words = words[1:]  # interpreter options such as -u
    if not words:
        return None, []
    if words[0] == "-m":
        module = words[1] if len(words) > 1 else ""
        if not (REPO / module.split(".")[0]).exists() and not (REPO / f"{module}.py").exists():
            return None, []  # a module of an installed package (pytest, wikiextractor)
        base = REPO / module.replace(".", "/")
        return (base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__main__.py"), words[2:]
    if words[0].startswith(".venv/"):
        return None, []  # made by the setup script, not tracked
    return REPO / words[0], words[1:]


def broken_commands(path: Path, text: str, flags: set) -> list:
    """Commands of `text` that run a file that does not exist, pass a flag no module defines, or set a
    variable that the launcher does not read."""
    problems = []
    for match in commands(text):
        script, rest = script_of(match)
        if script is None or not script.is_relative_to(REPO) or re.search(r"[A-Z]{2,}|\.\.\.|…|<",
                                                                        str(script.relative_to(REPO))):
            continue  # a placeholder such as REPO/scripts/... or /path/to/venv
        if not script.is_file():
            problems.append(f"{path.name}: `{match.group(0).strip()}`: {script.relative_to(REPO)} does not exist")
            continue
        if match.group("program") == "python":
            problems += [f"{path.name}: `{match.group(0).strip()}`: {flag} is defined nowhere"
                         for flag in FLAG.findall(" ".join(rest)) if flag not in flags]
        if match.group("program") == "bash" and script.parent.name == "scripts":
            read = script.read_text() + (REPO / "scripts" / "launch_common.sh").read_text()
            problems += [f"{path.name}: `{match.group(0).strip()}`: {variable} is not read by {script.name}"
                         for variable in re.findall(r"\b([A-Z][A-Z0-9_]*)=", match.group("env"))
                         if variable not in read]
    return problems


def missing_files(path: Path, text: str, names: set) -> list:
    """`.py`/`.sh` files named in code spans that are not in the repository (a bare name may lie anywhere)."""
    problems = []
    for span in CODE_SPAN.findall(text) + FENCE.findall(text):
        for name in FILE_NAME.findall(span):
            if Path(name).name in EXTERNAL_FILES or any(part.isupper() for part in Path(name).parts):
                continue  # not ours, or a placeholder such as REPO/scripts/...
            if "/" in name:
                known = name.lstrip("./") in names or (path.parent / name).exists()
            else:
                known = any(Path(tracked).name == name for tracked in names)
            if not known:
                problems.append(f"{path.name}: {name} does not exist")
    return problems


def test_python_commands_come_after_the_way_into_the_virtual_environment():
    for readme in (REPO / "README.md", REPO / "data" / "README.md"):
        text = readme.read_text()
        assert ACTIVATE in text, f"{readme} never says how to enter the virtual environment"
        first_python = re.search(r"(^|`)python ", text, re.MULTILINE)
        assert first_python is None or text.index(ACTIVATE) < first_python.start(), (
            f"{readme}: a python command before '{ACTIVATE}'")


def test_readme_is_short_and_starts_with_its_contents():
    text = (REPO / "README.md").read_text()
    assert len(text.encode()) < 15_000
    first_section = text.index("\n## ")
    contents = LINK.findall(text[:first_section])
    assert contents and all(link.startswith("#") for link in contents)
    assert {link[1:] for link in contents} == {slug(h) for h in re.findall(r"^## (.*)", text, re.MULTILINE)}


def test_every_relative_link_resolves():
    problems = [problem for path in documents() for problem in broken_links(path, path.read_text())]
    assert not problems, "\n".join(problems)


def test_every_command_names_a_script_flags_and_variables_that_exist():
    flags = defined_flags()
    problems = [problem for path in documents() for problem in broken_commands(path, path.read_text(), flags)]
    assert not problems, "\n".join(problems)


def test_every_named_script_exists():
    names = set(tracked_files())
    problems = [problem for path in documents() for problem in missing_files(path, path.read_text(), names)]
    assert not problems, "\n".join(problems)


def test_map_of_the_tree_names_paths_from_the_root():
    """The README's map says where things are: each path in its tables' first column, as written, exists."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Map of the tree"):]
    section = section[:section.index("\n## ")]
    paths = [path for row in re.findall(r"^\| (.*?) \|", section, re.MULTILINE) for path in CODE_SPAN.findall(row)]
    assert len(paths) > 20 and not [path for path in paths if not (REPO / path).exists()]


def test_launcher_variables_in_the_texts_are_read_by_a_launcher():
    launchers = "".join(path.read_text() for path in (REPO / "scripts").glob("*.sh"))
    named = {variable for path in documents() for variable in HL_VARIABLE.findall(path.read_text())}
    assert named and not sorted(named - set(HL_VARIABLE.findall(launchers)))


def test_the_checks_find_what_is_broken(tmp_path):
    """Negative control: a guide with a broken link, a broken anchor, a missing script, an undefined flag,
    a variable the launcher does not read and a missing file is reported on each count."""
    md, missing_launcher = ".md", "/".join(("scripts", "no_such_launcher.sh"))  # spelt so test_texts passes over them
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / f"other{md}").write_text("# Other\n\n## A section\n")
    guide = docs / f"guide{md}"
    text = (f"# Guide\n\n[ok](other{md}#a-section) [ok too](#guide) [gone](missing{md}) [bad](other{md}#nowhere)\n\n"
            "```bash\npython run_pretraining.py --max_steps 3 \\\n    --no_such_flag 1\n"
            f"NO_SUCH_SETTING=1 bash scripts/run_bert_tiny_cpu.sh\nbash {missing_launcher}\n```\n\n"
            "See `no_such_module.py`.\n")
    guide.write_text(text)
    assert broken_links(guide, text) == [f"{guide.name}: link to missing{md}: no such file",
                                         f"{guide.name}: link to other{md}#nowhere: no such heading"]
    problems = broken_commands(guide, text, defined_flags())
    assert len(problems) == 3
    assert problems[0].endswith("--no_such_flag is defined nowhere")  # --max_steps is defined
    assert problems[1].endswith("NO_SUCH_SETTING is not read by run_bert_tiny_cpu.sh")
    assert problems[2].endswith(f"{missing_launcher} does not exist")
    assert missing_files(guide, text, set(tracked_files())) == [f"{guide.name}: no_such_module.py does not exist",
                                                                f"{guide.name}: {missing_launcher} does not exist"]


@pytest.mark.parametrize("heading, anchor", [("Gaudi's execution mode", "gaudis-execution-mode"),
                                             ("Checkpoints, resume, phase 2 and fine-tuning",
                                              "checkpoints-resume-phase-2-and-fine-tuning"),
                                             ("`run_glue.py` flags", "run_gluepy-flags")])
def test_anchors_follow_github(heading, anchor):
    assert slug(heading) == anchor


def test_data_script_finds_the_virtual_environment(tmp_path):
    """create_datasets_from_start.sh runs its steps with <repo>/.venv/bin/python when no environment is active."""
    clone = tmp_path / "clone"
    (clone / "data").mkdir(parents=True)
    shutil.copy(REPO / "data" / "create_datasets_from_start.sh", clone / "data")
    fake_python = clone / ".venv" / "bin" / "python"
    fake_python.parent.mkdir(parents=True)
    fake_python.write_text(f'#!/usr/bin/env bash\necho "$@" >> {tmp_path}/calls\n')
    fake_python.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", str(clone / "data" / "create_datasets_from_start.sh"), "sample"], env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls and all(call.startswith(str(clone / "data" / "bert_prep.py")) for call in calls)
