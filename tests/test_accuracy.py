"""bench.accuracy on the CPU: the --quick run end to end (kernels interpreted, no cuDNN), and
the hard inputs having the score structure their class names."""
from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from bench import accuracy, report


def test_quick_run_writes_every_row(tmp_path):
  accuracy.main(["--quick", "--out", str(tmp_path)])
  data = json.loads((tmp_path / "accuracy.json").read_text())
  rows = data["rows"]
  cases = accuracy.quick_cases()
  assert len(rows) == 5 * len(cases)
  assert [r["which"] for r in rows[:5]] == list(accuracy.WHICH)
  assert data["meta"]["commit"]  # the README tables refuse results of mixed commits
  for r in rows:
    assert {"case", "n", "d", "which", "jaxflash_err", "cudnn_err", "triton_err", "ratio"} <= set(r)
    assert r["cudnn_err"] is None and r["ratio"] is None  # no cuDNN on the CPU
    # On the CPU the default is the interpreted Triton kernel: the same numbers.
    assert r["jaxflash_err"] == r["triton_err"]
    bound = {"out": 2e-2, "lse": 1e-3}.get(r["which"], 0.2)  # bf16 inputs and outputs
    assert 0 <= r["jaxflash_err"] < bound, r
  assert (tmp_path / "accuracy.md").read_text().count("\n| ") == len(rows) + 1


@pytest.mark.parametrize("margin,position", [(20.0, 0.5), (150.0, 0.0), (60.0, 0.9)])
def test_dominant_key_stands_out_by_its_margin(margin, position):
  case = accuracy.Case("dominant_key", 64, 64, margin=margin, position=position)
  q, k, _, _ = accuracy.make_inputs(case)
  scores = jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32)) * 64 ** -0.5
  at = min(int(position * 64), 63)
  others = np.delete(np.asarray(scores), at, axis=-1)
  gap = np.asarray(scores[..., at]) - others.max(-1)
  assert np.all(np.abs(gap - margin) < 0.1 * margin + 6.0)


def test_negative_first_block_and_offset_shift_the_scores():
  low = accuracy.Case("negative_first_block", 64, 32, margin=120.0, first_block=16)
  q, k, _, _ = accuracy.make_inputs(low)
  s = np.asarray(jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32))) * 32 ** -0.5
  assert s[..., :16].max() < -100 and s[..., 16:].min() > -20
  shifted = accuracy.Case("offset", 64, 32, margin=100.0)
  q, k, _, _ = accuracy.make_inputs(shifted)
  s = np.asarray(jnp.einsum("bthd,bshd->bhts", q.astype(jnp.float32), k.astype(jnp.float32))) * 32 ** -0.5
  assert 80 < s.min() and s.max() < 120


def test_full_run_has_long_cases_of_every_class():
  cases = accuracy.full_cases()
  assert len(cases) >= 24 and sum(c.n >= 4096 for c in cases) >= 24
  assert {c.d for c in cases} == {64, 128, 256} and min(c.n for c in cases) == 1024
  assert max(c.n for c in cases) == 32768 and any(c.heads != c.kv_heads for c in cases)
  assert {"normal", "peaky", "key_scale", "dominant_key", "offset", "negative_first_block", "ragged",
          "documents"} <= {c.kind for c in cases}
  assert any(c.window is not None for c in cases)
  assert {c.margin for c in cases if c.kind == "dominant_key"} >= {20.0, 60.0, 150.0}


def test_max_error_masks_padding_and_flags_nan():
  ref = np.array([[1.0, 2.0, 0.0]])
  got = np.array([[1.5, 2.0, 9.0]])
  valid = np.array([[True, True, False]])
  assert accuracy.max_error(got, ref, valid) == 0.5
  assert accuracy.max_error(got, ref, valid, scale=2.0) == 0.25
  assert np.isnan(accuracy.max_error(np.array([[np.nan, 2.0, 0.0]]), ref, None))


def test_a_gradient_near_zero_is_measured_against_the_floor():
  """Where the reference dQ is ~1e-20 (every row saturated on one key), its error is taken over
  2^-8 of the case's largest reference gradient, not over ~0."""
  case = accuracy.Case("normal", 4, 8)
  ones = np.ones((1, 4, 1, 8))
  ref = (ones, ones[..., 0], 1e-20 * ones, 0.5 * ones, 4.0 * ones)
  scales = accuracy.gradient_scales(case, ref)
  assert scales == {"dq": 4.0 * 2.0 ** -8, "dk": 0.5, "dv": 4.0}
  got = (ones, ones[..., 0], 1e-20 * ones + 1e-6, 0.5 * ones, 4.0 * ones)
  assert accuracy.errors(case, got, ref)["dq"] == pytest.approx(1e-6 / (4.0 * 2.0 ** -8))


