"""Packaging: `pip install jaxflash` needs jax and numpy only, and `jaxflash` imports nothing
else; the extras cover what models/, bench/ and tests/ import, and the Makefile's two
commands install the extras they run on."""
from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
# Import names whose distribution is named otherwise.
DISTRIBUTIONS = {"jaxlib": "jax", "yaml": "pyyaml", "mpl_toolkits": "matplotlib", "xdist": "pytest-xdist"}
HEAVY = ("flax", "chex", "optax", "safetensors", "tokenizers", "tqdm", "matplotlib", "torch",
         "transformers")


def _name(requirement: str) -> str:
  return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower()


def _extra(name: str, seen: frozenset = frozenset()) -> set[str]:
  """The distributions an extra pulls in, following `jaxflash[other]` references."""
  names = set()
  for requirement in PROJECT["optional-dependencies"][name]:
    if _name(requirement) == "jaxflash":
      for other in re.search(r"\[(.*)\]", requirement).group(1).split(","):
        if other not in seen:
          names |= _extra(other.strip(), seen | {name})
    else:
      names.add(_name(requirement))
  return names


def _third_party_imports(folder: str) -> set[str]:
  """Top-level distributions the .py files under folder import (stdlib and the checkout's
  own packages left out)."""
  local = {"jaxflash", "models", "bench", "tests"}
  names = set()
  for path in (ROOT / folder).rglob("*.py"):
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.Import):
        modules = [alias.name for alias in node.names]
      elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
        modules = [node.module]
      else:
        continue
      for module in modules:
        top = module.split(".")[0]
        if top not in sys.stdlib_module_names and top not in local and top != "__future__":
          names.add(DISTRIBUTIONS.get(top, top).lower())
  return names


def test_install_requires_only_jax_and_numpy():
  assert sorted(_name(r) for r in PROJECT["dependencies"]) == ["jax", "numpy"]


def test_extras():
  assert _extra("model") >= {"flax", "chex", "safetensors", "tokenizers", "tqdm"}
  assert _extra("train") >= _extra("model") | {"optax"}
  assert _extra("serve") >= _extra("model")
  assert _extra("bench") >= _extra("train") | {"matplotlib"}
  assert _extra("test") >= _extra("bench") | _extra("serve") | {"pytest", "mypy", "chex"}


def test_jaxflash_imports_only_jax_and_numpy():
  """Every module of jaxflash imports with the model stack blocked (an import of any of
  HEAVY raises)."""
  script = f"""
import importlib, importlib.abc, pkgutil, sys
class Block(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path=None, target=None):
    if name.split(".")[0] in {HEAVY!r}:
      raise ImportError("blocked: " + name)
    return None
sys.meta_path.insert(0, Block())
import jaxflash
for module in pkgutil.walk_packages(jaxflash.__path__, "jaxflash."):
  importlib.import_module(module.name)
print(sorted(name for name in sys.modules if name.split(".")[0] in {HEAVY!r}))
"""
  result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.strip() == "[]"


# bench/generate.py's Hugging Face reference (torch, transformers) comes with the test extra.
@pytest.mark.parametrize("folder, extras", [("jaxflash", ()), ("models", ("model", "train", "serve")),
                                            ("bench", ("bench", "test")), ("tests", ("test",))])
def test_extras_cover_the_imports(folder, extras):
  provided = {"jax", "numpy"}.union(*(_extra(e) for e in extras))
  optional = {"flash_attn3_jax", "tokamax"}  # peers the benchmarks run when importable (README)
  assert _third_party_imports(folder) - provided - optional == set()


def test_makefile_installs_what_its_commands_run():
  makefile = (ROOT / "Makefile").read_text()
  installs = re.findall(r'pip install -q -e "\.\[([\w,]+)\$\(EXTRA\)\]"', makefile)
  assert len(installs) == 2, installs
  demo, test = (set(group.split(",")) for group in installs)
  assert {"model"} <= demo and "test" in test
  assert _extra("model") <= set().union(*(_extra(e) for e in demo))
