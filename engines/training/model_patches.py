"""Changes to a Hugging Face causal LM that make the update faster without changing what it computes:
`compile_decoder_layers` (torch.compile each decoder layer, `training.compile`) and
`tied_embedding_grad_in_place` (a tied input embedding whose backward adds into the shared weight's
`.grad` in place). engines/training/update.py applies them; docs/training.md and docs/benchmarks.md have
the measurements.
"""

from __future__ import annotations

import torch


def compile_decoder_layers(model) -> list[str]:
    """torch.compile every decoder layer of a Hugging Face causal LM, in place (`nn.Module.compile`:
    the parameters, their names and the saved checkpoint stay as they are); one graph serves all
    layers (their parameters are its inputs). A KV cache passed through compiled layers makes dynamo
    guard on each layer's cache entry and recompile per layer, so the update runs plain forwards
    then (no shared prefix). Returns the compiled layers' names. Measured on an H200
    (docs/benchmarks.md): the GRPO step of a Qwen2.5-0.5B shape went from 27.8% to 39.0% MFU, and
    beat the eager shared-prefix forward on groups of 8 samples (1.28-1.48x); compiling only the
    MLPs and norms, which would keep the shared prefix, gained less and lost at 75% prompt."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    if layers is None:
        raise ValueError(f"training.compile: {type(model).__name__} has no decoder layers at "
                         "model.get_decoder().layers (Hugging Face Llama/Qwen2/Mistral-style models have)")
    for layer in layers:
        layer.compile()
    return [f"layers.{i}" for i in range(len(layers))]


class _LookupGradIntoWeight(torch.autograd.Function):
    """`F.embedding` whose backward adds the looked-up rows' gradients straight into `weight.grad`
    (`index_add_`, rows at `padding_idx` left out as nn.Embedding does) and hands autograd nothing
    for the weight."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return torch.nn.functional.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (ids,) = ctx.saved_tensors
        weight, rows, grad = ctx.weight, ids.reshape(-1), grad.reshape(-1, grad.shape[-1])
        if ctx.padding_idx is not None:
            keep = rows != ctx.padding_idx
            rows, grad = rows[keep], grad[keep]
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.index_add_(0, rows, grad.to(weight.grad.dtype))
        return None, None, None


class TiedEmbedding(torch.nn.Embedding):
    """An input embedding whose weight is also the LM head's: under grad its backward adds into the
    parameter's `.grad` in place (`_LookupGradIntoWeight`). See `tied_embedding_grad_in_place`."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        if not (torch.is_grad_enabled() and self.weight.requires_grad) or self.max_norm is not None or self.scale_grad_by_freq or self.sparse:
            return super().forward(input)
        return _LookupGradIntoWeight.apply(input, self.weight, self.padding_idx)


def tied_embedding_grad_in_place(model) -> bool:
    """When the input embedding shares its weight with the LM head (SmolLM2, Qwen2.5 <= 3B), let the
    embedding's backward add its rows straight into the parameter's `.grad` (`TiedEmbedding`, the
    module's class swapped in place). Autograd sums the gradients a parameter gets from several
    uses before accumulating them, and it summed these out of place: the dense backward built a
    zero [V, H] tensor per lookup, a sparse one (`nn.Embedding.sparse`) made `dense + sparse` copy
    the LM head's [V, H] gradient per lookup -- two 113 MB tensors allocated and written per
    SmolLM2 micro-batch with the shared prefix (two lookups), for the few hundred rows a batch
    touches. Now the LM head's gradient is accumulated alone (taken over as `.grad`, or added to
    it in place) and each lookup adds its rows to that. `.grad` stays one dense tensor (AdamW,
    clipping and checkpoints see what they saw). A plain `nn.Embedding` only (a subclass keeps its
    own forward); untied embeddings are left alone. Only for a plain module in one process: the
    wrappers' reducers and shards hook the gradients autograd hands them. Returns whether it
    changed the embedding."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    out = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(emb) is not torch.nn.Embedding or out is None or getattr(out, "weight", None) is not emb.weight:
        return False
    emb.__class__ = TiedEmbedding
    return True