def test_a_run_in_parts_merges_into_one_file_of_one_commit(tmp_path, monkeypatch):
  tiny = [accuracy.Case("normal", 32, 32), accuracy.Case("peaky", 32, 32)]
  monkeypatch.setattr(accuracy, "quick_cases", lambda: tiny)
  accuracy.main(["--quick", "--kinds", "peaky", "--out", str(tmp_path)])
  accuracy.main(["--quick", "--kinds", "normal", "--merge", "--out", str(tmp_path)])
  path = tmp_path / "accuracy.json"
  rows = json.loads(path.read_text())["rows"]
  assert [r["case"] for r in rows[::5]] == ["normal", "peaky"]  # the full run's order
  data = json.loads(path.read_text())
  data["meta"]["commit"] = "0000000"
  path.write_text(json.dumps(data))
  with pytest.raises(SystemExit, match="one commit"):
    accuracy.main(["--quick", "--kinds", "normal", "--merge", "--out", str(tmp_path)])
  with pytest.raises(SystemExit, match="no input class"):
    accuracy.main(["--quick", "--kinds", "nosuch", "--out", str(tmp_path)])


def test_shapes_pick_cases_by_kind_length_and_head_dim(tmp_path, monkeypatch):
  tiny = [accuracy.Case("normal", 32, 32), accuracy.Case("peaky", 32, 32), accuracy.Case("peaky", 48, 32)]
  monkeypatch.setattr(accuracy, "quick_cases", lambda: tiny)
  accuracy.main(["--quick", "--shapes", "peaky:48:32", "--out", str(tmp_path)])
  rows = json.loads((tmp_path / "accuracy.json").read_text())["rows"]
  assert {(r["case"], r["n"]) for r in rows} == {("peaky", 48)} and len(rows) == len(accuracy.WHICH)
  with pytest.raises(SystemExit, match="--shapes"):
    accuracy.main(["--quick", "--shapes", "peaky:64:32", "--out", str(tmp_path)])


def test_a_nan_error_is_written_as_nan_not_as_missing(monkeypatch):
  case = accuracy.Case("normal", 32, 32)
  real = accuracy.provider_call

  def poisoned(provider, case_):
    run = real(provider, case_)
    if provider != "jaxflash":
      return run
    return lambda *a: tuple(x if i else x * jnp.nan for i, x in enumerate(run(*a)))
  monkeypatch.setattr(accuracy, "provider_call", poisoned)
  rows = {r["which"]: r for r in accuracy.run_case(case)}
  assert rows["out"]["jaxflash_err"] == "nan" and rows["out"]["ratio_triton"] is None
  assert isinstance(rows["dq"]["jaxflash_err"], float)
  table = report.markdown_table(list(rows.values()), accuracy.COLUMNS)
  assert "| nan |" in table


def test_cases_of_one_shape_share_their_compilations():
  """Compiling is most of a case's time, so the reference and each provider compile once per
  shape and window: two input classes of one shape add one compilation each; ragged lengths
  (data, not constants) one more, and their errors stay bf16's."""
  cases = [accuracy.Case("normal", 40, 32), accuracy.Case("peaky", 40, 32),
           accuracy.Case("ragged", 40, 32, batch=2)]
  reference, triton = accuracy._reference_fn(None), accuracy._provider_fn("triton", None)
  before = reference._cache_size(), triton._cache_size()
  for case in cases[:2]:
    q, k, v, d_out = accuracy.make_inputs(case)
    accuracy.reference(case, q, k, v, d_out)
    accuracy.provider_call("triton", case)(q, k, v, d_out)
  assert (reference._cache_size(), triton._cache_size()) == (before[0] + 1, before[1] + 1)
  q, k, v, d_out = accuracy.make_inputs(cases[2])
  with_lengths = accuracy.provider_call("triton", cases[2])(q, k, v, d_out)
  assert triton._cache_size() == before[1] + 2
  ref = accuracy.reference(cases[2], q, k, v, d_out)
  errors = accuracy.errors(cases[2], with_lengths, ref)
  assert errors["out"] < 2e-2 and errors["dq"] < 0.2, errors
