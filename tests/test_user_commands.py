"""What a user types: `python -m models.generate`, `python -m models.train`, `make demo`.

User errors print one line, `error: ...`, on stderr and exit with status 2 (argparse's own
errors, a bad choice or a non-number, print its usage line too), before any model loads;
`--help` documents every flag with its default; PROMPT reaches the program untouched by a
shell; a stream callback stops generation only by returning exactly True; sampling settings
never recompile; `models.train --save` writes what `from_pretrained` reads back.
Commands run as subprocesses from the repository root; most fail in their argument checks,
so they take a second or two each.
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models import qwen2
from models.qwen2 import Qwen2Config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run(*argv: str, env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
  environment = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
  return subprocess.run(list(argv), cwd=ROOT, env=environment, capture_output=True, text=True,
                        timeout=timeout)


def _assert_user_error(result: subprocess.CompletedProcess, message: str) -> None:
  assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
  assert "Traceback" not in result.stderr, result.stderr[-2000:]
  lines = [line for line in result.stderr.splitlines() if line.strip()]
  assert lines[-1].startswith("error: ") or ": error: " in lines[-1], lines
  assert message in lines[-1], (message, lines[-1])


@pytest.mark.parametrize("argv, message", [
    (["--page-size", "0"], "--page-size must be a power of two >= 8, got 0"),
    (["--page-size", "7"], "--page-size must be a power of two >= 8, got 7"),
    (["--temperature", "-1"], "--temperature must be >= 0"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--top-k", "0"], "--top-k must be >= 1, got 0"),
    (["--max-new-tokens", "-2"], "--max-new-tokens must be >= 0"),
    (["--prompt", ""], "the prompt is empty"),
    (["--requests", "/nonexistent/requests.jsonl"], "requests file /nonexistent/requests.jsonl does not exist"),
    (["--dtype", "banana"], "invalid choice: 'banana'"),
    (["--top-k", "ten"], "invalid int value: 'ten'"),
    (["--max-new-tokens", "100000"], "exceed the model's max_position_embeddings"),
])
def test_generate_user_errors(argv, message):
  _assert_user_error(_run(sys.executable, "-m", "models.generate", *argv), message)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="cudnn runs on a GPU")
def test_generate_cudnn_on_a_cpu():
  _assert_user_error(_run(sys.executable, "-m", "models.generate", "--attention", "cudnn"),
                     "--attention cudnn needs a GPU")


def test_generate_checkpoint_without_vocab_size(tmp_path):
  config = Qwen2Config.tiny().to_hf_dict()
  del config["vocab_size"]
  (tmp_path / "config.json").write_text(json.dumps(config))
  (tmp_path / "tokenizer.json").write_text("{}")
  _assert_user_error(_run(sys.executable, "-m", "models.generate", "--checkpoint", str(tmp_path)),
                     "config.json lacks vocab_size")


@pytest.mark.parametrize("flag", ["--steps", "--seq-len", "--batch", "--log-every"])
def test_train_user_errors(flag):
  _assert_user_error(_run(sys.executable, "-m", "models.train", flag, "0"), f"{flag} must be >= 1, got 0")


@pytest.mark.parametrize("module, flags", [
    ("models.generate", ["--prompt", "--top-k", "--top-p", "--seed", "--temperature", "--page-size",
                         "--max-new-tokens", "--slots", "--dtype", "--prompt-env"]),
    ("models.train", ["--steps", "--batch", "--seed", "--log-every", "--weight-decay", "--seq-len",
                      "--lr", "--save"]),
])
def test_help_documents_every_flag_with_its_default(module, flags):
  result = _run(sys.executable, "-m", module, "--help", env={"COLUMNS": "200"})
  assert result.returncode == 0, result.stderr
  entries: dict[str, str] = {}  # flag -> its help text (argparse may wrap it onto more lines)
  flag = None
  for line in result.stdout.splitlines():
    if line.startswith("  -"):
      flag = line.split()[0].rstrip(",")
      entries[flag] = line
    elif flag is not None and line.startswith("   "):
      entries[flag] += " " + line.strip()
    else:
      flag = None
  for flag in flags:
    text = " ".join(entries[flag].split())
    assert "(default: " in text, text
    help_words = text.split(None, 2)[-1].split("(default:")[0].split()
    assert len(help_words) >= 2, text


def _fake_setup(tmp_path) -> dict[str, str]:
  """make variables that run the Makefile's demo recipe with this Python and no install."""
  venv = tmp_path / "venv"
  (venv / "bin").mkdir(parents=True)
  python = venv / "bin" / "python"
  python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')  # this interpreter, its packages
  python.chmod(0o755)
  (venv / ".setup").touch()  # newer than pyproject.toml: nothing to install
  return {"VENV": str(venv)}


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_demo_passes_the_prompt_untouched(tmp_path):
  prompt = "costs $5 `date` \"quoted\" 'single' $(HOME) \\n"
  variables = _fake_setup(tmp_path)
  argv = ["make", "-s", "demo", *(f"{k}={v}" for k, v in variables.items()),
          "ARGS=--max-new-tokens 0"]
  result = _run(*argv, env={"PROMPT": prompt})  # from the environment
  assert result.returncode == 0, result.stderr[-2000:]
  assert f"prompt:    {prompt!r}" in result.stdout, result.stdout
  result = _run(*argv, f"PROMPT={prompt}")  # on make's command line
  assert result.returncode == 0, result.stderr[-2000:]
  assert f"prompt:    {prompt!r}" in result.stdout, result.stdout
  result = _run(*argv, "PROMPT=")
  assert result.returncode != 0
  assert "error: the prompt is empty ($PROMPT)" in result.stderr, result.stderr[-2000:]


