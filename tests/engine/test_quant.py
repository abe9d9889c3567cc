"""The GGUF file's quantized blocks (engine/quant.py) and the kernel that multiplies with them: blocks
read from the file equal the dense weights exactly, the kernel equals a float32 matmul of the
dequantized weights up to rounding, decode attention over the paged pool equals SDPA, and the engine
in dtype gguf answers as float32 does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rtserver.config import EngineSettings
from rtserver.engine import quant
from rtserver.engine.backend import SamplingParams
from rtserver.engine.kv import KVCacheManager
from rtserver.engine.linear import BlockEmbedding, BlockLinear, OneDNNLinear
from rtserver.engine.model import embedded_model_path, load_model
from rtserver.engine.plan import StepItem
from rtserver.engine.runner import ModelRunner
from rtserver.engine.sequence import Sequence

from ..conftest import chat_prompt


@pytest.fixture(scope="module")
def kernel():
    k = quant.load_kernel(Path("~/.cache/rtserver").expanduser())
    if k is None:  # the default dtype depends on it: a machine that cannot build it must say so
        pytest.fail(f"the quantized kernel did not build: {quant.kernel_error()}")
    k.set_panel_rows(1 << 40)  # the small-step path; an engine started earlier set its probed switch
    return k


@pytest.fixture(scope="module")
def blocks(smol):
    cfg = smol.model.config
    return quant.read_gguf_weights(
        embedded_model_path(), cfg.model_type, cfg.num_attention_heads, cfg.num_key_value_heads
    )


def random_blocks(fmt: str, n: int, k: int, seed: int) -> quant.QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    qbytes, fields = quant.FORMATS[fmt]
    qs = torch.randint(0, 256, (n, k // 32 * qbytes), generator=g, dtype=torch.uint8)
    scales = (torch.randn(n, k // 32, fields, generator=g) * 0.05).half()
    return quant.QuantizedWeight(fmt, qs, scales)


def test_blocks_read_from_the_file_equal_the_dense_weights(smol, blocks):
    """Every quantized tensor of the embedded file, dequantized, is bit-equal to the weight transformers
    loaded (q/k rows un-permuted the same way); the tied output head comes from the embedding."""
    dense = smol.model.state_dict()
    assert len(blocks) == 7 * smol.model.config.num_hidden_layers + 1
    assert {b.format for b in blocks.values()} == {"Q4_1", "Q8_0"}
    for name, w in blocks.items():
        assert torch.equal(w.dequantize(), dense[name]), name


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0"])
def test_kernel_equals_a_float32_matmul_of_the_dequantized_weight(kernel, fmt):
    """Row counts 1..9 cross the kernel's 4-row passes; widths 32, 96 and 1536 one block, an odd count
    (the integer path's last block alone) and many; activations of mixed magnitudes and a zero block.
    The integer path is held to its own arithmetic (fixed-point activations) tightly, and to float32's
    within what 16-bit activations allow."""
    fixed = kernel.fixed_point_activations
    # float unpacking sums in float32 (order differs from F.linear's); the integer path is exact but
    # for its float32 scaling
    tol = {"rtol": 1e-5, "atol": 2e-4} if fixed else {"rtol": 1e-4, "atol": 1e-3}
    for k in (32, 96, 1536):
        w = random_blocks(fmt, 72, k, seed=k)
        for m in range(1, 10):
            x = torch.randn(m, k) * torch.rand(m, k) * 4
            x[0, :32] = 0.0
            got = quant.quantized_matmul(kernel, x, w)
            torch.testing.assert_close(got, quant.reference_matmul(x, w, fixed), **tol)
            # against float32: each activation moved by at most half its block's step, times |w|
            want = quant.reference_matmul(x, w)
            step = x.view(m, -1, 32).abs().amax(-1, keepdim=True).expand(m, k // 32, 32).reshape(m, k)
            bound = (step / quant.FIXED_POINT_MAX / 2) @ w.dequantize().abs().T if fixed else 0
            assert ((got - want).abs() <= bound + 1e-4 * want.abs() + 1e-3).all()


def test_fixed_point_reference_keeps_16_bits_of_each_block():
    x = torch.randn(3, 96) * torch.tensor([1e-3, 1.0, 1e3]).repeat_interleave(32)
    got = quant.fixed_point_reference(x)
    step = x.view(3, 3, 32).abs().amax(-1, keepdim=True) / quant.FIXED_POINT_MAX
    # half a step, plus float32's rounding of q * step itself (a few ulp of x)
    xb = x.view(3, 3, 32)
    assert ((got.view(3, 3, 32) - xb).abs() <= step / 2 + xb.abs() * 2**-21).all()
    assert torch.equal(quant.fixed_point_reference(torch.zeros(2, 64)), torch.zeros(2, 64))


def test_kernel_on_the_real_weights(kernel, blocks):
    fixed = kernel.fixed_point_activations
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        x = torch.randn(3, blocks[name].shape[1])
        got = quant.quantized_matmul(kernel, x, blocks[name])
        want = quant.reference_matmul(x, blocks[name], fixed)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_kernel_runs_on_torchs_openmp_threads_without_a_second_runtime(kernel):
    """The kernel's at::parallel_for is OpenMP compiled into the module: it must be built with it (or it
    runs on one thread) and must share torch's libgomp rather than load a second one. Packages that
    bundle a private copy for themselves (sentencepiece's under sentencepiece.libs) do not count."""
    if "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch does not use OpenMP here")
    assert "-fopenmp" in quant._openmp_flags()
    maps = Path("/proc/self/maps").read_text().splitlines()
    runtimes = {line.split()[-1] for line in maps if "libgomp" in line or "libiomp" in line}
    shared = {r for r in runtimes if ".libs/" not in r or "/torch" in r}
    assert len(shared) == 1, runtimes


