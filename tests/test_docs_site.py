"""The documentation: the MkDocs site builds in strict mode with its API reference generated from the
docstrings, the README stays short, its links resolve, and every command in it is run by a test.

``mkdocs.yml`` turns every broken relative link or anchor, every link that is not to a page and
every page missing from the nav into a warning, and ``--strict`` makes a warning fail the build.
"""

from __future__ import annotations

import ast
import html
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

pytestmark = pytest.mark.e2e  # end-to-end: whole runs (docs/development.md, the test tiers)

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250

# Every command line of the README's ```bash blocks (its stable prefix) -> the tests that run it.
# A command matches the longest key it starts with.
README_COMMANDS: dict[str, tuple[str, ...]] = {
    # the README's comparison of the four 2026 methods and FedIT on configs/quick.toml, in process:
    # the notebook test runs that comparison (the same config, cut to seconds; these five
    # strategies and their baselines, in process, through fedlora.compare); the Ray test runs the
    # `fedlora compare` command line itself end to end (configs/smoke.toml, with --resume)
    "fedlora compare configs/quick.toml": (
        "tests/test_compare.py::test_notebook_executes",
        "tests/test_compare.py::test_cli_compare_on_ray_writes_summary_and_pngs_and_skips_finished_runs",
    ),
    # `make docs` runs `python -m mkdocs build --strict --site-dir site` after `make install`
    "make docs": ("tests/test_docs_site.py::test_the_site_builds_in_strict_mode_with_a_generated_api_reference",),
}
# README commands no test runs, and why (said here rather than covered by a test that does not run them).
NOT_RUN_BY_A_TEST: dict[str, str] = {
    "make demo": ("a 2.5-minute run of configs/demo.toml after the installation; only its config is checked "
                  "(tests/test_config.py::test_every_shipped_config_validates)"),
    "make test": "the suite itself; CI runs it (.ci/run)",
}

COMMAND_START = re.compile(r"(make|fedlora|flwr|python|pip|\.venv/bin/\S+|ray|export|nice|tensorboard|jupyter)\b")


def bash_commands(markdown: str) -> list[str]:
    """The command lines of ``markdown``'s ```bash blocks: comment-only and continuation lines left
    out, a trailing ``# comment`` removed."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, flags=re.DOTALL):
        continued = False
        for line in block.splitlines():
            stripped = line.strip()
            if not continued and stripped and not stripped.startswith("#"):
                commands.append(re.sub(r"\s+#.*$", "", stripped))
            continued = stripped.endswith("\\")
    return commands


def command_key(command: str) -> str | None:
    keys = [key for key in (*README_COMMANDS, *NOT_RUN_BY_A_TEST) if command == key or command.startswith(key + " ")]
    return max(keys, key=len) if keys else None


def defined_tests(path: Path) -> set[str]:
    """``name`` and ``Class::name`` of every test function ``path`` defines."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    names = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef):
            names |= {f"{node.name}::{item.name}" for item in node.body
                      if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)}
    return names


