"""The documentation: a one-page README that links every page of docs/, and links that resolve."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of a markdown page."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#") and not line.startswith("#!"):
            title = line.lstrip("#").strip().lower()
            out.add("#" + re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return out


def test_readme_is_one_page_that_links_every_doc():
    # issue 18: the README was a ~700-line reference; a newcomer wants one page.
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 120
    linked = {m.group(1) for m in LINK.finditer(readme)}
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages and pages <= linked, f"pages the README does not link: {sorted(pages - linked)}"


def test_every_relative_link_resolves():
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for m in LINK.finditer(page.read_text()):
            target, anchor = m.group(1), m.group(2)
            if "://" in target or target.startswith("mailto:"):
                continue
            dest = (page.parent / target).resolve()
            assert dest.exists(), f"{page.relative_to(ROOT)} links {target}, which does not exist"
            if anchor and dest.suffix == ".md":
                assert anchor in _anchors(dest), f"{page.relative_to(ROOT)} links {target}{anchor}: no such heading"


def test_the_error_list_names_every_checkpoint_error():
    # Regression (issue 19): the documented error list lacked CheckpointMismatchError.
    import xlakit
    from xlakit import errors

    page = (ROOT / "docs" / "checkpoints.md").read_text()
    listed = page[page.index("Errors:"):]
    public = [name for name in xlakit.__all__ if name.startswith("Checkpoint") and name.endswith("Error")
              and isinstance(getattr(errors, name, None), type)]
    assert public and [n for n in public if f"`{n}" not in listed] == []


def test_dir_lists_the_public_names_also_those_loaded_on_first_use():
    # Regression (issue 19): dir(xlakit) hid save, load, restore, CheckpointManager (loaded lazily).
    import xlakit

    assert set(xlakit.__all__) <= set(dir(xlakit))
