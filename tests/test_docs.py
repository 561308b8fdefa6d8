"""The docs must not drift: docs/configuration.md's flag tables are generated from the config
dataclasses, docs/benchmarks.md stays a guide with one table of current figures (the dated notes live
beside their results), and every relative link in the docs reaches a file and, with an anchor, a heading."""

import pathlib
import re

from specdec_tools.cli import SERVICES, _service
from specdec.serving.config import markdown_table

REPO = pathlib.Path(__file__).resolve().parent.parent
CONFIGURATION = REPO / "docs" / "configuration.md"


def test_configuration_tables_match_the_code():
    text = CONFIGURATION.read_text()
    for name in SERVICES:
        cls, prefix, _ = _service(name)
        assert markdown_table(cls, prefix) in text, f"docs/configuration.md table for {name} is stale: run `specdec config-table`"


def test_config_from_flags_and_environment():
    from specdec.serving.config import from_argv
    from target_service.config import TargetConfig

    config = from_argv(TargetConfig, ["--port", "6000"], "SPECDEC_TARGET_", "t", env={"SPECDEC_TARGET_PORT": "7000", "SPECDEC_TARGET_DEVICE": "cpu"})
    assert config.port == 6000 and config.device == "cpu"  # the flag beats the env var; env beats default
    from coordinator.config import CoordinatorConfig

    assert from_argv(CoordinatorConfig, [], "SPECDEC_COORDINATOR_", "c", env={"SPECDEC_COORDINATOR_ADAPTIVE": "false"}).adaptive is False
    assert from_argv(CoordinatorConfig, ["--no-adaptive"], "SPECDEC_COORDINATOR_", "c", env={}).adaptive is False


def test_the_benchmarks_page_stays_a_guide_not_a_notebook():
    """Dated measurements go to benchmarks/results/<run>/NOTES.md; the page keeps how to measure and
    one table of current figures (issue 58)."""
    lines = (REPO / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(lines) < 300, f"docs/benchmarks.md has {len(lines)} lines: move dated entries beside their results"


FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"#{1,6}\s+(.*?)\s*#*\s*$")


def _outside_code(text: str, spans: bool = True) -> list[str]:
    """The lines of a markdown file, fenced blocks blanked (and inline code, with spans)."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else re.sub(r"`[^`]*`", "", line) if spans else line)
    return lines


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's anchors of a markdown file's headings: lowercase, punctuation but - and _ dropped,
    spaces to -, a repeated heading suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    for line in _outside_code(path.read_text(), spans=False):
        match = HEADING.match(line)
        if match:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1)).strip().lower()
            slug = re.sub(r"[^\w\- ]", "", text).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            if seen[slug]:
                seen[f"{slug}-{seen[slug]}"] = 0
    return set(seen)


def test_relative_links_in_the_docs_resolve():
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks" / "results").glob("*/NOTES.md"))]
    broken = []
    for source in files:
        for number, line in enumerate(_outside_code(source.read_text()), 1):
            for target in LINK.findall(line):
                if re.match(r"[a-zA-Z][a-zA-Z+.-]*:", target) or target.startswith("//"):
                    continue  # a URL
                path, _, anchor = target.partition("#")
                dest = (source.parent / path).resolve() if path else source
                where = f"{source.relative_to(REPO)}:{number}: {target}"
                if not dest.exists():
                    broken.append(f"{where} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                    broken.append(f"{where} (no such heading)")
    assert not broken, "\n".join(broken)


# The module map: docs/architecture.md, "Where the code is", names every module of the packages.
MAP_PACKAGES = ("protos", "specdec", "coordinator", "draft_service", "target_service", "specdec_tools")
BACKTICKED = re.compile(r"`([^`]+)`")


def _module_map() -> list[tuple[str, str]]:
    """The bullets of architecture.md's "Where the code is", each as (its head: the first path in
    backticks, such as `specdec/maths/`, and its whole text)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("\n## Where the code is\n", 1)[1].split("\n## ", 1)[0]
    bullets: list[list[str]] = []
    for line in section.splitlines():
        if line.startswith("- "):
            bullets.append([line])
        elif bullets and line.strip():
            bullets[-1].append(line)
    out = []
    for lines in bullets:
        body = " ".join(line.strip() for line in lines)
        head = BACKTICKED.search(body)
        out.append((head.group(1) if head else "", body))
    return out