@pytest.fixture(scope="module")
def built_site(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    """The build `make docs` runs, into a temporary folder (once for the tests of this module)."""
    site = tmp_path_factory.mktemp("docs") / "site"
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
                          cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    return proc, site


def page_text(page: str) -> str:
    """A built page's text: tags removed, entities unescaped, whitespace collapsed."""
    return " ".join(html.unescape(re.sub(r"<[^>]+>", " ", page)).split())


def test_the_site_builds_in_strict_mode_with_a_generated_api_reference(
        built_site: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    # Execute: the build `make docs` runs, into a temporary folder
    proc, site = built_site
    # Assert: no warning (strict), and the reference page of fedlora.schema carries the module's
    # docstring, rendered from the code (the page's source is a `::: fedlora.schema` directive)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "::: fedlora.schema" in (ROOT / "docs" / "reference" / "schema.md").read_text(encoding="utf-8")
    docstring = ast.get_docstring(ast.parse((ROOT / "fedlora" / "schema.py").read_text(encoding="utf-8")))
    assert docstring
    first_paragraph = " ".join(docstring.split("\n\n")[0].split())
    page = (site / "reference" / "schema" / "index.html").read_text(encoding="utf-8")
    assert first_paragraph in page_text(page)
    # ... and the fidelity records are data, left out of the site
    assert not (site / "results" / "records").exists()


def test_the_reference_documents_the_mapped_layers_under_their_installed_names(
        built_site: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    """strategies/, clients/ and simulations/ are documented as pyproject installs them
    (fedlora.strategies...), through the griffe extension docs/griffe_layers.py."""
    # Prepare: the first paragraph of the FedHera strategy class's docstring (strategies/fedhera.py)
    proc, site = built_site
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    tree = ast.parse((ROOT / "strategies" / "fedhera.py").read_text(encoding="utf-8"))
    fedhera = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "FedHera")
    docstring = ast.get_docstring(fedhera)
    assert docstring
    first_paragraph = " ".join(docstring.split("\n\n")[0].split())
    # Assert: the FedHera strategy page carries it, names the class by its installed path, and links
    # its base class to the page of fedlora.strategies.base (the imports between the layers resolve)
    page = (site / "reference" / "strategies-fedhera" / "index.html").read_text(encoding="utf-8")
    assert first_paragraph in page_text(page)
    assert 'id="fedlora.strategies.fedhera.FedHera"' in page
    assert 'href="../strategies-base/#fedlora.strategies.base.LoRAStrategy"' in page
    # ... and every page of the three layers documents its objects under fedlora, none under the folder's name
    anchors = {
        "strategies-base": "fedlora.strategies.base.LoRAStrategy",
        "strategies-registry": "fedlora.strategies.registry.create_strategy",
        "strategies-fedpissa": "fedlora.strategies.fedpissa",
        "strategies-feddr-lora": "fedlora.strategies.feddr_lora",
        "strategies-fedtreelora": "fedlora.strategies.fedtreelora",
        "clients-app": "fedlora.clients.app",
        "clients-trainers-base": "fedlora.clients.trainers.base.LocalTrainer",
        "simulations-inprocess": "fedlora.simulations.inprocess.InProcessGrid",
    }
    for name, anchor in {"strategies-fedhera": "fedlora.strategies.fedhera", **anchors}.items():
        page = (site / "reference" / name / "index.html").read_text(encoding="utf-8")
        assert f'id="{anchor}"' in page, name
        assert not re.search(r'id="(strategies|clients|simulations)\.', page), name


def test_the_readme_is_at_most_250_lines() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines: move detail into docs/"


def test_every_readme_command_is_run_by_a_named_test() -> None:
    # Prepare
    commands = bash_commands(README.read_text(encoding="utf-8"))
    # Assert: every command has an entry, and every entry is a README command
    assert commands, "no ```bash block in README.md"
    assert not set(README_COMMANDS) & set(NOT_RUN_BY_A_TEST)
    unlisted = [c for c in commands if command_key(c) is None]
    assert not unlisted, f"README commands without an entry in README_COMMANDS / NOT_RUN_BY_A_TEST: {unlisted}"
    assert all(COMMAND_START.match(c) for c in commands), commands
    stale = set(README_COMMANDS) | set(NOT_RUN_BY_A_TEST)
    stale -= {command_key(c) for c in commands}
    assert not stale, f"entries for commands the README no longer has: {sorted(stale)}"
    # Assert: every named test exists (file, and function, or Class::function; parameters aside)
    for key, node_ids in README_COMMANDS.items():
        assert node_ids, f"{key!r}: no test named (if none runs it, move it to NOT_RUN_BY_A_TEST with the reason)"
        for node_id in node_ids:
            file, _, name = node_id.partition("::")
            assert (ROOT / file).is_file(), node_id
            assert re.sub(r"\[.*\]$", "", name) in defined_tests(ROOT / file), node_id


def test_the_readme_links_resolve() -> None:
    # Prepare: every relative link of the README, with its anchor
    text = README.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    relative = [link for link in links if not re.match(r"[a-z]+:", link)]
    assert relative
    # Assert: the file exists, and an anchor names a heading of that page (as MkDocs spells it)
    for link in relative:
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), link
        if anchor:
            assert target.suffix == ".md", link
            assert anchor in heading_slugs(target.read_text(encoding="utf-8")), link


def heading_slugs(markdown: str) -> set[str]:
    """The anchors of a page's headings (Python-Markdown's toc slugs; code fences skipped)."""
    slugs, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (match := re.match(r"#{1,6} (.+)", line)):
            title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).replace("`", "").replace("*", "")
            slugs.add(slugify(title, "-"))
    return slugs
