"""Engine configuration (nanoGPT style: every field says what it is)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineConfig:
    verifier: str = "default"  # 'default' (SmolLM2-135M-Instruct), 'tiny[:opts]', an HF dir or a .gguf
    draft: str = "default"  # 'default' (shipped draft), 'ngram', 'none', 'tiny[:opts]' or a model path
    num_speculative_tokens: int = 4  # K drafts per round; 0 = plain verifier decoding
    adaptive: bool = False  # choose K per round from acceptance and the measured cost curve
    device: str = "cpu"  # 'cpu', 'cuda', 'cuda:1' or 'auto'
    dtype: str = "float32"  # 'float32', 'bfloat16' or 'float16'
    max_seqs: int = 16  # KV cache slots per model (sequences resident at once)
    max_model_len: int = 2048  # context window: prompt + output tokens
    prefix_caching: bool = True  # new sequences start from the longest cached prefix (freed or live slots)
    max_batch_size: int = 16  # sequences per verifier pass
    num_threads: int = 0  # torch CPU threads; 0 = leave torch's default
    ngram_max: int = 4  # longest suffix the n-gram proposer matches
    lookup_min_n: int = 3  # before the draft, try prompt lookup: a suffix match this long drafts for free (0 = off)
    tune_layouts: bool = True  # time the verifier's weight layouts per matmul row count at load (CPU)
    progress: bool = True  # show progress bars when fetching / converting models
