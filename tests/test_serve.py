"""models.serve: the OpenAI-compatible HTTP server on the CPU, with the demo model's layout
(random weights, byte-level tokenizer) at a small window, through raw HTTP (httpx) and the
official `openai` client: concurrent greedy requests answer as the same requests sent alone,
a loopback load loses nothing, bad requests get HTTP 400 without disturbing others, a client
that leaves frees its slot, and the command's flags and errors."""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from models import serve  # noqa: E402
from models.serving.openai_api import TextAssembler  # noqa: E402
from models.tokenizer import byte_tokenizer  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

WINDOW = 96
FLAGS = ["--slots", "8", "--max-seq-len", str(WINDOW), "--token-budget", "32", "--min-chunk", "32",
         "--page-size", "8", "--attention", "xla", "--port", "0"]


def tiny_model():
  """The demo model's layout (byte vocabulary, GQA, tied embeddings) at a size that compiles
  in seconds."""
  from models.generate import demo_config, demo_model
  config = dataclasses.replace(demo_config(), hidden_size=64, intermediate_size=128,
                               num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=32)
  return demo_model(0, "float32", config)


@pytest.fixture(scope="module")
def server():
  """(base URL, OpenAIServer) of a server on a loopback port, for the module's tests."""
  args = serve.parse_args(FLAGS)
  model = tiny_model()
  app, loop = serve.serve_model(model, byte_tokenizer(), model.config.eos_token_ids, args,
                                model_name="jaxflash-demo")
  sock = serve.listening_socket(args.host, 0)
  web = serve.uvicorn_server(app, sock)
  thread = threading.Thread(target=web.run, kwargs=dict(sockets=[sock]), daemon=True)
  thread.start()
  url = serve.url_of(sock)
  for _ in range(200):
    if web.started:
      break
    time.sleep(0.05)
  yield url, app
  web.should_exit = True
  thread.join(10)
  loop.close()


def _post(url, path, body, **kw):
  return httpx.post(url + path, json=body, **{"timeout": 120, **kw})


def _complete(url, prompt, max_tokens=4, **options):
  reply = _post(url, "/v1/completions", dict(prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             **options))
  assert reply.status_code == 200, reply.text
  return reply.json()


def _engine_idle(app, timeout=60.0) -> bool:
  engine = app.loop.engine
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if all(s is None for s in engine.scheduler.slots) and not engine.scheduler.waiting:
      return True
    time.sleep(0.05)
  return False


def test_health_models_and_a_completion(server):
  url, app = server
  assert httpx.get(url + "/health").json() == {"status": "ok"}
  models = httpx.get(url + "/v1/models").json()
  assert models["object"] == "list" and models["data"][0]["id"] == "jaxflash-demo"
  reply = _complete(url, "The sky is", max_tokens=5)
  choice = reply["choices"][0]
  assert reply["object"] == "text_completion" and choice["finish_reason"] in ("length", "stop")
  usage = reply["usage"]
  assert usage["prompt_tokens"] == len("The sky is")  # one token per byte
  assert 1 <= usage["completion_tokens"] <= 5
  assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
  # Token ids give the same answer as the text they encode.
  ids = list("The sky is".encode())
  assert _complete(url, ids, max_tokens=5)["choices"][0]["text"] == choice["text"]


def test_concurrent_greedy_requests_equal_the_same_requests_alone(server):
  url, _ = server
  prompts = [f"request {i}: " + "ab" * (i % 5) for i in range(12)]
  alone = [_complete(url, p, max_tokens=6)["choices"][0]["text"] for p in prompts]
  with concurrent.futures.ThreadPoolExecutor(12) as pool:
    together = list(pool.map(lambda p: _complete(url, p, max_tokens=6)["choices"][0]["text"], prompts))
  assert together == alone


def test_streaming_matches_the_whole_answer(server):
  url, _ = server
  body = dict(prompt="stream me", max_tokens=6, temperature=0)
  whole = _post(url, "/v1/completions", body).json()
  events = []
  with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=120) as r:
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
  assert events[-1] == "[DONE]"
  chunks = [json.loads(e) for e in events[:-1]]
  assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
  assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
  assert chunks[-1]["usage"] == whole["usage"]


