"""The native GGUF reader and loader: the same metadata and tensors as gguf-py's reader, the same model
as transformers' own GGUF loading, and clear refusals of broken or unsupported files."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rtserver.engine.families import UnsupportedModel, rope_tables
from rtserver.engine.gguf_file import GGUFError, GGUFFile
from rtserver.engine.gguf_load import block_decoder, dense_model, gguf_config
from rtserver.engine.model import ModelLoadError, embedded_model_path, load_model

from ..components import slow_tests_on


def test_the_reader_reads_what_gguf_py_reads():
    from gguf import GGUFReader
    from gguf.constants import GGUFValueType

    path = embedded_model_path()
    ours, theirs = GGUFFile(path), GGUFReader(str(path))
    assert set(ours.metadata) == {k for k in theirs.fields if not k.startswith("GGUF.")}
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if field.types[0] == GGUFValueType.ARRAY and field.types[-1] != GGUFValueType.STRING:
            assert np.array_equal(ours.metadata[key], np.asarray(value)), key
        else:
            assert ours.metadata[key] == value, key
    assert [t.name for t in theirs.tensors] == list(ours.tensors)
    for t in theirs.tensors:
        info = ours.tensors[t.name]
        assert info.qtype == t.tensor_type
        raw, expected = ours.raw(t.name), np.asarray(t.data)
        assert raw.shape == expected.shape and raw.dtype == expected.dtype
        assert np.array_equal(raw, expected), t.name


def _transformers_gguf(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def _same_model(path: Path) -> None:
    g = GGUFFile(path)
    ours, theirs = dense_model(g, gguf_config(g)), _transformers_gguf(path)
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    mine, reference = ours.config.to_dict(), theirs.config.to_dict()
    for key, value in reference.items():
        if key not in ("quantization_config", "transformers_version") and not key.startswith("_"):
            assert mine.get(key) == value, key


def test_the_embedded_model_loads_as_transformers_loads_it():
    _same_model(embedded_model_path())


@pytest.mark.slow
@pytest.mark.skipif(not slow_tests_on(), reason="slow: set RTSERVER_SLOW_TESTS=1")
def test_gemma_3_q4_k_m_loads_as_transformers_loads_it():
    """Gemma's norms stored as 1 + w, a tied head, sliding layers; and the K-quants' blocks of 256
    (Q4_K, Q6_K) beside Q8_0 and Q5_0, read by our reader and dequantized by gguf-py."""
    from rtbench.model_files import gemma3_270m

    _same_model(gemma3_270m())


@pytest.mark.parametrize("shape", ["embedded", "llama-tiny", "qwen2-tiny", "qwen3-tiny", "gemma3-tiny"])
def test_the_block_decoder_holds_what_transformers_holds(shape):
    """Serving a file in blocks reads its norms, biases, embedding and RoPE from plain modules: the same
    values under the same names as the transformers model, whose linears stay empty there."""
    from rtbench.model_files import random_gguf

    path = embedded_model_path() if shape == "embedded" else random_gguf(shape, "Q8_0")
    g = GGUFFile(path)
    config = gguf_config(g)
    full = dense_model(g, config)
    in_blocks = frozenset(n for n, _ in full.named_parameters() if n.endswith("_proj.weight"))
    light = block_decoder(g, config, in_blocks)
    theirs, ours = dict(full.named_parameters()), dict(light.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert param.numel() == 0 if name in in_blocks else torch.equal(param, theirs[name]), name
    assert light.generation_config.eos_token_id == full.generation_config.eos_token_id
    (want, want_index), (got, got_index) = (
        rope_tables(config, m.model.rotary_emb, 300, torch.float32) for m in (full, light)
    )
    assert got_index == want_index and len(got) == len(want) == (2 if shape == "gemma3-tiny" else 1)
    for (cos, sin), (want_cos, want_sin) in zip(got, want):
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 4.0, "rope_theta": 500000.0}])
def test_the_block_decoders_rope_is_transformers_under_llama_3_divisors(rope):
    """Llama 3 files ship their RoPE scaling as per-frequency divisors (rope_freqs), which the loader
    applies to the rotary module; linear scaling comes from the config."""
    from types import SimpleNamespace

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    from rtserver.engine.gguf_load import Rotary, _scale_rope

    fields = {"rope_parameters": rope} if rope else {}
    config = LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, **fields)
    divisors = np.linspace(1.0, 8.0, 32, dtype=np.float32)
    theirs, ours = LlamaRotaryEmbedding(config), Rotary(config, config.rope_parameters)
    for rotary in (theirs, ours):
        _scale_rope(SimpleNamespace(model=SimpleNamespace(rotary_emb=rotary)), divisors)
    (want, _), (got, _) = (rope_tables(config, r, 300, torch.float32) for r in (theirs, ours))
    assert torch.equal(got[0][0], want[0][0]) and torch.equal(got[0][1], want[0][1])


def test_a_block_decoder_refuses_a_tensor_of_the_wrong_shape():
    g = GGUFFile(embedded_model_path())
    config = gguf_config(g)
    config.intermediate_size += 32
    wrong = r"tensor blk\.0\.ffn_gate\.weight is \(1536, 576\), the model wants \(1568, 576\)"
    with pytest.raises(UnsupportedModel, match=wrong):
        block_decoder(g, config, frozenset())


def test_serving_a_gguf_file_never_imports_transformers_modelling_code():
    """The modelling code (and torch's compiler, which it imports) would hold a tenth of the process."""
    import subprocess
    import sys

    code = (
        "import sys; from rtserver.engine.model import load_model; "
        "m = load_model('embedded', dtype='gguf', threads=1); "
        "heavy = ('transformers.modeling_utils', 'torch._dynamo'); "
        "print(type(m.model).__name__, *(n in sys.modules for n in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["BlockDecoder", "False", "False"], out.stderr[-2000:]


def _write(path: Path, arch: str) -> Path:
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_an_unknown_architecture_is_refused_by_name(tmp_path):
    path = _write(tmp_path / "phi.gguf", "phi2")
    with pytest.raises(
        ModelLoadError, match=r"GGUF architecture 'phi2' is not supported \(supported: llama, qwen2"
    ):
        load_model(str(path), dtype="float32", cache_dir=tmp_path)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda b: b"GGUX" + b[4:], "not a GGUF file"),
        (lambda b: b[:4] + (7).to_bytes(4, "little") + b[8:], "GGUF version 7"),
        (lambda b: b[:40], "truncated"),
        (lambda b: b[:-16], "runs past the end"),
        (lambda b: b[:8] + (1 << 40).to_bytes(8, "little") + b[16:], "tensors"),
    ],
)
def test_a_broken_file_is_a_clear_error(tmp_path, damage, message):
    good = _write(tmp_path / "good.gguf", "llama").read_bytes()
    GGUFFile(tmp_path / "good.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(damage(good))
    with pytest.raises(GGUFError, match=message):
        GGUFFile(bad)
    with pytest.raises(ModelLoadError, match=message):
        load_model(str(bad), dtype="float32", cache_dir=tmp_path)


def test_a_gguf_tokenizer_keeps_no_python_copy_of_its_vocabulary(tmp_path):
    """A GGUF file's tokenizer, converted (a first start) or read back from its cache, holds its
    vocabulary and merges in its Rust tokenizer only: the Python copies its model class built that from
    are dropped (a large vocabulary's are hundreds of thousands of strings). It encodes and decodes as
    the class's own load of the cache."""
    from transformers import AutoTokenizer

    from rtbench.model_files import random_gguf
    from rtserver.engine.model import _gguf_config, gguf_tokenizer

    path = random_gguf("qwen3-tiny", "Q8_0")  # Qwen2's tokenizer class
    config = _gguf_config(path)
    first = gguf_tokenizer(path, tmp_path, config)
    again = gguf_tokenizer(path, tmp_path, config)
    (folder,) = (tmp_path / "tokenizers").iterdir()
    own = AutoTokenizer.from_pretrained(folder)
    assert own._vocab and own._merges  # what a model class keeps
    texts = ["Hello, world!", "  two spaces\nand a line", "日本語 🤖", "<|im_start|>user\nhi<|im_end|>"]
    for tok in (first, again):
        assert type(tok) is type(own)
        assert getattr(tok, "_vocab", None) is None and getattr(tok, "_merges", None) is None
        for text in texts:
            ids = own(text)["input_ids"]
            assert tok(text)["input_ids"] == ids and tok.decode(ids) == own.decode(ids)
