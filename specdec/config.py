"""Engine configuration: one set of fields and defaults, shared by the library, the CLI and the
Serve app (whose `AppArgs` extends this class). Every field says what it is, in one line."""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    verifier: str = Field("default", description="Verifier model: 'default' (embedded SmolLM2-135M-Instruct), 'gemma3-270m', 'tiny[:opts]', an HF dir, a .gguf or a hub model id.")
    draft: str = Field("default", description="Draft: 'default' (the shipped draft head), 'ngram', 'none', 'tiny[:opts]' or a model path.")
    num_speculative_tokens: int = Field(8, ge=0, le=16, description="K drafts per round (with adaptive: the most it chooses, and the head drafts past its first only where sure); 0 = plain decoding.")
    draft_tree_width: int = Field(1, ge=1, le=8, description="Children per node of the draft head's token tree (its likeliest tokens); 1 = a chain. With adaptive, only the drafts whose confidence pays for their place in the pass are verified.")
    adaptive: bool = Field(True, description="Choose K each round from measured acceptance, load and cost (0 when speculation does not pay).")
    device: str = Field("cpu", description="Torch device of the models: 'cpu', 'cuda', 'cuda:N' or 'auto'.")
    dtype: str = Field("auto", description="Weights: 'auto' (int4 for models of 10M+ parameters on CPUs with AVX2 or better, else float32), 'int4' (Q4_1 blocks and a Q8 LM head times int8-quantised activations, as llama.cpp computes; CPU), 'float32', 'bfloat16' or 'float16'.")
    enforce_eager: bool = Field(False, description="Run reduced-precision (int4) passes eagerly rather than compiled: starts faster (a first compile takes ~1 min, cached after), decodes slower.")
    max_seqs: int = Field(32, ge=1, description="KV-cache slots per model (sequences resident at once); least recently used ones are evicted beyond it.")
    max_model_len: int = Field(2048, ge=16, description="Context window: prompt + output tokens.")
    prefix_caching: bool = Field(True, description="A new sequence starts from the longest prefix it shares with a cached one (a system prompt, a chat's history).")
    max_batch_size: int = Field(16, ge=1, description="Sequences per verifier pass.")
    num_threads: int = Field(0, ge=0, description="torch CPU threads for the verifier (0 = torch's default).")
    ngram_max: int = Field(4, ge=1, le=16, description="Longest suffix prompt lookup (the 'ngram' proposer) matches.")
    lookup_min_n: int = Field(3, ge=0, le=16, description="Before the draft, try prompt lookup: a suffix match this long drafts for free (0 = off).")
    tune_layouts: bool = Field(True, description="Time the verifier's weight layouts per matmul row count at load, cached per machine (CPU).")
    progress: bool = Field(True, description="Show progress bars while fetching and converting models.")
