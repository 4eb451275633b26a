"""What makes a standalone draft model usable with a verifier: the same tokenizer (a draft token id
must mean the verifier's token), and logits over the verifier's vocabulary.

Checked when the draft is loaded, so a mismatched pair fails at start with both names, rather
than decoding garbage: drafts would simply all be rejected, or index past the verifier's logits."""
from __future__ import annotations

import json

# strings whose token ids must agree: words, code, digits, whitespace runs, non-Latin text, emoji
SAMPLES = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # square\n",
    "1234567890 3.14159 -42 1e-9",
    "  two spaces,\ttab,\n\nnewlines",
    "Ünïcödé — 数学 и русский текст 🙂",
]


class IncompatiblePairError(ValueError):
    """A draft model that cannot draft for this verifier."""


def check_tokenizers_agree(draft_tok, verifier_tok, draft: str, verifier: str) -> None:
    nd, nv = len(draft_tok), len(verifier_tok)
    if nd != nv:
        raise IncompatiblePairError(f"draft {draft!r} and verifier {verifier!r} have different tokenizers "
                                    f"({nd} vs {nv} tokens); a draft model must share the verifier's tokenizer")
    for s in SAMPLES:
        a, b = draft_tok.encode(s, add_special_tokens=False), verifier_tok.encode(s, add_special_tokens=False)
        if a != b:
            raise IncompatiblePairError(f"draft {draft!r} and verifier {verifier!r} tokenize {s!r} differently "
                                        f"({a[:8]}... vs {b[:8]}...); a draft model must share the verifier's tokenizer")


def vocab_size(spec: str, progress: bool = True) -> int:
    """The size of a model's logits, from its config alone (no weights loaded)."""
    from specdec.models.loader import model_dir

    d = model_dir(spec, progress)
    if d is None:
        from specdec.models.tiny import spec_args

        return spec_args(spec).vocab_size
    return int(json.loads((d / "config.json").read_text())["vocab_size"])


def check_pair(draft: str, verifier: str, progress: bool = True) -> int:
    """Refuse a draft whose tokenizer differs from the verifier's, before its weights load; returns
    the verifier's vocabulary size, to pad the draft's logits to (Qwen2.5's small models have fewer
    padding rows than its large ones: the same tokenizer, a narrower LM head)."""
    v = vocab_size(verifier, progress)
    if draft == verifier:
        return v
    from specdec.models.loader import load_tokenizer

    check_tokenizers_agree(load_tokenizer(draft, progress), load_tokenizer(verifier, progress), draft, verifier)
    vd = vocab_size(draft, progress)
    if vd > v:
        raise IncompatiblePairError(f"draft {draft!r} has {vd} logits, more than verifier {verifier!r}'s {v}")
    return v