def test_kernel_refuses_what_it_cannot_multiply(kernel):
    w = random_blocks("Q4_1", 8, 64, seed=1)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        quant.quantized_matmul(kernel, torch.randn(2, 64, dtype=torch.float64), w)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        quant.quantized_matmul(kernel, torch.randn(2, 48), w)
    with pytest.raises(RuntimeError, match="do not match"):
        quant.quantized_matmul(kernel, torch.randn(2, 96), w)
    with pytest.raises(RuntimeError, match=r"dm must be float16 \[N, K/32, 2\]"):
        kernel.q4_1_mm(torch.randn(2, 64), w.qs, w.scales.float())


KV_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize(
    ("d", "heads", "kv_heads"),
    [(64, 9, 3), (128, 16, 8), (256, 4, 1), (80, 10, 1), (72, 6, 2)],  # head sizes of 4 + 1 vectors, none
)
def test_decode_attention_reads_the_pool_in_place_like_sdpa(kernel, d, heads, kv_heads, kv_dtype):
    """Query heads per KV head from 1 to 10 (in fours and a rest), head sizes in whole 64s, with a
    remainder of one vector, and one that is no whole number of vectors; rows few and many. A 16-bit
    pool equals SDPA over its values as float32: only storing K/V rounds."""
    torch.manual_seed(0)
    slots = 400
    k_pool, v_pool = (
        torch.randn(slots, kv_heads, d).to(kv_dtype),
        torch.randn(slots, kv_heads, d).to(kv_dtype),
    )
    lengths = [1, 5, 40, 17, 16, 333]  # whole vectors of scores and partial ones
    table = torch.zeros(len(lengths), max(lengths), dtype=torch.long)
    for r, n in enumerate(lengths):
        table[r, :n] = torch.randperm(slots - 1)[:n] + 1
    q = torch.randn(len(lengths), heads, d)
    got = kernel.decode_attention(q, k_pool, v_pool, table, torch.tensor(lengths), d**-0.5)
    # two rows take tasks per KV head, six a task per row: the same arithmetic
    two = kernel.decode_attention(q[:2], k_pool, v_pool, table[:2], torch.tensor(lengths[:2]), d**-0.5)
    assert torch.equal(two, got[:2])
    kf, vf = k_pool.float(), v_pool.float()
    for r, n in enumerate(lengths):
        k, v = kf[table[r, :n]].transpose(0, 1), vf[table[r, :n]].transpose(0, 1)
        want = F.scaled_dot_product_attention(q[r].view(kv_heads, heads // kv_heads, d), k, v, scale=d**-0.5)
        torch.testing.assert_close(got[r], want.reshape(heads, d), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the pool"):
        bad = table.clone()
        bad[0, 0] = slots
        kernel.decode_attention(q, k_pool, v_pool, bad, torch.tensor(lengths), 1.0)
    with pytest.raises(RuntimeError, match="of one type"):
        kernel.decode_attention(q, k_pool, v_pool.double(), table, torch.tensor(lengths), 1.0)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("window", [0, 7])
def test_prefill_attention_is_causal_over_the_pool_like_sdpa(kernel, window, kv_dtype):
    """Prompt chunks of three items (one starting mid-context, as a later chunk or a kept session does)
    in one call: each row attends to its item's positions up to its own, or its last `window` of them."""
    torch.manual_seed(1)
    slots, d, heads, kv_heads = 300, 64, 9, 3
    k_pool, v_pool = (
        torch.randn(slots, kv_heads, d).to(kv_dtype),
        torch.randn(slots, kv_heads, d).to(kv_dtype),
    )
    chunks = [(0, 12), (20, 5), (0, 33)]  # (first position, rows)
    table = torch.zeros(len(chunks), 53, dtype=torch.long)
    item, position = [], []
    for b, (start, n) in enumerate(chunks):
        table[b, : start + n] = torch.randperm(slots - 1)[: start + n] + 1
        item += [b] * n
        position += range(start, start + n)
    q = torch.randn(len(item), heads, d)
    got = kernel.prefill_attention(
        q, k_pool, v_pool, table, torch.tensor(item), torch.tensor(position), window, d**-0.5
    )
    kf, vf = k_pool.float(), v_pool.float()
    for r, (b, pos) in enumerate(zip(item, position)):
        ctx = table[b, max(0, pos - window + 1) if window else 0 : pos + 1]
        k, v = kf[ctx].transpose(0, 1), vf[ctx].transpose(0, 1)
        want = F.scaled_dot_product_attention(q[r].view(kv_heads, heads // kv_heads, d), k, v, scale=d**-0.5)
        torch.testing.assert_close(got[r], want.reshape(heads, d), rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="outside the pool"):
        bad = table.clone()
        bad[2, 32] = slots
        kernel.prefill_attention(q, k_pool, v_pool, bad, torch.tensor(item), torch.tensor(position), 0, 1.0)
    with pytest.raises(RuntimeError, match="position is outside"):
        far = torch.tensor(position)
        far[0] = 53
        kernel.prefill_attention(q, k_pool, v_pool, table, torch.tensor(item), far, 0, 1.0)
    with pytest.raises(RuntimeError, match="item is outside"):
        beyond = torch.tensor(item) + 1
        kernel.prefill_attention(q, k_pool, v_pool, table, beyond, torch.tensor(position), 0, 1.0)


def _greedy(runner: ModelRunner, kv: KVCacheManager, tok, prompts: list[list[int]], n: int) -> list[int]:
    out = []
    for ids in prompts:
        seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
        seq.kv, _ = kv.acquire(ids, len(ids) + n)
        start, step = 0, ids
        for _ in range(n):
            (logits,) = runner.forward([StepItem(seq, seq.kv, start, step, "last")])
            start += len(step)
            step = [int(logits[-1].argmax())]
            out.append(step[0])
        kv.release(seq.kv)
    return out


def test_small_steps_on_the_blocks_answer_as_float32(smol, kernel, blocks):
    """Decode steps (one row) through the fused decode layers, every linear on its blocks, give
    float32's greedy tokens."""
    tok = smol.tokenizer
    prompts = [chat_prompt(tok, t) for t in ("Tell me a short fact about the number 7.", "Name a colour.")]
    cfg = smol.model.config
    answers = []
    for use in (False, True):
        kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
        runner = ModelRunner(smol.model, kv, 512, **({"blocks": blocks, "kernel": kernel} if use else {}))
        if use:
            assert runner.use_attention_kernel(kernel)
            runner.choose_fused_decode()
            assert runner.fused_decode
        answers.append(_greedy(runner, kv, tok, prompts, 16))
    assert answers[1] == answers[0]


def test_engine_in_dtype_gguf_runs_every_linear_on_its_blocks_and_says_so(
    smol, kernel, monkeypatch, tmp_path
):
    """No dense copy of a quantized linear exists: each one has only its blocks, the greedy answers are
    the float32 engine's, and /health names the choice. Without the kernel: float32, and why."""
    from rtserver.engine.core import Engine

    loaded = load_model("embedded", dtype="gguf", threads=2)
    engine = Engine(loaded, EngineSettings(kv_budget_mb=16), release_dense_weights=True)
    chosen = engine.health()["kernels"]
    assert loaded.dtype_name == "gguf" and chosen["linears_on_blocks"] == "121 of 121"
    assert "Q4_1/Q8_0" in chosen["weights"] and "probe" in chosen["why"]
    runner = engine.runner
    assert all(
        isinstance(lin, BlockLinear)
        for lin in [runner.lm_head, *(lin for L in runner.layers for lin in L.linears)]
    )
    assert isinstance(runner.embed, BlockEmbedding)
    # every layer's and the head's panels kept unpacked for many-row steps (the prompts below take
    # them); the Q8_0 tensors kept as panels only
    linears = [runner.lm_head, *(lin for L in runner.layers for lin in L.linears)]
    parts = [(f, p) for lin in linears for f, p in zip(lin.blocks.args[0], lin.panels)]
    assert all(bool(p.numel()) or f == "Q8_0P" for f, p in parts) == kernel.fixed_point_activations
    assert any(f == "Q8_0P" for f, _ in parts) == kernel.fixed_point_activations
    assert chosen["kept_panels_mb"] == pytest.approx(
        sum(lin.panel_bytes() for lin in linears) / 2**20, abs=0.1
    )
    prompts = [chat_prompt(smol.tokenizer, t) for t in ("Hi!", "Count from one to five.")]
    cfg = smol.model.config
    kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
    dense = _greedy(ModelRunner(smol.model, kv, 512), kv, smol.tokenizer, prompts, 12)
    assert _greedy(runner, engine.kv, smol.tokenizer, prompts, 12) == dense
    # No compiler (or a failed build): plain float32, and /health says why.
    monkeypatch.setattr("rtserver.engine.quant.load_kernel", lambda cache: None)
    monkeypatch.setattr("rtserver.engine.quant.kernel_error", lambda: "CalledProcessError: no c++")
    unbuilt = load_model("embedded", dtype="gguf", threads=2)
    fallback = Engine(unbuilt, EngineSettings(kv_budget_mb=16)).health()["kernels"]
    why = "the quantized kernel could not be built (CalledProcessError: no c++)"
    assert fallback == {"weights": "float32", "why": why} and not unbuilt.blocks


def test_16_bit_kv_keeps_the_float32_kv_greedy_replies(smol, kernel):
    """The embedded model on its blocks, 24 chat prompts x 32 greedy tokens: the default KV (float16)
    against float32 KV, everything else equal. Each token's K/V rounds to 16 bits, so a reply may fork
    where two tokens nearly tie; at least 90% stay identical (the bench's figure is 32 of 32)."""
    from rtserver.engine.core import Engine

    texts = [f"Tell me a short fact about the number {i}." for i in range(16)] + [
        "Where is my order #AB-1234?",
        "Write a haiku about the sea.",
        "How do I reset my password?",
        "Summarize: the parcel arrived late and damaged.",
        "What is the capital of France?",
        "List three colours.",
        "Thanks, that helped a lot!",
        "Explain rain to a child.",
    ]
    prompts = [chat_prompt(smol.tokenizer, t) for t in texts]
    replies = {}
    for kv_dtype in ("auto", "float32"):
        engine = Engine(
            load_model("embedded", dtype="gguf", threads=2),
            EngineSettings(kv_budget_mb=32, kv_dtype=kv_dtype),
        )
        pool = engine.health()["kv"]
        assert pool["dtype"] == ("float16" if kv_dtype == "auto" else "float32") and pool["dtype_why"]
        replies[kv_dtype] = [_greedy(engine.runner, engine.kv, smol.tokenizer, [p], 32) for p in prompts]
    same = sum(a == b for a, b in zip(replies["auto"], replies["float32"]))
    print(f"\n16-bit KV: {same} of {len(prompts)} greedy replies equal float32 KV's")
    assert same >= 0.9 * len(prompts), same


def test_panels_are_kept_layer_by_layer_within_the_budget(smol, kernel, blocks):
    """The first layers whose panels fit are kept, in order; the bytes kept are what they take. Without
    VNNI (float32 panels) none are."""
    import copy

    cfg = smol.model.config
    kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
    runner = ModelRunner(copy.deepcopy(smol.model), kv, 512, blocks=blocks, kernel=kernel)
    if not kernel.fixed_point_activations:
        assert runner.keep_panels(1 << 40) == 0
        assert not any(p.numel() for L in runner.layers for lin in L.linears for p in lin.panels)
        return
    layer = sum(lin.panel_bytes() for lin in runner.layers[0].linears)
    assert 3 << 20 < layer < 6 << 20  # a byte a weight and the scales: 3.5 M weights a layer
    assert runner.keep_panels(2 * layer + layer // 2) == 2 * layer
    kept = [all(p.numel() for lin in L.linears for p in lin.panels) for L in runner.layers]
    assert kept[:3] == [True, True, False] and not any(kept[2:])


def quantize_q8_0(w: torch.Tensor) -> quant.QuantizedWeight:
    n, k = w.shape
    blocks = w.view(n, k // 32, 32)
    d = (blocks.abs().amax(-1, keepdim=True) / 127).half()
    q = torch.round(blocks / d.float().clamp(min=1e-8)).clamp(-127, 127).to(torch.int8)
    return quant.QuantizedWeight("Q8_0", q.view(torch.uint8).reshape(n, k), d)


def test_fused_decode_layers_equal_the_torch_forward_with_biases(tiny_qwen2, kernel):
    """A Qwen2 model (q/k/v biases, GQA) on Q8_0 blocks: decode steps of several rows with different
    context lengths through the fused layers give the logits of the torch forward over the same
    (dequantized) weights; prompts run fused too (alone, and as their own group beside the decodes), a
    prompt joining mid-step on the blocks unfused."""
    import copy

    model = copy.deepcopy(tiny_qwen2.model)
    blocks = {}
    for name, param in model.named_parameters():
        if param.dim() == 2 and "embed" not in name:
            blocks[name] = quantize_q8_0(param.data)
            param.data = blocks[name].dequantize()
    cfg = model.config
    results = []
    # the torch path; fused on the blocks
    for fused in (False, True):
        kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 16, torch.float32, 4 << 20, 16)
        on_blocks = {"blocks": blocks, "kernel": kernel} if fused else {}
        runner = ModelRunner(copy.deepcopy(model), kv, 512, **on_blocks)
        if fused:
            runner.use_attention_kernel(kernel)
            runner.choose_fused_decode()
            assert runner.fused_decode
        torch.manual_seed(1)
        seqs, steps = [], []
        for n in (3, 20, 41):
            ids = torch.randint(0, cfg.vocab_size, (n,)).tolist()
            seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
            seq.kv, _ = kv.acquire(ids, n + 5)
            steps.append(runner.forward([StepItem(seq, seq.kv, 0, ids, "last")])[0])  # a fused prompt
            seqs.append((seq, n))
        for t in range(3):
            items = [StepItem(seq, seq.kv, n + t, [7 + t], "last") for seq, n in seqs]
            steps.append(torch.cat(runner.forward(items)))
        # A prompt prefilled in a decode step (listed first): fused, a group of its own beside the decodes.
        ids = torch.randint(0, cfg.vocab_size, (6,)).tolist()
        mixed = Sequence(ids, SamplingParams(), eos_token_ids=set())
        mixed.kv, _ = kv.acquire(ids, 7)
        items = [StepItem(seq, seq.kv, n + 3, [5], "last") for seq, n in seqs]
        out = runner.forward([StepItem(mixed, mixed.kv, 0, ids, "last"), *items])
        steps.append(torch.cat(out[1:]))
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0, -1:].float()
        torch.testing.assert_close(out[0], theirs, rtol=1e-4, atol=1e-4)
        # A prompt joining a fused step before its last layer: it goes on beside the fused rows.
        ids = torch.randint(0, cfg.vocab_size, (9,)).tolist()
        late = Sequence(ids, SamplingParams(), eos_token_ids=set())
        late.kv, _ = kv.acquire(ids, 10)
        items = [StepItem(seq, seq.kv, n + 4, [11], "last") for seq, n in seqs]
        joining = [StepItem(late, late.kv, 0, ids, "last")]
        joined = torch.cat(runner.forward(items, lambda layer, new=joining: new if layer == 1 else []))
        assert len(items) == 4
        steps.append(joined[:3])
        results.append(steps)
        with torch.no_grad():
            theirs = model(torch.tensor([ids])).logits[0, -1:].float()
        torch.testing.assert_close(joined[3:], theirs, rtol=1e-4, atol=1e-4)
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("route", ["onednn", "blocks"])
def test_serving_weights_without_dense_copies_answer_as_float32(smol, kernel, blocks, route):
    """Serving (release_dense_weights): float32 linears on oneDNN-packed copies, or every linear and the
    head on their blocks with lookups in the embedding's blocks (no dense embedding). Batched greedy
    tokens equal float32's, and a few columns' logits equal the full logits' columns."""
    import copy

    tok = smol.tokenizer
    texts = ("Tell me a short fact about the number 7.", "Name a colour.", "Say hello in French.")
    prompts = [chat_prompt(tok, t) for t in texts]
    cfg = smol.model.config
    answers = []
    for packed in (False, True):
        kv = KVCacheManager(cfg.num_hidden_layers, cfg.num_key_value_heads, 64, torch.float32, 8 << 20, 16)
        on_blocks = {"blocks": blocks, "kernel": kernel} if packed and route == "blocks" else {}
        runner = ModelRunner(copy.deepcopy(smol.model) if packed else smol.model, kv, 512, **on_blocks)
        if packed:
            runner.use_attention_kernel(kernel)
            runner.release_dense_weights()
            qkv = runner.layers[0].qkv
            if route == "onednn":
                assert isinstance(qkv, OneDNNLinear)
            else:
                assert isinstance(runner.embed, BlockEmbedding) and isinstance(runner.lm_head, BlockLinear)
                assert isinstance(qkv, BlockLinear)
        seqs = []
        for ids in prompts:
            seq = Sequence(ids, SamplingParams(), eos_token_ids=set())
            seq.kv, _ = kv.acquire(ids, len(ids) + 12)
            seqs.append(seq)
        logits = runner.forward([StepItem(s, s.kv, 0, ids, "last") for s, ids in zip(seqs, prompts)])
        out = []
        for t in range(12):
            picks = [int(lg[-1].argmax()) for lg in logits]
            out.append(picks)
            items = [StepItem(s, s.kv, len(ids) + t, [p], "last") for s, ids, p in zip(seqs, prompts, picks)]
            logits = runner.forward(items)
        columns = [tok.convert_tokens_to_ids(w) for w in ("yes", "no", "Paris")]
        hs = torch.randn(3, cfg.hidden_size)
        full = runner.lm_head(hs)
        torch.testing.assert_close(runner._column_logits(hs, columns), full[:, columns], rtol=1e-5, atol=1e-4)
        answers.append(out)
    assert answers[1] == answers[0]
