"""Every name the README documents exists: each `jaxflash.X.Y` resolves as a user would reach
it, attributes from the package down (a submodule imported where its parent is a module)."""
from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
NAMES = sorted(set(re.findall(r"`(jaxflash(?:\.\w+)+)", README.read_text())))


def _resolve(dotted: str):
  parts = dotted.split(".")
  obj = importlib.import_module(parts[0])
  for i, part in enumerate(parts[1:], start=1):
    if hasattr(obj, part):
      obj = getattr(obj, part)
    elif inspect.ismodule(obj):  # a submodule its package does not import by name
      obj = importlib.import_module(".".join(parts[:i + 1]))
    else:  # e.g. `jaxflash.attention.x`: the function jaxflash.attention hides the module
      raise AttributeError(f"{'.'.join(parts[:i])} has no attribute {part!r}")
  return obj


def test_readme_names_some():
  assert "jaxflash.mosaic_reason" in NAMES


@pytest.mark.parametrize("dotted", NAMES)
def test_documented_name_exists(dotted):
  assert _resolve(dotted) is not None


def test_a_name_behind_the_attention_function_does_not_resolve():
  with pytest.raises(AttributeError):
    _resolve("jaxflash.attention.mosaic_reason")
  assert _resolve("jaxflash.mosaic_reason").__name__ == "mosaic_reason"


DOCUMENTS = ["README.md", "bench/PERFORMANCE.md", "bench/studies/results/mosaic_prefill_runs.md",
             "bench/studies/results/backward_fault.md"]


@pytest.mark.parametrize("document", DOCUMENTS)
def test_relative_links_lead_to_files(document):
  """Every relative Markdown link (results, logs, sources) names a file of the repository."""
  path = README.parent / document
  links = re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", path.read_text())
  missing = [link for link in links if not (path.parent / link).exists()]
  assert links and not missing, missing


def test_readme_is_short_and_says_what_is_current():
  text = README.read_text()
  assert len(text.splitlines()) <= 200
  assert not re.search(r"\bbefore (the|a|an) [\w-]+ (fix|restructure|reference)", text)
