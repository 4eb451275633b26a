"""Prompts to token ids and back, with the model's own chat template."""
from __future__ import annotations


class TextTokenizer:
    def __init__(self, hf_tokenizer):
        self.hf = hf_tokenizer
        eos = {hf_tokenizer.eos_token_id} if hf_tokenizer.eos_token_id is not None else set()
        for name in ("<|im_end|>", "<|endoftext|>"):
            tid = hf_tokenizer.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != hf_tokenizer.unk_token_id:
                eos.add(tid)
        self.eos_token_ids = eos

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """One token on its own, special tokens included (logprobs name every token they list)."""
        return self.hf.decode([token_id])

    def chat(self, messages: list[dict]) -> list[int]:
        out = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, dict) or hasattr(out, "input_ids"):  # transformers 5 may return a BatchEncoding
            out = out["input_ids"]
        return list(out)
