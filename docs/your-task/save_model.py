"""Stand-in for your own model folder: saves flyroll's tiny character-level Qwen2 (random weights) as a
Hugging Face folder. With a real model, skip this and point model.path at its folder.
Usage: python save_model.py my-model"""
import sys

from engines.models.modeling import build_tiny_policy, save_policy

model, tokenizer = build_tiny_policy(hidden_size=64, num_layers=2, num_heads=2)
print(save_policy(model, tokenizer, sys.argv[1]))