@pytest.fixture(scope="module")
def tiny_model():
  return qwen2.random_model(Qwen2Config.tiny(), seed=0)


def test_stream_stops_only_on_true_and_sampling_values_never_recompile(tiny_model):
  """A callback returning a truthy non-True value (tqdm's update() returns True only when
  it redraws; 1, "yes") goes on; exactly True stops. Each sampling mode (greedy, plain,
  filtered by top-k / top-p) compiles once for the prompt bucket; new temperature / top-k /
  top-p values reuse it."""
  sampler = qwen2.Sampler(tiny_model, attention_impl="xla")
  prompts = [[5, 6, 7], [8, 9]]
  full = sampler(prompts, 4, eos_token_id=()).tokens
  assert [len(t) for t in full] == [4, 4]
  assert sampler(prompts, 4, eos_token_id=(), stream=lambda _: 1).tokens == full
  assert sampler(prompts, 4, eos_token_id=(), stream=lambda _: "yes").tokens == full
  assert sampler(prompts, 4, eos_token_id=(), stream=lambda _: True).tokens == [t[:1] for t in full]
  sizes = lambda: (sampler.steps.prefill._cache_size(), sampler.steps.decode_steps._cache_size())
  assert sizes() == (1, 1)
  for options in (dict(temperature=0.7), dict(temperature=1.3, top_k=5)):  # plain, filtered
    sampler(prompts, 4, eos_token_id=(), **options)
  assert sizes() == (3, 3)
  for options in (dict(temperature=0.9, top_p=0.8), dict(temperature=2.0, top_k=3, top_p=0.5),
                  dict(temperature=1, seed=3)):
    tokens = sampler(prompts, 4, eos_token_id=(), **options).tokens
    assert [len(t) for t in tokens] == [4, 4]
  assert sizes() == (3, 3)


def test_save_pretrained_round_trip(tiny_model, tmp_path):
  qwen2.save_pretrained(tiny_model, tmp_path)
  loaded = qwen2.from_pretrained(tmp_path)
  assert loaded.config == tiny_model.config.__class__(**{**vars(tiny_model.config), "torch_dtype": "float32"})
  ours = dict(nnx.to_flat_state(nnx.split(tiny_model)[1]))
  theirs = dict(nnx.to_flat_state(nnx.split(loaded)[1]))
  assert ours.keys() == theirs.keys()
  for path in ours:
    np.testing.assert_array_equal(np.asarray(theirs[path][...]), np.asarray(ours[path][...]), err_msg=str(path))
  tokens = jnp.asarray([[1, 2, 3, 4]], jnp.int32)
  np.testing.assert_array_equal(np.asarray(loaded(tokens, attention_impl="xla")),
                                np.asarray(tiny_model(tokens, attention_impl="xla")))


def test_train_save_writes_a_checkpoint(tmp_path):
  """`models.train --save DIR` after two steps (the first, at warmup, has learning rate 0):
  DIR loads with from_pretrained, with the demo model's config and weights that moved from
  the initial ones."""
  from models.generate import demo_config
  result = _run(sys.executable, "-m", "models.train", "--steps", "2", "--batch", "1", "--seq-len", "8",
                "--attention", "xla", "--save", str(tmp_path))
  assert result.returncode == 0, result.stderr[-2000:]
  assert {p.name for p in tmp_path.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
  loaded = qwen2.from_pretrained(tmp_path)
  assert loaded.config.vocab_size == demo_config().vocab_size
  assert loaded.config.num_hidden_layers == demo_config().num_hidden_layers
  initial = qwen2.random_model(demo_config(), seed=0)
  before = np.asarray(initial.embedder.embedding[...])
  after = np.asarray(loaded.embedder.embedding[...])
  assert before.shape == after.shape and not np.array_equal(before, after)


def test_requests_file_skips_bad_lines_and_keeps_their_numbers(tmp_path, capsys):
  """models/serving/demo.py promises a bad line is reported and skipped: not JSON, no
  prompt, a setting of the wrong type ("max_new_tokens": "ten"). The good lines keep their
  line numbers, by which results and refusals are printed."""
  from models.serving.demo import read_requests
  path = tmp_path / "requests.jsonl"
  path.write_text('"first"\n{not json\n\n{"prompt": "x", "max_new_tokens": "ten"}\n{"text": "no prompt"}\n'
                  '{"prompt": "last", "temperature": 0.5, "top_k": 3}\n')
  requests = read_requests(str(path))
  assert [number for number, _ in requests] == [1, 6]
  assert requests[1][1] == {"prompt": "last", "temperature": 0.5, "top_k": 3}
  err = capsys.readouterr().err.splitlines()
  assert [line.split(":")[1] for line in err] == ["2", "4", "5"], err
  assert "max_new_tokens='ten'" in err[1]
  empty = tmp_path / "empty.jsonl"
  empty.write_text("{bad\n")
  with pytest.raises(SystemExit) as exit_info:
    read_requests(str(empty))
  assert exit_info.value.code == 2