def _modules() -> list[str]:
    """Every module file of the packages, as a repo path; empty __init__.py files left out."""
    found = []
    for package in MAP_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            if path.name == "__init__.py" and not path.read_text().strip():
                continue
            found.append(path.relative_to(REPO).as_posix())
    return found


def _bullet_for(module: str, bullets: list[tuple[str, str]]) -> tuple[str, str] | None:
    """The bullet whose head is the deepest folder holding `module`."""
    holders = [(head, body) for head, body in bullets if head.endswith("/") and module.startswith(head)]
    return max(holders, key=lambda bullet: len(bullet[0]), default=None)


def test_the_module_map_names_every_module():
    """Every module is named in the map, by its path or, in its folder's bullet, by its file name
    (issue 58: the map had missed static.py, stack.py, decoder.py, attention.py and spec/lookup.py)."""
    bullets = _module_map()
    section = " ".join(body for _, body in bullets)
    missing = []
    for module in _modules():
        if f"`{module}`" in section:
            continue
        bullet = _bullet_for(module, bullets)
        names = set(BACKTICKED.findall(bullet[1])) if bullet else set()
        if not bullet or not {module.removeprefix(bullet[0]), module.rsplit("/", 1)[1]} & names:
            missing.append(module)
    assert not missing, "docs/architecture.md, 'Where the code is', does not name: " + ", ".join(missing)


def test_the_module_map_names_only_modules_that_exist():
    """A file the map names (`x.py`) exists: by its repo path, or under its bullet's folder."""
    stale = []
    for head, body in _module_map():
        for name in BACKTICKED.findall(body):
            if not name.endswith(".py") or (REPO / name).is_file():
                continue
            folder = REPO / head if head.endswith("/") else None
            if folder is None or not any(folder.rglob(name.rsplit("/", 1)[-1])):
                stale.append(f"{name} (in the bullet of {head})")
    assert not stale, "docs/architecture.md, 'Where the code is', names files that do not exist: " + ", ".join(stale)


# Runtime docstrings and comments say why, not how many milliseconds: a timing goes stale with the
# next machine or change, and lives with its results (benchmarks/results/<run>/).
RUNTIME_PACKAGES = ("coordinator", "target_service", "draft_service", "specdec")
TIMING = re.compile(r"\b\d[\d.,]*\s?(ms|us|µs|ns|s)\b")


def _prose(path: pathlib.Path):
    """(line, text) of a module's comments and docstrings: module, class and function docstrings
    and any other string standing alone as a statement (an attribute's docstring)."""
    import ast
    import io
    import tokenize

    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for offset, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + offset, line
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string


def test_no_timings_in_runtime_docstrings_or_comments():
    found = []
    for package in RUNTIME_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            for number, line in _prose(path):
                if TIMING.search(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "timings in runtime docstrings or comments (say why; figures go to benchmarks/results/):\n" + "\n".join(found)


def test_the_docs_cite_no_scratch_paths_or_harnesses():
    """A reader can open what the docs cite: no file under /tmp, no figure of a scratch harness
    (committed results live in benchmarks/results/<run>/, scripts in benchmarks/). The term itself,
    quoted where docs/benchmarks.md says what it means in the notes, is not a citation."""
    found = []
    for source in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for number, line in enumerate(source.read_text().splitlines(), 1):
            if re.search(r"(?<![\w.~-])/tmp/\S", line) or re.search(r"(?<!\")scratch harness", line, re.IGNORECASE):
                found.append(f"{source.relative_to(REPO)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
