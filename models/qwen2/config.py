"""Qwen2 / Qwen2.5 hyperparameters: a frozen dataclass mapped by name from a Hugging Face
`config.json`, with presets for the published Qwen2.5 shapes."""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

LAYER_TYPES = ("full_attention", "sliding_attention")  # config.json's layer_types values


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
  """Shapes and constants of a Qwen2 decoder; field names follow `config.json`.

  With use_sliding_window, the layers `layer_window` names attend through a sliding window
  of `sliding_window` keys ending at the query (Hugging Face's Qwen2 semantics, below).
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_hidden_layers: int
  num_attention_heads: int
  num_key_value_heads: int
  head_dim: int | None = None  # None: hidden_size // num_attention_heads (as in HF)
  rms_norm_eps: float = 1e-6
  rope_theta: float = 1_000_000.0
  max_position_embeddings: int = 32768
  tie_word_embeddings: bool = False
  eos_token_id: int | tuple[int, ...] | None = None
  torch_dtype: str | None = None  # the checkpoint's dtype, e.g. "bfloat16"
  # Qwen2's sliding-window attention, with config.json's names and Hugging Face's semantics.
  # When use_sliding_window, a windowed layer's query at position p attends to the
  # `sliding_window` keys p - sliding_window + 1 .. p (itself included), the other layers to
  # every key up to p. Which layers are windowed: `layer_types` when given ("full_attention"
  # or "sliding_attention" per layer, as transformers >= 4.53 writes it), else layers
  # max_window_layers and up (the first max_window_layers attend to all keys). All None when
  # use_sliding_window is off: the window is kept only where it is used (as in HF).
  use_sliding_window: bool = False
  sliding_window: int | None = None
  max_window_layers: int | None = None
  layer_types: tuple[str, ...] | None = None

  def __post_init__(self):
    if self.head_dim is None and isinstance(self.num_attention_heads, int) and self.num_attention_heads > 0:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
    if isinstance(self.eos_token_id, list):
      object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(self.layer_types, list):
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if self.use_sliding_window:
      self._check_window()
    if self.num_attention_heads % self.num_key_value_heads:
      raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                       f"num_key_value_heads ({self.num_key_value_heads})")

  def _check_window(self) -> None:
    window = self.sliding_window
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
      raise ValueError(f"sliding_window must be a positive int with use_sliding_window, got {window!r}")
    if self.layer_types is not None:
      if (len(self.layer_types) != self.num_hidden_layers
          or not set(self.layer_types) <= set(LAYER_TYPES)):
        raise ValueError(f"layer_types must name one of {LAYER_TYPES} for each of the "
                         f"{self.num_hidden_layers} layers, got {self.layer_types!r}")
    elif (not isinstance(self.max_window_layers, int) or isinstance(self.max_window_layers, bool)
          or self.max_window_layers < 0):
      raise ValueError(f"max_window_layers must be an int >= 0 with use_sliding_window (or "
                       f"layer_types given), got {self.max_window_layers!r}")

  def layer_window(self, index: int) -> int | None:
    """The sliding window of layer `index`: W when it is windowed (a query at position p
    sees keys p - W + 1 .. p), None when it sees every earlier key."""
    if not self.use_sliding_window:
      return None
    if self.layer_types is not None:
      windowed = self.layer_types[index] == "sliding_attention"
    else:
      windowed = index >= self.max_window_layers
    return self.sliding_window if windowed else None

  @property
  def layer_windows(self) -> tuple[int | None, ...]:
    """`layer_window` of every layer, in order."""
    return tuple(self.layer_window(i) for i in range(self.num_hidden_layers))

  def replace(self, **changes) -> Qwen2Config:
    return dataclasses.replace(self, **changes)

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    if self.eos_token_id is None:
      return ()
    return (self.eos_token_id,) if isinstance(self.eos_token_id, int) else tuple(self.eos_token_id)

  # --- Hugging Face config.json -------------------------------------------------------

  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> Qwen2Config:
    """Maps a Hugging Face Qwen2 `config.json` (as a dict) onto this dataclass."""
    missing = [key for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads") if key not in hf]
    if missing:
      raise ValueError(f"config.json lacks {', '.join(missing)}")
    architectures = hf.get("architectures") or []
    model_type = hf.get("model_type")
    if model_type not in (None, "qwen2") or (architectures and "Qwen2ForCausalLM" not in architectures):
      raise ValueError(f"not a Qwen2 checkpoint: model_type={model_type!r}, "
                       f"architectures={architectures!r}")
    # transformers >= 5 nests RoPE settings under "rope_parameters"; older files keep
    # "rope_theta" at the top level and "rope_scaling" beside it.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
      raise NotImplementedError(f"RoPE scaling {rope!r} is not supported")
    # transformers drops the window when use_sliding_window is off, or sliding_window null.
    window = hf.get("sliding_window", 4096)
    windowed = bool(hf.get("use_sliding_window", False)) and window is not None
    fields = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_hidden_layers=hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"],
        num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        max_position_embeddings=hf.get("max_position_embeddings", 32768),
        tie_word_embeddings=hf.get("tie_word_embeddings", False),
        eos_token_id=hf.get("eos_token_id"),
        torch_dtype=hf.get("torch_dtype", hf.get("dtype")),
        # As transformers does, the window is kept only where it is used; its defaults
        # (4096 tokens, 28 full-attention layers) fill keys the file leaves out.
        use_sliding_window=windowed,
        sliding_window=window if windowed else None,
        max_window_layers=hf.get("max_window_layers", 28) if windowed else None,
        layer_types=hf.get("layer_types") if windowed else None,
    )
    fields.update(overrides)
    return cls(**fields)

  def to_hf_dict(self) -> dict[str, Any]:
    """This config as a Hugging Face Qwen2 `config.json` dict (`from_hf_dict` reads it back)."""
    fields = dataclasses.asdict(self)
    fields["eos_token_id"] = (list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
                              else self.eos_token_id)
    fields["layer_types"] = None if self.layer_types is None else list(self.layer_types)
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **fields}

  @classmethod
  def from_pretrained(cls, path: str | os.PathLike, **overrides) -> Qwen2Config:
    """Reads `path/config.json` (or `path` itself when it is the json file)."""
    path = os.path.expanduser(os.fspath(path))
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    with open(path) as f:
      return cls.from_hf_dict(json.load(f), **overrides)

  # --- presets: the published Qwen2.5 shapes -------------------------------------------

  @classmethod
  def qwen2_5_0_5b(cls, **overrides) -> Qwen2Config:
    return cls(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
               num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True,
               eos_token_id=151643, torch_dtype="bfloat16").replace(**overrides)

  @classmethod
  def qwen2_5_1_5b(cls, **overrides) -> Qwen2Config:
    return cls(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
               num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True,
               eos_token_id=151643, torch_dtype="bfloat16").replace(**overrides)

  @classmethod
  def qwen2_5_7b(cls, **overrides) -> Qwen2Config:
    return cls(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
               num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False,
               eos_token_id=151643, torch_dtype="bfloat16").replace(**overrides)

  @classmethod
  def tiny(cls, **overrides) -> Qwen2Config:
    """Two layers, hidden 64, GQA 4:2 with head dim 16: for tests on the CPU."""
    return cls(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
               max_position_embeddings=512, tie_word_embeddings=True).replace(**overrides)


PRESETS = {
    "qwen2.5-0.5b": Qwen2Config.qwen2_5_0_5b,
    "qwen2.5-1.5b": Qwen2Config.qwen2_5_1_5b,
    "qwen2.5-7b": Qwen2Config.qwen2_5_7b,
    "tiny": Qwen2Config.tiny,
}
