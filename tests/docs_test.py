"""The project's text says what it is, and the module map names every module.

Two checks over the repository's own files (plain python, no JAX):

* No tracked text file tells how the project was made: run dates, who was
  given which machine, the issue tracker. `HISTORY` lists the phrases,
  each written so that it does not match itself. A hit fails with
  file:line and the text; say what the code does or what a figure is, and
  the command that measures it, instead. A commit hash with a figure is
  fine.
* docs/architecture.md's table under "## The modules" names every module
  under pallas_emb/ (each .py file by its path, a package by its directory,
  `kernels/`) and no module that is gone.
"""

import os
import re
import subprocess
from unittest import mock

from absl.testing import absltest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(REPO, "pallas_emb")
ARCHITECTURE = os.path.join(REPO, "docs", "architecture.md")
MODULES_HEADING = "## The modules"

# Phrases of the project's history, not of what it is (case-insensitive).
# A bracketed letter keeps each pattern from matching its own source line.
HISTORY = (
    r"\bse[s]sions?\b",                   # who worked when
    r"\bl[e]nt\b",                        # who was given which machine
    r"\bno [GT]PU w[a]s\b",
    r"\bthis machine h[a]d\b",
    r"\bthe (?:idle|shared) m[a]chine\b",  # the state of a past run's host
    r"\b20\d\d-[01]\d-[0-3]\d\b",         # a date
    r"\b[0-2]?\d:[0-5]\d U[T]C\b",        # a time of day
    r"\b(?:morn[i]ng|aftern[o]on|even[i]ng)\b",
    r"\bthe l[e]ad\b",                    # who did what
    r"\bthe l[e]ase\b",
    r"\bs[t]op \d+\b",                    # a milestone of the work
    r"\bthe issue'?s\b",                  # the tracker, which users lack
    r"\bissue \d+\b",
    r"\bwe tr[i]ed\b",
)
HISTORY_RE = re.compile("|".join(f"(?:{p})" for p in HISTORY), re.IGNORECASE)

SKIPPED_DIRS = {".git", "__pycache__", "node_modules", ".pytest_cache"}


def tracked_files() -> list[str]:
  """Repository-relative paths of the tracked files; without git (or
  outside a checkout), every file under the repository but .git, caches
  and virtual environments."""
  try:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True,
                         capture_output=True, timeout=60).stdout
    paths = [p for p in out.decode().split("\0") if p]
    if paths:
      return paths
  except (OSError, subprocess.SubprocessError):
    pass
  paths = []
  for root, dirs, files in os.walk(REPO):
    dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS
               and not os.path.exists(os.path.join(root, d, "pyvenv.cfg"))]
    paths += [os.path.relpath(os.path.join(root, f), REPO) for f in files
              if f not in SKIPPED_DIRS]  # a worktree's .git is a file
  return paths


def text_of(path: str) -> str | None:
  """The file's text, or None for a binary file (a PNG, a wheel) or one
  that is gone from the work tree."""
  try:
    with open(os.path.join(REPO, path), "rb") as f:
      raw = f.read()
  except OSError:
    return None
  if b"\0" in raw:
    return None
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError:
    return None


def history_hits(path: str, text: str) -> list[str]:
  return [f"{path}:{n}: {m.group(0)!r} in {line.strip()[:120]!r}"
          for n, line in enumerate(text.splitlines(), 1)
          for m in HISTORY_RE.finditer(line)]


def package_modules() -> set[str]:
  """Every module under pallas_emb/, relative to it: `x.py` for a file,
  `pkg/` for a package (its `__init__.py`), the top `__init__.py` too."""
  modules = {"__init__.py"}
  for root, dirs, files in os.walk(PACKAGE):
    dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
    rel = os.path.relpath(root, PACKAGE).replace(os.sep, "/")
    prefix = "" if rel == "." else rel + "/"
    if prefix and "__init__.py" in files:
      modules.add(prefix)
    modules.update(prefix + f for f in files
                   if f.endswith(".py") and f != "__init__.py")
  return modules


