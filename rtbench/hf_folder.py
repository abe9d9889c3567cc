"""A Hugging Face model folder in a given shape with seeded random weights, as a user downloads one.

It holds config.json, model.safetensors and the tokenizer files. The config is the shape's, with the
tokenizer's token ids. The tokenizer is the embedded SmolLM2 one. transformers reads it from its GGUF and
re-saves it. Every family gets that one BPE tokenizer, Gemma 3 included. Its converter reads tokenizer.json
when there is no SentencePiece tokenizer.model. So none is trained.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from rtserver.engine.model import embedded_model_path

from .model_shapes import Shape

# A matrix's values are normal(0, GAIN / sqrt(fan-in)): unit-scale activations at any width, about
# 0.03 at Qwen3-0.6B's. The embedding is smaller: a large one, tied to the head (and scaled up by
# Gemma), makes narrow models repeat their last token. At a flat 0.02 they repeat one token too.
GAIN = 1.0
EMBED = 0.01
SPREAD = 0.02  # of the vectors: norms near 1 (or near 0 where the family stores an offset), biases
# Embedding rows past the tokenizer are zero: greedy decoding never picks a padding token, as a trained
# model never does, so a 151936-row head still yields text.
RULE = [GAIN, EMBED, SPREAD, "padding rows zero"]


def smollm2_tokenizer(cache: Path) -> Path:
    """The embedded model's tokenizer saved as tokenizer.json and friends, made once."""
    from transformers import AutoTokenizer

    folder = cache / "smollm2-tokenizer"
    if (folder / "tokenizer.json").is_file():
        return folder
    gguf = embedded_model_path()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    partial = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    tokenizer.save_pretrained(partial)
    _replace(partial, folder)
    return folder


def token_count(tokenizer: Path) -> int:
    """How many ids the saved tokenizer has (its vocabulary and added tokens)."""
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    ids: list[int] = [*data["model"]["vocab"].values(), *(t["id"] for t in data["added_tokens"])]
    return max(ids) + 1


def _token_ids(tokenizer: Path) -> dict[str, int]:
    """bos, eos and pad ids of the saved tokenizer, read from its own files."""
    data = json.loads((tokenizer / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in data["added_tokens"]}
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    out = {}
    for role in ("bos", "eos", "pad"):
        token = settings.get(f"{role}_token")
        if isinstance(token, dict):
            token = token.get("content")
        if token in ids:
            out[f"{role}_token_id"] = ids[token]
    return out


def weights_digest(shape: Shape) -> str:
    """A short digest of the shape's config and the rule above. A cached folder's values depend on these."""
    text = json.dumps([shape.config, RULE], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def _generator(seed: int, name: str) -> torch.Generator:
    """One generator per tensor. A tensor's values do not depend on which others exist."""
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def random_tensors(shape: Shape, seed: int, config_dir: Path, tokens: int) -> dict[str, torch.Tensor]:
    """Every parameter of the family's model in `shape`, seeded per tensor name. `tokens` is the tokenizer's
    size (the embedding's used rows).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(config_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    # Gemma stores a norm's weight as an offset from 1 (its RMSNorm multiplies by 1 + w).
    norm_centre = 0.0 if shape.model_type.startswith("gemma") else 1.0
    dtype = getattr(torch, str(shape.config.get("torch_dtype", "float32")))
    tensors = {}
    for name, param in model.named_parameters():  # tied weights appear once
        if name == "lm_head.weight" and shape.config.get("tie_word_embeddings"):
            continue
        values = torch.randn(param.shape, generator=_generator(seed, name))
        if "embed_tokens" in name:
            values *= EMBED
            values[tokens:] = 0.0
        elif param.dim() >= 2:
            values *= GAIN / param.shape[-1] ** 0.5
        else:
            values = values * SPREAD + (norm_centre if _is_norm(name) else 0.0)
        tensors[name] = values.to(dtype).contiguous()
    return tensors


def write_folder(shape: Shape, seed: int, folder: Path, tokenizer: Path) -> None:
    """Make `folder` (atomically): config.json, model.safetensors and the tokenizer's files."""
    from safetensors.torch import save_file

    partial = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(tokenizer, partial)
    config = {**shape.config, **_token_ids(tokenizer)}
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = random_tensors(shape, seed, partial, token_count(tokenizer))
    save_file(tensors, str(partial / "model.safetensors"), {"format": "pt"})
    _replace(partial, folder)


def _replace(partial: Path, folder: Path) -> None:
    if folder.exists():  # another process finished first; its copy is the same
        shutil.rmtree(partial)
    else:
        partial.replace(folder)
