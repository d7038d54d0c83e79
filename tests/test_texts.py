"""The repository's texts (docs, docstrings, messages, scripts) name only files that exist."""

import re
import subprocess

import helpers

# A repository path: one of the top-level folders, then a file name with a known extension; not part of a
# longer path (a temporary directory, a package inside site-packages).
FOLDERS = "scripts|tests|data|bench|common|training|finetune|\\.ci"
REPO_PATH = re.compile(rf"(?<![\w./$-])((?:{FOLDERS})/[\w./-]*\w\.(?:py|sh|json|md|txt|tsv))\b")
MARKDOWN_NAME = re.compile(r"(?<![\w./-])([\w-]+\.md)\b")


def tracked_text_files():
    names = subprocess.run(["git", "ls-files"], cwd=helpers.REPO_ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    for name in names:
        path = helpers.REPO_ROOT / name
        if path.suffix in (".py", ".sh", ".md", ".json", ".txt", "") and path.is_file() and name != "data/vocab.txt":
            try:
                yield name, path.read_text()
            except UnicodeDecodeError:
                continue


def test_texts_name_only_files_that_exist():
    markdown_files = {path.name for path in helpers.REPO_ROOT.rglob("*.md")}
    missing = []
    for name, text in tracked_text_files():
        for line_number, line in enumerate(text.splitlines(), 1):
            missing += [f"{name}:{line_number}: {path}" for path in REPO_PATH.findall(line)
                        if not (helpers.REPO_ROOT / path).exists()]
            missing += [f"{name}:{line_number}: {md}" for md in MARKDOWN_NAME.findall(line) if md not in markdown_files]
    assert not missing, "texts name files that do not exist:\n" + "\n".join(missing)
