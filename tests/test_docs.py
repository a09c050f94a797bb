"""The documentation: a one-page README that links every page of docs/, and links that resolve."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


# The names the README's training loop uses, defined as a small real training job: argv is the
# manager folder, total_steps, the seed of the model's initial weights and where to write the state.
_JOB = """
import sys, torch
folder, total_steps, seed, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.set_num_threads(1)  # tiny matrices: more threads would only wait on each other
torch.manual_seed(seed)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
opt = {optimizer}
data = torch.Generator().manual_seed(1)
x, y = torch.randn(32, 8, generator=data), torch.randn(32, 1, generator=data)

def train_step():
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()

{readme}
torch.save({{"model": model.state_dict(), "optimizer": opt.state_dict()}}, out)
"""


def _readme_block(marker: str) -> str:
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"expected one python block of the README with {marker!r}, found {len(found)}"
    return found[0]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["torch.optim.AdamW(model.parameters(), lr=1e-3)",
                                       "torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)"])
def test_the_readmes_training_loop_resumes_as_written(tmp_path, optimizer):
    # Regression (issue 32): the README's resume built its template from a fresh optimizer's
    # state_dict(), which has no state yet: CheckpointMismatchError for AdamW and SGD with momentum.
    block = _readme_block("CheckpointManager(")
    assert '"/ckpt/run1"' in block
    folder = tmp_path / "run1"  # the README's folder, under the test's own
    job = tmp_path / "job.py"
    job.write_text(_JOB.format(optimizer=optimizer, readme=block.replace('"/ckpt/run1"', "folder")))

    def run(seed: int, out: str) -> dict:
        done = subprocess.run([sys.executable, str(job), str(folder), "1005", str(seed), str(tmp_path / out)],
                              capture_output=True, text=True, timeout=240)
        assert done.returncode == 0, done.stderr[-3000:]
        return torch.load(tmp_path / out, weights_only=True)

    straight = run(0, "straight.pt")  # 1005 steps, saving steps 500 and 1000
    resumed = run(1, "resumed.pt")  # another start: steps 1001-1005 from the saved step 1000
    for part in ("model", "optimizer"):
        a, b = straight[part], resumed[part]
        if part == "optimizer":
            assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
            a, b = ({f"{i}/{k}": v for i, s in x["state"].items() for k, v in s.items()} for x in (a, b))
        assert a.keys() == b.keys() and a, part
        for k in a:
            assert torch.equal(a[k], b[k]), f"{part} {k}: the resumed run differs from the uninterrupted one"
