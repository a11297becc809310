"""The target side of the vLLM route, without patching vLLM: a transformers-shaped view of vLLM's model (so the
drafter attaches, and checks the target's signature and weights fingerprint, exactly as with transformers), and a
forward hook that records each step's attention metadata (the rows' block tables) and, for drafters that read them,
the target's final hidden states by cache slot."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

__all__ = ["StepTap", "TargetView"]


def _live_weight(module: nn.Module | None) -> torch.Tensor | None:
    """A vLLM module's weight when it holds one (vLLM's CPU backend packs linear weights for oneDNN and empties
    `weight`; embeddings keep theirs)."""
    weight = getattr(module, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.is_floating_point() and weight.numel() > 0:
        return weight
    return None


class _Checkpoint:
    """Tensors of the target's safetensors checkpoint, read by name (only those asked for are read)."""

    def __init__(self, folder: str):
        path = Path(folder)
        if not path.is_dir():  # a Hub id: vLLM loaded it from the local Hub cache
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(folder, local_files_only=True, allow_patterns=["*.safetensors", "*.json"]))
        self.files: dict[str, Path] = {}
        for file in sorted(path.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                self.files.update({name: file for name in f.keys()})  # noqa: SIM118 (safe_open has no iteration)

    def get(self, name: str) -> torch.Tensor | None:
        file = self.files.get(name)
        if file is None:
            return None
        with safe_open(str(file), framework="pt") as f:
            return f.get_tensor(name)


class TargetView(nn.Module):
    """vLLM's target seen as transformers would hold it, for `MoADrafterModel.attach`: `config` (the Hugging Face
    config vLLM read), `get_input_embeddings()` / `get_output_embeddings()` (vLLM's own weights, no copy, or the
    checkpoint's where vLLM keeps none) and `model.layers`, of which the layers the weights fingerprint samples
    (first, middle, last) hold their checkpoint weights under transformers' names and order (vLLM fuses and, on a
    CPU, repacks them). The drafter borrows the embedding and head and checks the target's signature and weights
    fingerprint as with a transformers target. Never run as a model.

    For a drafter with Target Layer Inference (`tli_layers` N > 0) the last N layers, the final norm and the RoPE
    are transformers' modules with the checkpoint's weights, on vLLM's device and in its dtype: the drafter runs
    them on its drafted positions (a copy of N layers' weights; vLLM's own layers need its paged cache and
    metadata)."""

    def __init__(self, vllm_model: nn.Module, hf_config, checkpoint: str, tli_layers: int = 0):
        super().__init__()
        from transformers import AutoModelForCausalLM

        cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.config = cfg
        ckpt = _Checkpoint(checkpoint)
        with torch.device("meta"):  # transformers' module tree, for its parameter names and order: no memory
            skeleton = AutoModelForCausalLM.from_config(cfg)
        vocab = cfg.vocab_size
        decoder = getattr(vllm_model, "model", None)
        embed = _live_weight(getattr(decoder, "embed_tokens", None))
        embed = embed[:vocab] if embed is not None else ckpt.get("model.embed_tokens.weight")
        if embed is None:
            raise ValueError(
                f"Cannot find the target's input embedding in {type(vllm_model).__name__} or its checkpoint "
                f"{checkpoint}: moa-hf serves Llama-family targets (Llama, Qwen2, Qwen3, Mistral) in vLLM."
            )
        self.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        head = _live_weight(getattr(vllm_model, "lm_head", None))
        if head is None and not getattr(cfg, "tie_word_embeddings", False):
            head = ckpt.get("lm_head.weight")
        self.lm_head = nn.Linear(embed.shape[1], vocab, bias=False, device="meta")
        self.lm_head.weight = nn.Parameter(head[:vocab] if head is not None else embed, requires_grad=False)
        decoder = skeleton.get_decoder()
        layers = decoder.layers
        sampled = {0, len(layers) // 2, len(layers) - 1}  # what `target_fingerprint` reads
        run = set(range(len(layers) - tli_layers, len(layers)))  # Target Layer Inference's
        kept = nn.ModuleList()
        for i, layer in enumerate(layers):
            if i not in sampled | run:
                kept.append(nn.Module())
                continue
            _load(layer, ckpt, f"model.layers.{i}.", strict=i in run)
            kept.append(layer.to(device=embed.device, dtype=embed.dtype) if i in run else layer)
        self.model = nn.Module()
        self.model.layers = kept
        if tli_layers > 0:
            self.model.norm = _load(decoder.norm, ckpt, "model.norm.", strict=True).to(embed.device, embed.dtype)
            self.model.rotary_emb = type(decoder.rotary_emb)(config=cfg).to(embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def get_decoder(self) -> nn.Module:
        return self.model


def _load(module: nn.Module, ckpt: _Checkpoint, prefix: str, strict: bool) -> nn.Module:
    """Set `module`'s parameters (transformers' names) to the checkpoint's tensors under `prefix`. A parameter not in
    the checkpoint stays on "meta" (so the fingerprint, which checks names, finds none), or with `strict` (a module
    that runs) raises."""
    for name, _ in list(module.named_parameters()):
        tensor = ckpt.get(prefix + name)
        if tensor is None:
            if strict:
                raise ValueError(
                    f"The target's checkpoint has no tensor {prefix + name!r}: Target Layer Inference runs the "
                    "target's last layers with its checkpoint's weights. Serve a drafter with target_layer_inference=0"
                    " instead."
                )
            continue
        module_name, _, attr = name.rpartition(".")
        setattr(module.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))
    return module


class StepTap:
    """Records the attention metadata of the target's latest forward call (vLLM's `ForwardContext`), which holds
    what the proposer needs and vLLM does not pass it: each scheduled row's block table and query length.

    With `record_hidden`, it also keeps the target's final hidden states (the output of vLLM's model: post-norm, one
    row per scheduled token) by the cache slot each token's keys/values went to (`slot_mapping`): a paged store beside
    vLLM's KV cache with the same life. A slot holds the state of the token whose keys/values it holds: a rejected
    draft's slot is rewritten by the next step like its keys/values, and a block served from the prefix cache keeps
    the states written when it was computed. `hidden_at(slots)` reads them like `PagedKVReader` reads keys/values.

    `with tap.installed(model):` registers one forward hook on vLLM's model and removes it on leaving."""

    def __init__(self, record_hidden: bool = False):
        self.metadata = None
        self.calls = 0
        self.record_hidden = record_hidden
        self.hidden: torch.Tensor | None = None  # [slots, D]: the target's final hidden state at each cache slot

    def _hook(self, module, args, output) -> None:
        from vllm.forward_context import get_forward_context, is_forward_context_available

        if not is_forward_context_available():
            return
        metadata = get_forward_context().attn_metadata
        if isinstance(metadata, list):  # micro-batching: one dict per micro-batch
            raise RuntimeError(
                "vLLM ran the target in micro-batches (dual-batch overlap); moa-hf's proposer reads one batch per "
                "step. Turn micro-batching off to use MoA."
            )
        if metadata:  # None during profiling and warm-up runs
            self.metadata = next(iter(metadata.values()))  # one KV cache group: every layer shares it
            self.calls += 1
            if self.record_hidden:
                self.record(self.metadata, output)

    def record(self, metadata, output) -> None:
        """Store the final hidden states `output` [T, D] (T >= the step's tokens; padding after them) at the step's
        `metadata.slot_mapping` (slot < 0: padding, not stored)."""
        if not isinstance(output, torch.Tensor) or output.ndim != 2:
            raise RuntimeError(
                f"vLLM's target returned {type(output).__name__} from its forward, not its final hidden states "
                "[tokens, hidden]: a drafter with context_final_hidden=True cannot read them from this model. Use a "
                "drafter with context_final_hidden=False in vLLM."
            )
        n = int(getattr(metadata, "num_actual_tokens", metadata.slot_mapping.shape[0]))
        slots = metadata.slot_mapping[:n].to(device=output.device, dtype=torch.long)  # [n]
        keep = slots >= 0
        slots, states = slots[keep], output[:n][keep]  # [m], [m, D]
        if slots.numel() == 0:
            return
        needed = int(slots.max()) + 1
        if self.hidden is None or self.hidden.shape[0] < needed:  # grows with the slots vLLM hands out
            grown = output.new_zeros(
                max(needed, 2 * (0 if self.hidden is None else self.hidden.shape[0])), output.shape[1]
            )
            if self.hidden is not None:
                grown[: self.hidden.shape[0]] = self.hidden
            self.hidden = grown
        self.hidden[slots] = states.to(self.hidden.dtype)

    def hidden_at(self, slots: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The final hidden states recorded at `slots` [B, n] (-1: none, zeros): [B, n, D]."""
        if self.hidden is None:
            raise RuntimeError(
                "No final hidden state was recorded: the proposer reads them only when the tap records them "
                "(`StepTap(record_hidden=True)`, set for drafters with context_final_hidden=True)."
            )
        slots = slots.to(self.hidden.device)
        inside = (slots >= 0) & (slots < self.hidden.shape[0])
        out = self.hidden[torch.where(inside, slots, 0)]  # [B, n, D]
        out = torch.where(inside[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
        return out if dtype is None else out.to(dtype)

    @contextlib.contextmanager
    def installed(self, model: nn.Module) -> Iterator[StepTap]:
        handle = model.register_forward_hook(self._hook)
        try:
            yield self
        finally:
            handle.remove()
