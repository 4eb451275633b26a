"""Load a model by spec: 'default' (embedded SmolLM2), 'tiny[:opts]', an HF directory, or a .gguf."""
from __future__ import annotations

from pathlib import Path

import torch

from specdec.models.llama import ModelArgs, Transformer

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    return dtype if isinstance(dtype, torch.dtype) else DTYPES[dtype]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def model_dir(spec: str, progress: bool = True) -> Path | None:
    """The directory holding a spec's weights and tokenizer (None for tiny models)."""
    if spec.startswith("tiny"):
        return None
    if spec == "default":
        from specdec.models.default import default_verifier_dir

        return default_verifier_dir(progress)
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        from specdec.models.default import specdec_home

        return _convert_gguf(path, specdec_home() / "models" / path.stem, progress)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"no model at {spec!r}: expected 'default', 'tiny', an HF model dir or a .gguf file")
    return path


def load_model(spec: str, device: str = "cpu", dtype: str | torch.dtype = "float32", progress: bool = True) -> Transformer:
    device, dtype = resolve_device(device), resolve_dtype(dtype)
    d = model_dir(spec, progress)
    if d is None:
        from specdec.models.tiny import build_from_spec

        return build_from_spec(spec).to(device=device, dtype=dtype)
    from safetensors.torch import load_file
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(d)
    sd: dict = {}
    for f in sorted(d.glob("*.safetensors")):
        sd.update(load_file(f))
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_hf(cfg))
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

