"""Load a model by spec: 'default' (embedded SmolLM2), 'gemma3-270m' (embedded Gemma 3), 'tiny[:opts]',
an HF directory, a .gguf, or a model id resolved through huggingface_hub.

A checkpoint is served only by the family its config's `model_type` names (FAMILIES); any other is
refused at load, naming it and what is supported, rather than decoded by the wrong forward."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from specdec.models.args import UnsupportedModelError
from specdec.models.decoder import Decoder
from specdec.models.gemma import Gemma
from specdec.models.llama import Transformer
from specdec.models.phi3 import Phi3
from specdec.models.qwen import Qwen2, Qwen3

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16,
          "int4": torch.bfloat16,  # weight-only int4 with bfloat16 activations (models.quant)
          "auto": torch.float32}  # int4 where it pays, else float32 (load_model)
# model_type -> our forward for it
FAMILIES: dict[str, type[Decoder]] = {
    "llama": Transformer, "mistral": Transformer, "qwen2": Qwen2, "qwen3": Qwen3,
    "gemma2": Gemma, "gemma3_text": Gemma, "phi3": Phi3,
}
HUB_FILES = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]  # no .bin/.pth copies
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


class ModelNotFoundError(FileNotFoundError):
    """A spec that names no model we can reach."""


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


HINTS = {"gemma3": " (multimodal Gemma 3, 4B and up; the text-only gemma3_text checkpoints, 270M and 1B, are)"}


def family_of(model_type: str | None) -> type[Decoder]:
    cls = FAMILIES.get(model_type)
    if cls is None:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported{HINTS.get(model_type, '')}; "
                                    f"supported model types: {', '.join(sorted(FAMILIES))}")
    return cls


def model_dir(spec: str, progress: bool = True) -> Path | None:
    """The directory holding a spec's weights and tokenizer (None for tiny models)."""
    if spec.startswith("tiny"):
        return None
    from specdec.models.default import EMBEDDED, embedded_model_dir, specdec_home

    if spec in EMBEDDED:
        return embedded_model_dir(EMBEDDED[spec], progress)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return _convert_gguf(path, specdec_home() / "models" / path.stem, progress)
    if (path / "config.json").exists():
        return path
    if path.exists() or not _HUB_ID.fullmatch(spec):
        raise ModelNotFoundError(f"no model at {spec!r}: expected 'default', 'gemma3-270m', 'tiny', "
                                 "an HF model dir, a .gguf file or a model id")
    return hub_snapshot(spec)


def hub_snapshot(model_id: str) -> Path:
    """A hub model's files (config, safetensors, tokenizer) in the local HF cache, as transformers
    resolves ids; a clear error when no hub is reachable and they are not cached."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return Path(snapshot_download(model_id, allow_patterns=HUB_FILES))
    except LocalEntryNotFoundError as e:
        cause = str(e.__cause__ or e).splitlines()[0]
        raise ModelNotFoundError(
            f"{model_id!r} is neither a model spec nor a local path, and no model hub is reachable to fetch it "
            f"({cause}); download it where a hub is reachable and pass its directory") from None
    except GatedRepoError:
        raise ModelNotFoundError(f"{model_id!r} is gated on the hub: accept its license and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"no model {model_id!r} on the hub (a private one needs HF_TOKEN)") from None


def read_model_type(d: Path) -> str | None:
    return json.loads((d / "config.json").read_text()).get("model_type")


def load_model(spec: str, device: str = "cpu", dtype: str | torch.dtype = "float32", progress: bool = True,
               eager: bool = False) -> Decoder:
    """dtype 'int4': weight-only int4 with bfloat16 activations (CPU); 'auto': int4 where it pays
    (models.quant.pays), else float32. An int4 model's passes are compiled unless `eager`."""
    from specdec.models import quant
    from specdec.models.default import use_compile_cache

    use_compile_cache()
    model = _load_model(spec, resolve_device(device), resolve_dtype(dtype), progress)
    if dtype == "auto" and quant.pays(model):
        model, dtype = model.to(quant.ACT_DTYPE), "int4"
    if dtype == "int4":
        if next(model.parameters()).device.type != "cpu":
            raise ValueError("dtype 'int4' runs on torch's CPU int4 kernel; on a GPU use 'bfloat16'")
        quant.quantize_model(model, compiled=not eager)
    return model


def _load_model(spec: str, device: torch.device, dtype: torch.dtype, progress: bool) -> Decoder:
    d = model_dir(spec, progress)
    if d is None:
        from specdec.models.tiny import build_from_spec

        return build_from_spec(spec).to(device=device, dtype=dtype)
    cls = family_of(read_model_type(d))  # before transformers reads it: it may not know the type at all
    from safetensors.torch import load_file
    from transformers import AutoConfig

    args = cls.hf_args(AutoConfig.from_pretrained(d))
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelNotFoundError(f"{d} has no *.safetensors weights")
    sd: dict = {}
    for f in files:
        sd.update(load_file(f))
    with torch.device("meta"):
        model = cls(args)
    model = model.to_empty(device="cpu")
    model.load_hf_state_dict(sd)
    return model.to(device=device, dtype=dtype).eval()


def load_tokenizer(spec: str, progress: bool = True):
    d = model_dir(spec, progress)
    if d is None:
        from specdec.models.tiny import tiny_tokenizer

        return tiny_tokenizer()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(d)


def _convert_gguf(gguf: Path, target: Path, progress: bool) -> Path:
    if not (target / "model.safetensors").exists():
        from specdec.models.default import _convert

        _convert(gguf, target, progress)
    return target