def mapped_modules(markdown: str) -> set[str]:
  """The modules named in the first column of the table under
  MODULES_HEADING: every backticked `x.py` or `pkg/` there."""
  section = markdown.split(MODULES_HEADING, 1)[1].split("\n## ", 1)[0]
  names = set()
  for line in section.splitlines():
    cells = line.split("|")
    if line.startswith("|") and len(cells) > 2:
      names.update(n for n in re.findall(r"`([^`]+)`", cells[1])
                   if n.endswith((".py", "/")))
  return names


class HistoryTest(absltest.TestCase):

  def test_patterns_fire_on_history_and_not_on_the_library(self):
    # A "|" splits each example's phrase, so this file does not hit itself.
    history = ["No GPU w|as given", "it was l|ent to me", "this se|ssion",
               "measured 2026|-12-04", "at 18:35 U|TC", "the morn|ing's run",
               "st|op 36", "the iss|ue's target", "see iss|ue 15",
               "we tr|ied it", "the le|ad's tests", "on the idle mach|ine",
               "the le|ase ended", "this machine h|ad two cores"]
    for line in history:
      self.assertRegex(line.replace("|", ""), HISTORY_RE)
    legit = ["an earlier save's files", "the leading dim", "a release year",
             "silent", "MovieLens-1M is not on this machine", "v5e at 8df6ccf",
             "the DMA issue rate", "is used to compute", "0.10.x"]
    for line in legit:
      self.assertNotRegex(line, HISTORY_RE)

  def test_without_git_the_tree_is_walked(self):
    with mock.patch.object(subprocess, "run", side_effect=OSError("no git")):
      paths = tracked_files()
    self.assertIn("README.md", paths)
    self.assertIn(os.path.join("pallas_emb", "__init__.py"), paths)
    self.assertFalse([p for p in paths if p.split(os.sep)[0] == ".git"
                      or "__pycache__" in p.split(os.sep)])

  def test_no_history_in_tracked_text(self):
    paths = tracked_files()
    self.assertIn("README.md", paths)
    this_file = os.path.relpath(os.path.abspath(__file__), REPO)
    hits = []
    for path in sorted(set(paths) | {this_file}):  # this file is checked too
      text = text_of(path)
      if text is not None:
        hits += history_hits(path, text)
    if hits:
      self.fail("\n".join(hits) + (
          "\nThese lines tell how the project was made (dates, machines, "
          "who ran what, the tracker). Say what the code does or what a "
          "figure is, with the command that measures it (a commit hash is "
          "fine)."))


class ArchitectureTest(absltest.TestCase):

  def setUp(self):
    super().setUp()
    with open(ARCHITECTURE, encoding="utf-8") as f:
      self.mapped = mapped_modules(f.read())

  def test_the_parser_reads_the_module_table(self):
    markdown = ("## The modules\n\n| module | what it owns |\n|---|---|\n"
                "| `a.py`, `pkg/` | the `b.py` of it |\n| `pkg/c.py` | c |\n"
                "\n## Next\n\n| `d.py` | elsewhere |\n")
    self.assertEqual(mapped_modules(markdown), {"a.py", "pkg/", "pkg/c.py"})

  def test_every_module_is_on_the_map(self):
    missing = sorted(package_modules() - self.mapped)
    if missing:
      self.fail(
          f"docs/architecture.md does not name these modules of "
          f"pallas_emb/: {', '.join(missing)}. Add a row per module to the "
          f"table under '{MODULES_HEADING}' (its path under pallas_emb/; a "
          f"package as its directory), e.g.\n" + "\n".join(
              f"| `{m}` | what it owns, in a line |" for m in missing))

  def test_no_module_on_the_map_is_gone(self):
    stale = sorted(self.mapped - package_modules())
    if stale:
      self.fail(
          f"docs/architecture.md names modules that pallas_emb/ does not "
          f"have: {', '.join(stale)}. Remove or rename them in the table "
          f"under '{MODULES_HEADING}'.")


if __name__ == "__main__":
  absltest.main()