def test_openai_client_completions_chat_and_seeds(server):
  openai = pytest.importorskip("openai")
  url, _ = server
  client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
  assert [m.id for m in client.models.list()] == ["jaxflash-demo"]
  completion = client.completions.create(model="jaxflash-demo", prompt="Hello", max_tokens=4,
                                         temperature=0)
  assert completion.usage.completion_tokens >= 1
  messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
  chat = client.chat.completions.create(model="jaxflash-demo", messages=messages, max_tokens=5,
                                        temperature=0)
  # The prompt is Qwen's chat layout: two turns, then the assistant's turn opened.
  rendered = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\n")
  assert chat.usage.prompt_tokens == len(byte_tokenizer().encode(rendered).ids)
  assert chat.choices[0].message.role == "assistant"
  streamed = client.chat.completions.create(model="jaxflash-demo", messages=messages, max_tokens=5,
                                            temperature=0, stream=True)
  assert "".join(c.choices[0].delta.content or "" for c in streamed) == chat.choices[0].message.content
  # Sampling: the same seed gives the same text, alone or not.
  sampled = [client.completions.create(model="m", prompt="Once", max_tokens=6, temperature=1.0,
                                       top_p=0.9, seed=s, extra_body={"top_k": 40}).choices[0].text
             for s in (7, 7, 8)]
  assert sampled[0] == sampled[1]


def test_loopback_load_loses_nothing(server):
  """200 requests from 32 clients at once, two tokens each: every one answered in full."""
  url, app = server

  def client(i):
    with httpx.Client(timeout=300) as http:
      replies = []
      for j in range(i, 200, 32):
        r = http.post(url + "/v1/completions", json=dict(prompt=f"load {j}", max_tokens=2,
                                                         temperature=0, stop=None))
        replies.append((j, r.status_code, r.json()))
      return replies

  with concurrent.futures.ThreadPoolExecutor(32) as pool:
    replies = [r for rs in pool.map(client, range(32)) for r in rs]
  assert sorted(j for j, _, _ in replies) == list(range(200))
  assert all(status == 200 for _, status, _ in replies)
  assert all(body["usage"]["completion_tokens"] >= 1 for _, _, body in replies)
  assert _engine_idle(app)


@pytest.mark.parametrize("path, body, message", [
    ("/v1/completions", {"max_tokens": 3}, "'prompt' must be a non-empty string"),
    ("/v1/completions", {"prompt": 5}, "'prompt' must be a non-empty string"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "'max_tokens' must be an integer >= 0"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "3"}, "'max_tokens' must be an integer"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, "'temperature' must be a number"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "'top_p' must be a number in"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "'stream' must be a boolean"),
    ("/v1/completions", {"prompt": "x", "n": 2}, "'n' must be 1"),
    ("/v1/completions", {"prompt": "x" * (WINDOW + 1)}, f"over the window of {WINDOW}"),
    ("/v1/completions", {"prompt": [1, 10_000]}, "token ids must lie in"),
    ("/v1/completions", [1, 2], "the body must be a JSON object"),
    ("/v1/chat/completions", {"messages": []}, "'messages' must be a non-empty list"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "'messages' must be a non-empty list"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2}, "'logprobs' is not supported"),
    ("/v1/completions", {"prompt": "x", "logprobs": 0}, "'logprobs' is not supported"),
    ("/v1/completions", {"prompt": "x", "echo": True}, "'echo' is not supported"),
    ("/v1/completions", {"prompt": "x", "presence_penalty": 0.5}, "'presence_penalty' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True},
     "'logprobs' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function"}]}, "'tools' is not supported"),
])
def test_bad_requests_get_400_without_disturbing_others(server, path, body, message):
  url, _ = server
  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    good = pool.submit(_complete, url, "a good one", 3)
    reply = _post(url, path, body)
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"
    assert good.result()["choices"][0]["text"] == _complete(url, "a good one", 3)["choices"][0]["text"]


def test_unsupported_fields_left_off_are_accepted(server):
  """Clients that send an unsupported field's off value (null, false, 0, 1 for best_of) are
  served."""
  url, _ = server
  body = dict(prompt="a good one", max_tokens=3, temperature=0, logprobs=None, echo=False,
              best_of=1, presence_penalty=0.0, frequency_penalty=0, logit_bias={})
  reply = _post(url, "/v1/completions", body)
  assert reply.status_code == 200
  assert reply.json()["choices"][0]["text"] == _complete(url, "a good one", 3)["choices"][0]["text"]


