"""Reward-model scores: any Hugging Face sequence-classification model rates prompt + response.

For open-ended domains without a verifier (InstructGPT-style RLHF reward models, Ouyang et al.
2022, arXiv 2203.02155). `RewardModelScorer(model_dir)` loads an `AutoModelForSequenceClassification`
directory (a local path, or a fsspec URL such as `s3://...`, copied to a local temporary folder
once), and scores batches: the text is the tokenizer's chat template over
[user: prompt, assistant: response] when it has one, else `prompt + response`. The score is the
logit of label `label_index` (num_labels=1 models: the only one), optionally squashed:
`normalize="sigmoid"` -> sigmoid(logit) in (0, 1); `"affine"` -> (logit - shift) / scale.

`build_tiny_reward_model(path)` writes a tiny random Qwen2ForSequenceClassification with the
character tokenizer of `engines.models.modeling`, for tests and the embedded default.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Literal

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerFast


@contextlib.contextmanager
def local_model_dir(model_dir: str, storage_options: dict | None = None):
    """Yields a local folder to load `model_dir` from, inside the block: the folder itself when it is
    local; for an fsspec URL (`s3://...`), a temporary copy (credentials and endpoint from
    `storage_options` or the usual env vars) that is removed when the block ends, so a reward worker
    leaves no model-sized folder behind per load."""
    if os.path.isdir(model_dir):
        yield model_dir
        return
    if "://" not in model_dir:
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist (expected a Hugging Face model dir)")
    import fsspec

    fs, path = fsspec.core.url_to_fs(model_dir, **(storage_options or {}))
    if not fs.isdir(path):
        raise FileNotFoundError(f"model directory {model_dir!r} does not exist in object storage")
    with tempfile.TemporaryDirectory(prefix="flyroll-rm-") as local:
        fs.get(path.rstrip("/") + "/", local, recursive=True)
        yield local


def _load_tokenizer(path: str):
    tok_class = None
    cfg = os.path.join(path, "tokenizer_config.json")
    if os.path.isfile(cfg):
        with open(cfg) as f:
            tok_class = json.load(f).get("tokenizer_class")
    if tok_class in ("TokenizersBackend", "PreTrainedTokenizerFast") and os.path.isfile(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path)   # as saved (see engines.models.modeling.load_policy)
    return AutoTokenizer.from_pretrained(path)


class RewardModelScorer:
    """Batched prompt+response scoring with a sequence-classification model (eval mode, no grad)."""

    def __init__(self, model_dir: str, batch_size: int = 8, device: str = "cpu", *,
                 normalize: Literal["none", "sigmoid", "affine"] = "none", shift: float = 0.0, scale: float = 1.0,
                 label_index: int = 0, max_length: int | None = None, use_chat_template: bool | None = None,
                 dtype: torch.dtype = torch.float32, storage_options: dict | None = None):
        if batch_size < 1:
            raise ValueError(f"RewardModelScorer: batch_size={batch_size}, expected >= 1")
        if normalize not in ("none", "sigmoid", "affine"):
            raise ValueError(f"RewardModelScorer: normalize={normalize!r}, expected 'none', 'sigmoid' or 'affine'")
        if normalize == "affine" and scale == 0:
            raise ValueError("RewardModelScorer: scale=0 with normalize='affine'")
        with local_model_dir(model_dir, storage_options) as path:
            self.tokenizer = _load_tokenizer(path)
            self.model = AutoModelForSequenceClassification.from_pretrained(path, dtype=dtype).to(device).eval()
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:   # batched scoring finds each row's last token by it
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        if not 0 <= label_index < self.model.config.num_labels:
            raise ValueError(f"RewardModelScorer: label_index={label_index}, model has {self.model.config.num_labels} labels")
        self.batch_size, self.device, self.label_index = batch_size, device, label_index
        self.normalize, self.shift, self.scale = normalize, shift, scale
        self.max_length = max_length
        self.use_chat_template = bool(getattr(self.tokenizer, "chat_template", None)) if use_chat_template is None else use_chat_template

    def text(self, prompt: str, response: str) -> str:
        if self.use_chat_template:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}, {"role": "assistant", "content": response}], tokenize=False)
        return prompt + response

    @torch.no_grad()
    def score_batch(self, prompts: list[str], responses: list[str]) -> list[float]:
        """One score per (prompt, response), `batch_size` at a time."""
        if len(prompts) != len(responses):
            raise ValueError(f"RewardModelScorer: {len(prompts)} prompts but {len(responses)} responses")
        texts = [self.text(p, r or "") for p, r in zip(prompts, responses)]
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[start : start + self.batch_size], padding=True, return_tensors="pt",
                                 add_special_tokens=False, truncation=self.max_length is not None, max_length=self.max_length)
            enc = {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask")}
            logits = self.model(**enc).logits.float()[:, self.label_index]       # [b]
            if self.normalize == "sigmoid":
                logits = torch.sigmoid(logits)
            elif self.normalize == "affine":
                logits = (logits - self.shift) / self.scale
            out.extend(logits.cpu().tolist())
        return out

    def __call__(self, response: str, sample: dict) -> float:
        """The reward-function form: score `response` to `sample["prompt"]`."""
        return self.score_batch([sample.get("prompt", "")], [response])[0]


def build_tiny_reward_model(path: str, *, hidden_size: int = 32, num_layers: int = 2, num_heads: int = 2,
                            max_positions: int = 256, seed: int = 0) -> str:
    """Write a random tiny Qwen2ForSequenceClassification (num_labels=1) + char tokenizer to `path`."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from engines.models.modeling import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=hidden_size * 3,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=max(1, num_heads // 2),
        max_position_embeddings=max_positions, num_labels=1, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    torch.manual_seed(seed)
    model = Qwen2ForSequenceClassification(config)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
