"""The docs site builds with `mkdocs build --strict` (every link, anchor and image resolves; docstrings parse) and has its pages."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def nav_pages(nav: list[Any]) -> list[str]:
    """The Markdown files the nav names, depth first."""
    out: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        if isinstance(value, list):
            out += nav_pages(value)
        elif isinstance(value, str) and value.endswith(".md"):
            out.append(value)
    return out


def built_page(site: Path, md: str) -> Path:
    """Where mkdocs (use_directory_urls) writes the page of ``md``."""
    stem = md.removesuffix(".md")
    return site / ("index.html" if stem == "index" else f"{stem.removesuffix('/index')}/index.html")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    # The API reference is read from the source (static analysis): Ray and torch need not import, so shadow
    # them with packages that fail on import.
    blocked = tmp_path_factory.mktemp("blocked")
    for name in ("ray", "torch"):
        (blocked / name).mkdir()
        (blocked / name / "__init__.py").write_text(f"raise ImportError('the docs build must not import {name}')\n")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(blocked)}
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out


def test_every_page_of_the_nav_is_built(site: Path) -> None:
    from mkdocs.config import load_config

    config = load_config(str(ROOT / "mkdocs.yml"))
    pages = nav_pages(config["nav"])
    for md in ["index.md", "quickstart.md", "architecture.md", "client.md", "reference/client.md", "operations.md", "ray.md",
               "kubernetes.md", "security.md", "reliability.md", "benchmarks.md", "simulator.md"]:  # fmt: skip
        assert md in pages
    for md in pages:
        assert built_page(site, md).is_file(), f"{md} is in the nav but was not built"


def test_the_api_reference_is_generated_from_docstrings(site: Path) -> None:
    html = "".join(p.read_text() for p in (site / "reference").rglob("index.html"))
    for anchor in ["trainer_client.CheckpointClient.save", "trainer_client.CheckpointClient.load", "trainer_client.dcp.MemStoreWriter",
                   "trainer_client.dcp.MemStoreReader", "trainer_client.errors.NoCheckpointError", "memstore.ray.ensure_stores",
                   "memstore.ray.train.RayTrainCheckpoints.save"]:  # fmt: skip
        assert f'id="{anchor}"' in html, anchor


def test_no_web_fonts_and_the_diagram_and_plots_are_there(site: Path) -> None:
    assert '<pre class="mermaid">' in (site / "architecture" / "index.html").read_text()
    for page in site.rglob("*.html"):
        text = page.read_text()
        assert "fonts.googleapis.com" not in text and "fonts.gstatic.com" not in text, page
    assert (site / "bench" / "issue3-headline.png").is_file()
    assert (site / "img" / "sim_ettr.png").is_file()
