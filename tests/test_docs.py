"""The docs point at files that exist: every repository path named in README.md and docs/ (code,
scripts, results, images, Ansible files) is there, and no doc names an issue number."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# where a doc's relative paths may start: the repository, the doc's folder, docs/, the Ansible tree
BASES = [ROOT, ROOT / "docs", ROOT / "deploy" / "ansible", ROOT / "deploy" / "ansible" / "roles" / "birdnet"]
PATH = re.compile(r"(?<![\w/.$-])((?:[\w-]+/)+[\w.-]+\.(?:py|sh|md|json|png|yml|yaml|toml|j2|txt))(?![\w/])")


def test_every_path_a_doc_names_exists():
    missing, checked = [], 0
    for doc in DOCS:
        for m in PATH.finditer(doc.read_text()):
            p = m.group(1)
            checked += 1
            if p.startswith(("/", "~")):
                continue
            if not any((base / p).exists() for base in [doc.parent, *BASES]):
                missing.append(f"{doc.relative_to(ROOT)}: {p}")
    assert checked > 50, f"only {checked} paths found: the pattern no longer matches the docs"
    assert not missing, "docs name files that do not exist:\n" + "\n".join(missing)


def test_no_issue_numbers_in_docs():
    hits = [f"{doc.relative_to(ROOT)}: {m.group(0)}" for doc in DOCS
            for m in re.finditer(r"\bissues? #?[0-9]+", doc.read_text(), flags=re.I)]
    assert not hits, hits