def test_malformed_json_gets_400(server):
  url, _ = server
  reply = httpx.post(url + "/v1/completions", content=b"{not json", timeout=30)
  assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"]


def test_a_client_that_disconnects_frees_its_slot(server, monkeypatch):
  """Steps slowed to >= 80 ms (a dispatch decodes up to 4 tokens): a request of 86 tokens
  would take 1.7 s; its client leaves after a token (streamed) or 0.3 s (whole), and the
  engine stops it long before its end."""
  url, app = server
  engine = app.loop.engine
  step = engine.step

  def slow_step():
    time.sleep(0.08)
    return step()

  monkeypatch.setattr(engine, "step", slow_step)
  body = dict(prompt="long one", max_tokens=WINDOW - 10, temperature=0, stream=True)
  for streamed in (True, False):
    before = engine.stats.get("decode_tokens", 0)
    if streamed:
      with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
          if line.startswith("data: "):
            break  # one token, then hang up
    else:
      with pytest.raises(httpx.TimeoutException):
        _post(url, "/v1/completions", dict(body, stream=False), timeout=0.3)
    assert _engine_idle(app, timeout=30)
    assert engine.stats.get("decode_tokens", 0) - before < WINDOW - 30
  assert _complete(url, "after", 2)["usage"]["completion_tokens"] >= 1


def test_stop_strings_cut_the_text():
  """The text ends before the first stop string; text that might begin one is held back."""
  tokenizer = byte_tokenizer()
  assembler = TextAssembler(tokenizer, ["END", "xy"])
  pieces = [assembler.feed(list(chunk.encode()), final=False) for chunk in ("abc", "E", "N", "Dzz")]
  assert "".join(pieces) == "abc" and assembler.stopped
  plain = TextAssembler(tokenizer, [])
  euro = list("€".encode())  # three bytes: no text until the character is whole
  assert [plain.feed([b], final=False) for b in euro] == ["", "", "€"]


@pytest.mark.parametrize("seed", range(4))
def test_streamed_text_equals_the_whole_text_cut_at_the_first_stop(seed):
  """Fed in chunks of random sizes (splitting multi-byte characters), the deltas add up to
  the whole answer's text, cut before its first stop string."""
  rng = np.random.default_rng(seed)
  tokenizer = byte_tokenizer()
  alphabet = ["a", "b", " ", "é", "€", "😀", "E", "N", "D"]
  text = "".join(rng.choice(alphabet, 60))
  stop = ["END", "€😀"][: seed % 3]
  ids = list(text.encode())
  cuts = sorted(set(rng.integers(0, len(ids), 12).tolist()) | {0, len(ids)})
  assembler = TextAssembler(tokenizer, stop)
  chunks = [ids[a:b] for a, b in zip(cuts, cuts[1:])]
  streamed = "".join(assembler.feed(c, final=i == len(chunks) - 1) for i, c in enumerate(chunks))
  firsts = [i for i in (text.find(s) for s in stop) if i >= 0]
  assert streamed == text[:min(firsts, default=len(text))]
  assert assembler.stopped == bool(firsts)


@pytest.mark.parametrize("flags, message", [
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--port", "70000"], "--port must be in [0, 65535]"),
    (["--slots", "many"], "invalid int value"),
    (["--checkpoint", "/does/not/exist"], "checkpoint folder /does/not/exist does not exist"),
    (["--slots", "0", "--port", "0"], "max_slots must be a positive int"),
    (["--prefill-lanes", "0", "--port", "0"], "prefill_lanes must be a positive int"),
])
def test_bad_flags_exit_with_one_line_and_status_2(flags, message):
  done = subprocess.run([sys.executable, "-m", "models.serve", *flags], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode == 2
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], done.stderr


def test_parse_args_defaults():
  args = serve.parse_args([])
  assert isinstance(args, argparse.Namespace)
  assert (args.host, args.port, args.checkpoint) == ("127.0.0.1", 8000, None)
  assert (args.token_budget, args.prefill_lanes, args.decode_steps) == (512, 2, 4)
