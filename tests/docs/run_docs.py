#!/usr/bin/python3
"""Runs the examples of README.md and docs/*.md, so that the pages cannot drift from the program.

A fenced block whose info string is `sh run` is run; `sh norun` (a GPU, several hosts, Slurm)
is parsed; any other fence is prose. The rules, for the pages' authors (docs/README.md):

- The `sh run` blocks of one page run in order, each with `bash -e -o pipefail`, in one fresh
  temporary directory per page that holds links to the repository's inputs/, scripts/, slurm/,
  docs/ and README.md, so that a page reads as a walk-through typed at the repository's root.
  `mpipe` is on PATH (the build's directory first), OPENBLAS_NUM_THREADS=1, root may run
  mpirun (OMPI_ALLOW_RUN_AS_ROOT*), and MPIPE_DOC_STEPS is small: blocks size their runs
  with `${MPIPE_DOC_STEPS:-N}` (N the size a reader runs).
- A ```text output block right after a `sh run` block holds lines its output (stdout and
  stderr together) must contain, in this order, not necessarily next to each other; `...`
  in a line matches any text, and a line that is only `...` is skipped.
- In a `sh norun` block every `mpipe SUBCOMMAND` (after mpirun/srun or a path) has each
  `--option` it names checked against `mpipe SUBCOMMAND --help`; an `sbatch` line's script
  must exist and the options after its config are train's; a `scripts/NAME` it runs must
  exist and be executable.
- Everywhere: every scripts/NAME.sh|py a page names must exist and be executable.

Usage: run_docs.py --bin DIR --repo ROOT PAGE.md...
Exits 1 naming the page, the block's line and what failed; prints how many blocks ran.
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^(\s*)```+\s*(.*)$")
SCRIPT = re.compile(r"\bscripts/[A-Za-z0-9_.-]+\.(?:sh|py)\b")
LINKED = ("inputs", "scripts", "slurm", "docs", "README.md", "tests")


def blocks(path):
    """Yields (info, first line number, text) for each fenced block of a Markdown page."""
    lines = open(path, encoding="utf-8").read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        info, start, body = m.group(2).strip(), i + 1, []
        i += 1
        while i < len(lines) and not re.match(r"^\s*```+\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        i += 1
        yield info, start, "\n".join(body)


def commands(text):
    """The block's command lines, continuation lines joined and comments dropped."""
    joined = re.sub(r"\\\n", " ", text)
    for line in joined.split("\n"):
        line = line.strip()
        if line and not line.startswith("#"):
            yield line


class Checker:
    def __init__(self, mpipe, repo):
        self.mpipe, self.repo, self.helps = mpipe, repo, {}

    def help_of(self, sub):
        if sub not in self.helps:
            run = subprocess.run([self.mpipe, sub, "--help"], capture_output=True, text=True)
            self.helps[sub] = run.stdout if run.returncode == 0 else None
        return self.helps[sub]

    def options(self, sub, words):
        """Each --option in words must be one of `mpipe sub --help`'s."""
        text = self.help_of(sub)
        if text is None:
            return [f"'mpipe {sub}' is not a subcommand"]
        known = set(re.findall(r"(--[A-Za-z0-9][A-Za-z0-9-]*)", text)) | {"--help"}
        bad = []
        for word in words:
            if word.startswith("--") and len(word) > 2:
                name = word.split("=", 1)[0]
                if name not in known:
                    bad.append(f"mpipe {sub} has no option {name} (see mpipe {sub} --help)")
        return bad

    def script(self, name):
        path = os.path.join(self.repo, name)
        if not os.path.exists(path):
            return [f"{name} does not exist"]
        with open(path, "rb") as f:
            module = not f.read(2) == b"#!"  # a Python module the scripts import, not run
        if not module and not os.access(path, os.X_OK):
            return [f"{name} is not executable (git update-index --chmod=+x {name})"]
        return []

    def parse(self, line):
        """Problems with one command line of a block that is not run here."""
        try:
            words = shlex.split(line, comments=True)
        except ValueError as e:
            return [f"cannot split '{line}': {e}"]
        problems = []
        for i, word in enumerate(words):
            if os.path.basename(word) == "mpipe" and i + 1 < len(words):
                problems += self.options(words[i + 1], words[i + 2:])
                break
            if word == "sbatch":
                script = next((w for w in words[i + 1:] if w.endswith(".sbatch")), None)
                if script is None:
                    return [f"no batch script in '{line}'"]
                if not os.path.exists(os.path.join(self.repo, script)):
                    problems.append(f"{script} does not exist")
                after = words[words.index(script) + 1:]
                problems += self.options("train", [w for w in after if w.startswith("--")])
                break
            if SCRIPT.fullmatch(word):
                problems += self.script(word)
                break
        return problems


def matches(expected, output):
    """The expected lines, in order, within the output (docs/README.md's rule)."""
    out = output.split("\n")
    at = 0
    for want in expected.split("\n"):
        if not want.strip() or want.strip() == "...":
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.strip().split("...")))
        while at < len(out) and not pattern.search(out[at]):
            at += 1
        if at == len(out):
            return want
        at += 1
    return None


def run_page(page, checker, env):
    errors, ran, parsed = [], 0, 0
    with open(page, encoding="utf-8") as f:
        for name in sorted(set(SCRIPT.findall(f.read()))):
            errors += [f"{page}: {p}" for p in checker.script(name)]
    items = list(blocks(page))
    with tempfile.TemporaryDirectory(prefix="mpipe-docs-") as work:
        for name in LINKED:
            os.symlink(os.path.join(checker.repo, name), os.path.join(work, name))
        last_output = None
        for info, line, text in items:
            words = info.split()
            where = f"{page}:{line}"
            if words[:2] == ["sh", "norun"]:
                parsed, last_output = parsed + 1, None
                for command in commands(text):
                    errors += [f"{where}: {p}" for p in checker.parse(command)]
            elif words[:2] == ["sh", "run"]:
                ran += 1
                print(f"--- {where}", flush=True)
                run = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", text], cwd=work, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
                last_output = run.stdout
                sys.stdout.write(run.stdout)
                if run.returncode != 0:
                    errors.append(f"{where}: the block exited {run.returncode}")
                    last_output = None
            elif words[:2] == ["text", "output"]:
                if last_output is None:
                    errors.append(f"{where}: an output block after no block that ran")
                    continue
                missing = matches(text, last_output)
                if missing is not None:
                    errors.append(f"{where}: the output lacks '{missing}' (in this order)")
            else:
                last_output = None  # prose: an output block must follow its command's block
    return errors, ran, parsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--bin", required=True, help="the build directory holding mpipe")
    ap.add_argument("--repo", required=True, help="the repository's root")
    ap.add_argument("pages", nargs="+")
    a = ap.parse_args()
    env = dict(os.environ)
    env["PATH"] = os.path.abspath(a.bin) + os.pathsep + env.get("PATH", "")
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", OMPI_ALLOW_RUN_AS_ROOT="1",
               OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    env.setdefault("MPIPE_DOC_STEPS", "4")
    checker = Checker(os.path.join(os.path.abspath(a.bin), "mpipe"), os.path.abspath(a.repo))
    failed = False
    for page in a.pages:
        errors, ran, parsed = run_page(page, checker, env)
        for e in errors:
            print(f"FAIL: {e}")
        failed = failed or bool(errors)
        print(f"{page}: {ran} blocks run, {parsed} parsed, {len(errors)} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
