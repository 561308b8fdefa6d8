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
